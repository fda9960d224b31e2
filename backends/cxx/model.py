"""A cxx model: the library's ``nereid_infer`` called in-process on numpy buffers.

Inputs are passed as the request's own numpy memory and outputs as arrays the
server preallocates, so a call copies nothing; ctypes releases the GIL for the
call, so ``instances`` calls really run at once.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from nereid.backend import ModelContext
from nereid.dtypes import DType
from nereid.errors import ConfigError, MissingModelFile, ModelFailure
from nereid.signature import TEXTPROTO_NAME, ModelSignature, TensorSpec, load_textproto_signature
from nereid.tensors import NamedTensor

from nereid.backends.subprocess.dtype_names import contract_name
from nereid.backends.cpp.compiler import missing_symbols, uncompiled_sources
from nereid.backends.cxx.build import build_library
from nereid.backends.cxx.library import CTensor, NativeLibrary
from nereid.backends.cxx.options import parse_options
from nereid.backends.cxx.process_guard import process_state_kept

log = logging.getLogger(__name__)

# The error buffer handed to the library, and how much of its text is echoed
# (the library's text is untrusted input to the server's replies and logs).
ERROR_BUFFER_SIZE = 4096
ERROR_ECHO_CHARS = 1024

# Each output buffer sits between two guard zones of a known byte: a library that writes past its
# buffer (an off-by-one row, a wrong stride) writes into them, and the call fails naming the output,
# rather than silently corrupting the server's heap. A zone spans one row (at least 64 bytes, at most
# 64 KiB), so a whole extra row is caught; a stray write further away cannot be.
GUARD_BYTE = 0xA5
MIN_GUARD_BYTES = 64
MAX_GUARD_BYTES = 65536
# Read-only inputs up to this size are passed to the library as private copies (see CxxModel._call): the memory
# of a small bytes object may be shared by the whole interpreter.
PRIVATE_INPUT_BYTES = 4096
# The most bytes one output's buffer may take with its batch axis: numpy's limit on an array (a signed 64-bit
# size), less the guard zones around it. A declared output past it could never be allocated; one below it may
# still not fit in memory, which a call reports as a failure naming the output.
MAX_OUTPUT_BYTES = int(np.iinfo(np.intp).max) - 2 * MAX_GUARD_BYTES


@dataclass(frozen=True)
class _Slot:
    """What a call needs of one declared tensor, encoded once at load."""

    spec: TensorSpec
    name: bytes
    dtype: bytes


class CxxModel:
    """A shared library exporting ``nereid_infer`` (see nereid_cxx.h), called in-process."""

    platform = "nereid_cxx"

    def __init__(self, context: ModelContext) -> None:
        self.context = context
        self._signature: ModelSignature | None = None
        self._library: NativeLibrary | None = None
        self._state = ctypes.c_void_p()
        self._inputs: tuple[_Slot, ...] = ()
        self._outputs: tuple[_Slot, ...] = ()
        # Calls in nereid_infer now. A call cannot be stopped, so an unload that finds some running
        # (abandoned past the drain's grace) leaves nereid_unload and dlclose to the last one to return.
        self._calls_lock = threading.Lock()
        self._running_calls = 0
        self._retired: tuple[NativeLibrary, ctypes.c_void_p] | None = None
        self._named_call = named_caller(context.name)

    # -- Model protocol -------------------------------------------------
    def load(self) -> None:
        """Check the textproto and options, build or find the library, dlopen a copy, call nereid_load."""
        name, folder = self.context.name, self.context.folder
        if self.context.device.is_gpu:
            where = self.context.settings_origin or self.context.config_name
            raise ConfigError(f"model '{name}': the cxx backend runs on the CPU (its ABI passes no device), "
                              f"got device {self.context.device} in {where}")
        self.context.warn_timeout_ignored("a cxx model's call into its library runs in the server's process and "
                                          "cannot be interrupted")
        signature = self._load_signature()
        options = parse_options(name, self.context.settings.runtime, self.context.settings_origin, folder,
                                self.context.config_name)
        if options.library is not None:
            path = options.library
        else:
            path = build_library(name, folder, options.sources, self.context.scratch_dir, self.context.abandoned)
        try:
            library = NativeLibrary(name, path, self.context.scratch_dir, folder)
        except ConfigError as err:
            if options.library is None and "undefined symbol" in str(err):
                # (A source build links nothing but the C++ standard library: an OpenMP call or another
                # library's symbol is left for the loader, which names only the symbol; the native-models hunt.)
                # (A helper.cpp beside model.cpp that defines the symbol, not listed: the author hunt.)
                beside = uncompiled_sources(folder, options.sources, missing_symbols(str(err)))
                where = (f"; only runtime.sources are compiled: {', '.join(beside)}, beside them, is not: list it "
                         "in runtime.sources" if beside else "")
                raise ConfigError(f"{err} (a library built from runtime.sources is compiled with $CXX -O2 "
                                  "-std=c++17 -shared -fPIC, nothing else linked: a model that needs -fopenmp or "
                                  "another library takes a prebuilt library: built as it likes, or the server a CXX "
                                  f"that adds the flag, as CXX=\"c++ -fopenmp\"{where})") from None
            raise
        try:
            if library.load is not None:
                error = ctypes.create_string_buffer(ERROR_BUFFER_SIZE)
                with process_state_kept(name, "its nereid_load"):
                    status = self._named_call(library.load, name.encode(), os.fsencode(folder.resolve()),
                                              ctypes.byref(self._state), error, ERROR_BUFFER_SIZE - 1)
                if status != 0:
                    raise ConfigError(f"model '{name}': nereid_load in {path} returned {status}: "
                                      f"{_error_text(error)}")
        except BaseException:
            library.close()
            raise
        self._library, self._signature = library, signature
        self._inputs = tuple(_Slot(s, s.name.encode(), contract_name(s.dtype).encode()) for s in signature.inputs)
        self._outputs = tuple(_Slot(s, s.name.encode(), contract_name(s.dtype).encode()) for s in signature.outputs)

    def signature(self) -> ModelSignature:
        assert self._signature is not None, "load() first"
        return self._signature

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """One call of ``nereid_infer`` on this batch (runs on a worker thread, GIL released)."""
        with self._calls_lock:
            library, signature, state = self._library, self._signature, self._state
            assert library is not None and signature is not None, "load() first"
            self._running_calls += 1
        try:
            return self._call(library, signature, state, inputs)
        finally:
            with self._calls_lock:
                self._running_calls -= 1
                retired = self._retired if self._running_calls == 0 else None
                if retired is not None:
                    self._retired = None
            if retired is not None:
                log.warning("model '%s': its last abandoned call returned; unloading the library now",
                            self.context.name)
                _close(*retired)

    def _call(self, library: NativeLibrary, signature: ModelSignature, state: ctypes.c_void_p,
              inputs: list[NamedTensor]) -> list[NamedTensor]:
        batch = inputs[0].data.shape[0] if inputs and signature.batches else 1
        c_inputs = (CTensor * len(self._inputs))()
        c_outputs = (CTensor * len(self._outputs))()
        keep: list[object] = []  # shape arrays and contiguous copies, alive until the call returns
        for c_tensor, slot, tensor in zip(c_inputs, self._inputs, inputs):
            # Already C-ordered, aligned, native-endian arrays (the usual case) pass as they are.
            data = np.require(tensor.data, slot.spec.dtype.numpy, ("C", "A"))
            if not data.flags.writeable and data.nbytes <= PRIVATE_INPUT_BYTES:
                # Inputs are read only (nereid_cxx.h), but a library that writes one anyway must not reach past
                # its request: a one-byte input gRPC parsed is CPython's shared bytes object of that value, and a
                # library adding 1 to it changed that byte for every later request, to every model (the
                # correctness hunt). A small read-only input is copied; a large one is the request's own memory.
                data = data.copy()
            keep.append(data)
            _describe(c_tensor, slot, data, keep)
        outputs: list[NamedTensor] = []
        described: list[tuple[int, ctypes.Array]] = []
        guarded: list[_GuardedBuffer] = []
        for c_tensor, slot in zip(c_outputs, self._outputs):
            buffer = self._allocate(slot.spec, (batch, *slot.spec.dims) if signature.batches else slot.spec.dims)
            guarded.append(buffer)
            outputs.append(NamedTensor(slot.spec.name, slot.spec.dtype, buffer.data))
            described.append(_describe(c_tensor, slot, buffer.data, keep))
        error = ctypes.create_string_buffer(ERROR_BUFFER_SIZE)
        # One byte short of the buffer: a library that fills it without a NUL still leaves one.
        status = self._named_call(library.infer, state, c_inputs, len(c_inputs), c_outputs, len(c_outputs),
                                  error, ERROR_BUFFER_SIZE - 1)
        if status != 0:
            raise ModelFailure(f"model '{self.context.name}': nereid_infer returned {status}: {_error_text(error)}")
        self._check_outputs_untouched(c_outputs, outputs, described)
        for tensor, buffer in zip(outputs, guarded):
            overrun = buffer.overrun()
            if overrun:
                raise ModelFailure(f"model '{self.context.name}': nereid_infer wrote {overrun} output "
                                   f"'{tensor.name}' (its buffer is {tensor.data.nbytes} bytes, shape "
                                   f"{list(tensor.data.shape)}); the write landed in a guard zone and the "
                                   "result was discarded")
        return outputs

    def returns_fresh_outputs(self) -> bool:
        """Each call fills output buffers made for it (see ReturnsFreshOutputs)."""
        return True

    def unload(self) -> None:
        """Call nereid_unload, then dlclose the copy: now, or when the last running call returns.

        The scheduler drains every call first, but one still running past the
        drain's grace cannot be stopped: unmapping its code under it would crash
        the server, so the library stays loaded until that call returns.
        """
        with self._calls_lock:
            library, state = self._library, self._state
            self._library, self._state = None, ctypes.c_void_p()
            if library is None:
                return
            if self._running_calls:
                self._retired = (library, state)
                log.warning("model '%s': %d call(s) still in nereid_infer; nereid_unload and dlclose wait until "
                            "they return", self.context.name, self._running_calls)
                return
        _close(library, state)

    # -- helpers ----------------------------------------------------------
    def _load_signature(self) -> ModelSignature:
        name, folder = self.context.name, self.context.folder
        path = folder / TEXTPROTO_NAME
        if not path.is_file():
            raise MissingModelFile(f"model '{name}': missing {TEXTPROTO_NAME} in {folder}")
        signature = load_textproto_signature(path)
        for kind, specs in (("input", signature.inputs), ("output", signature.outputs)):
            for spec in specs:
                if spec.dtype is DType.BYTES:
                    raise ConfigError(f"model '{name}': {kind} '{spec.name}' is BYTES, which the cxx backend "
                                      "does not support (fixed-size datatypes only); use the python or cpp backend")
        rows = max(1, signature.max_batch_size)
        for spec in signature.outputs:
            if -1 in spec.dims:
                raise ConfigError(f"model '{name}': output '{spec.name}' has a -1 dimension {list(spec.dims)}; "
                                  "the cxx backend preallocates outputs, so their dims must be fixed")
            nbytes = rows * math.prod(spec.dims) * spec.dtype.numpy.itemsize
            if nbytes > MAX_OUTPUT_BYTES:
                batch = f"{rows} rows (max_batch_size) of " if signature.batches else ""
                raise ConfigError(f"model '{name}': output '{spec.name}' ({spec.dtype.name} {list(spec.dims)}) "
                                  f"takes {nbytes} bytes for {batch}its declared shape, more than the "
                                  f"{MAX_OUTPUT_BYTES} bytes an output buffer can hold; the cxx backend preallocates "
                                  f"outputs: check its dims in {path}")
        return signature

    def _allocate(self, spec: TensorSpec, shape: tuple[int, ...]) -> _GuardedBuffer:
        """The buffer of one output; a ModelFailure naming it when memory runs short (the load bounded its size)."""
        try:
            return _GuardedBuffer(shape, spec.dtype.numpy)
        except MemoryError:
            nbytes = math.prod(shape) * spec.dtype.numpy.itemsize
            raise ModelFailure(f"model '{self.context.name}': cannot allocate output '{spec.name}' "
                               f"({spec.dtype.name} {list(shape)}, {nbytes} bytes): out of memory") from None

    def _check_outputs_untouched(self, c_outputs: ctypes.Array, outputs: list[NamedTensor],
                                 described: list[tuple[int, ctypes.Array]]) -> None:
        """The library may only fill the buffers: a swapped pointer, size or shape would be silently lost."""
        for c_tensor, tensor, (address, shape) in zip(c_outputs, outputs, described):
            data = tensor.data
            if (c_tensor.data != address or c_tensor.byte_size != data.nbytes or c_tensor.rank != data.ndim
                    or ctypes.cast(c_tensor.shape, ctypes.c_void_p).value != ctypes.addressof(shape)
                    or tuple(shape) != data.shape):
                raise ModelFailure(f"model '{self.context.name}': nereid_infer changed the description of output "
                                   f"'{tensor.name}' (data, byte_size, rank or shape); it must fill the "
                                   f"preallocated buffer of {data.nbytes} bytes, shape {list(data.shape)}")


class _GuardedBuffer:
    """A zero-filled output array between two guard zones of GUARD_BYTE, which the library must not touch."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        count = 1
        for size in shape:
            count *= size
        nbytes = count * dtype.itemsize
        row_bytes = nbytes // shape[0] if shape and shape[0] else nbytes
        # A multiple of 64, so the array keeps the allocation's alignment.
        guard = min(max(MIN_GUARD_BYTES, -(-row_bytes // 64) * 64), MAX_GUARD_BYTES)
        self._zone = _GUARD_ZONE[:guard]
        # A bytearray starts zero-filled, so a library that skips an element leaks no stale server
        # memory; it costs about a microsecond over np.zeros, where numpy slicing cost five.
        self._backing = bytearray(nbytes + 2 * guard)
        self._backing[:guard] = self._zone
        self._backing[guard + nbytes:] = self._zone
        self.data = np.frombuffer(self._backing, dtype, count, guard).reshape(shape)

    def overrun(self) -> str:
        """'' when both guard zones are intact; else where the library wrote ('past the end of', ...)."""
        guard = len(self._zone)
        if self._backing[-guard:] != self._zone:
            return "past the end of"
        if self._backing[:guard] != self._zone:
            return "before the start of"
        return ""


_GUARD_ZONE = bytes([GUARD_BYTE]) * MAX_GUARD_BYTES


def named_caller(model: str) -> Callable[..., int]:
    """A function calling its first argument with the others, whose frame is in the file ``<cxx model 'm'>``.

    The library's calls go through it, so that a crash inside one (a C++
    exception thrown out of ``nereid_infer``: ``terminate`` and SIGABRT)
    names the model in faulthandler's trace of the crashing thread, where it
    showed only nereid's own frames, the same for every cxx model (the
    native-models hunt).
    """
    namespace: dict[str, Any] = {}
    exec(compile("def call(function, *arguments):\n    return function(*arguments)\n",
                 f"<cxx model {ascii(model)}>", "exec"), namespace)
    return namespace["call"]


def _close(library: NativeLibrary, state: ctypes.c_void_p) -> None:
    """nereid_unload (when the library has one), then dlclose its private copy."""
    try:
        if library.unload is not None:
            with process_state_kept(library.model, "its nereid_unload"):
                named_caller(library.model)(library.unload, state)
    finally:
        library.close()


def _describe(c_tensor: CTensor, slot: _Slot, data: np.ndarray, keep: list[object]) -> tuple[int, ctypes.Array]:
    """Point a ``nereid_tensor`` at an array's memory, without copying it; returns the address and shape array."""
    shape = (ctypes.c_int64 * data.ndim)(*data.shape)
    keep.append(shape)
    address: int = data.ctypes.data
    c_tensor.name = slot.name
    c_tensor.dtype = slot.dtype
    c_tensor.rank = data.ndim
    c_tensor.shape = shape
    c_tensor.data = address
    c_tensor.byte_size = data.nbytes
    return address, shape


def _error_text(buffer: ctypes.Array) -> str:
    """The library's NUL-terminated error text, decoded leniently and capped."""
    text = buffer.value.decode("utf-8", "replace").strip()
    if not text:
        return "(no error text)"
    return text if len(text) <= ERROR_ECHO_CHARS else text[:ERROR_ECHO_CHARS] + "... (truncated)"
