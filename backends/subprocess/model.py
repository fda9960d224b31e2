"""A model served by running a program per batch, speaking the subprocess tensor contract.

Input: the single-tensor form sends the raw bytes on stdin with
``NEREID_INPUT_SHAPE`` / ``NEREID_INPUT_DTYPE``; the multi-tensor form sends one
framed tensor per input, in textproto order, and names them in
``NEREID_INPUT_NAMES``. Output: one framed tensor per declared output, in
textproto order, in the file ``NEREID_OUTPUT_PATH``.

A model on ``cuda:<i>`` runs with ``CUDA_VISIBLE_DEVICES`` set to the i-th GPU
the server may use: the i-th entry of the server's own ``CUDA_VISIBLE_DEVICES``
when it has one (a scheduler's allocation), else ``<i>``; a GPU that is not
there is a load error (see :func:`~nereid.backends.subprocess.gpus.visible_gpus`), as in Triton.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import BinaryIO

from nereid.backend import ModelContext
from nereid.dtypes import DType
from nereid.errors import (ConfigError, MissingModelFile, ModelFailure, ModelKilled, OutOfMemory, Unavailable,
                           cap_message)
from nereid.files import descriptor_path, not_regular_reason, remove_tree
from nereid.run_folders import longest_run_folder, make_run_folder
from nereid.runtime_options import RuntimeOptions
from nereid.signature import TEXTPROTO_NAME, ModelSignature, TensorSpec, dims_match, load_textproto_signature
from nereid.tensors import NamedTensor, tensor_buffer, tensor_bytes

from nereid.backends.scratch import full_scratch_hint
from nereid.backends.subprocess.dtype_names import CONTRACT_NAMES, contract_name
from nereid.backends.subprocess.framing import (MAX_BYTES_ELEMENTS, MAX_BYTES_ROWS, frame_buffers, read_body,
                                               read_header)
from nereid.backends.subprocess.gpus import visible_gpus
from nereid.backends.subprocess.runner import (DEFAULT_PATH, SERVER_LIMITS, FolderNotEntered, ProcessGroups,
                                               ProcessResult, StdinData, run_model_process, run_not_started,
                                               timed_out)

log = logging.getLogger(__name__)

# Descriptors of the model folder kept across renames (the oldest is closed past this).
MAX_FOLDER_FDS = 8

# Inherited by children from the server's environment; everything else is dropped. Python's two settings of where
# bytecode goes are a deployment's (an image's PYTHONDONTWRITEBYTECODE=1 keeps __pycache__/ out of a read-only or
# shared repository): dropped, a main.py importing a helper of its folder wrote one there (the deploy hunt).
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "HOME", "SYSTEMROOT", "LD_LIBRARY_PATH", "PYTHONDONTWRITEBYTECODE",
                 "PYTHONPYCACHEPREFIX")

# What separates the names in NEREID_INPUT_NAMES and NEREID_OUTPUT_NAMES.
NAMES_SEPARATOR = ","
# Linux's MAX_ARG_STRLEN: the longest "NAME=value" string (with its NUL) that exec passes to a program.
MAX_ENV_STRING_BYTES = 32 * 4096
# The most the outputs of one run may take in all. One gRPC message carries at most 2 GiB - 1 bytes (grpcio sends
# no more: nereid.protocol.grpc_service.MAX_SEND_MESSAGE_BYTES), whatever server.max_message_bytes says (that
# bounds requests): larger outputs could never reach their client, so they are refused from their header, never
# read into memory.
MAX_OUTPUT_BYTES = (1 << 31) - 1
# A frame header on a line of its own in what a run printed: its framed tensor went to stdout, not to the file.
_PRINTED_HEADER = re.compile(rf"^(?:{'|'.join(CONTRACT_NAMES.values())}) [0-9,]*$", re.MULTILINE)
# What a tensor's bytes decode to in a run's output (its text decoded with errors="replace"): none of it is text.
_BINARY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
# The share of such characters past which a tail is binary data, not text with a stray byte.
_BINARY_SHARE = 0.1

class SubprocessModel:
    """Shared machinery of the python and cpp backends; subclasses say what to run."""

    platform = "nereid_subprocess"
    backend_name: str = "subprocess"  # for messages: "unknown option of the <backend_name> backend"
    entry_file: str = ""  # the program's file in the model folder (main.py, main.cpp)
    # Where visible_gpus looks for GPUs (a test points them at a folder tree of its own).
    proc_root = Path("/proc")
    dev_root = Path("/dev")

    def __init__(self, context: ModelContext) -> None:
        self.context = context
        self._signature: ModelSignature | None = None
        self._groups = ProcessGroups()
        # Descriptors of the loaded folder (one more per rename), closed at unload: runs use the
        # newest as their working directory (see run_folder).
        self._folder_fds: list[int] = []
        # CUDA_VISIBLE_DEVICES of every run, set by load: none for a CPU model (and before load).
        self._cuda_visible_devices = ""
        # Run folders that could not be removed whole after their run (see _remove_run_folder), tried again at
        # unload.
        self._runs_left: set[Path] = set()
        self._runs_left_lock = threading.Lock()

    # -- Model protocol -------------------------------------------------
    def load(self) -> None:
        """Read the textproto (output_shape is required), check the runtime options, prepare the program."""
        # Held first: the folder whose files this load reads is the one every run of this version enters
        # (see run_folder), even when a new folder takes its name while it serves.
        self._hold_folder()
        try:
            path = self.context.folder / TEXTPROTO_NAME
            self._require_file(TEXTPROTO_NAME)
            signature = load_textproto_signature(path)
            self._check_tensor_names(path, signature)
            self._require_file(self.entry_file)
            self._signature = signature
            self.check_options()
            self._cuda_visible_devices = self.run_gpu()
            self.prepare()
        except BaseException:
            SubprocessModel.unload(self)  # a failed load is not unloaded by the server: let the folder go
            raise

    def signature(self) -> ModelSignature:
        assert self._signature is not None, "load() first"
        return self._signature

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """Run the program once for this batch and read back its framed outputs."""
        signature = self.signature()
        batch = inputs[0].shape[0] if inputs and signature.batches else 1
        # Counted as running from here, before its program starts (cold or warm): a terminate_running
        # meanwhile ends it as soon as it starts, instead of missing it (see ProcessGroups.running).
        with self._groups.running():
            work_dir = make_run_folder(self.runs_dir())
            try:
                output_path = work_dir / "output"
                env = self._environment(inputs, output_path, work_dir)
                result = self._launch_in_folder(env, self._stdin(inputs))
                name = self.context.name
                if result.terminated and result.returncode != 0:
                    # Killed by terminate_running, not a crash: the version was being retired.
                    raise Unavailable(f"model '{name}' was being unloaded (removed, replaced by a new version, or "
                                      "the server stopping) and this run was still going after shutdown_grace_s "
                                      f"({self.context.config_name}): the run was stopped")
                if result.timed_out:
                    raise timed_out(name, self.context.settings.timeout_s, "its process group was killed",
                                    self.context.config_name, result.output_tail)
                try:
                    if result.returncode != 0:
                        tail = f"; output tail: {result.output_tail}" if result.output_tail else ""
                        fault = ModelKilled if result.returncode < 0 else ModelFailure
                        raise fault(f"model '{name}' {result.describe()}{tail}{self.failed_run_hint()}")
                    return self._read_outputs(output_path, batch, result.output_tail)
                except ModelFailure as err:
                    # Its exit code, or a missing or short output, is all a run whose writes met a full disk shows.
                    if type(err) in (ModelFailure, ModelKilled) and (full := full_scratch_hint(work_dir)):
                        raise type(err)(f"{err}{full}") from None
                    raise
            finally:
                self._remove_run_folder(work_dir)

    def runs_dir(self) -> Path:
        """Where this model's runs make their folders: the server's folder of run folders, shared by its models
        (the context's ``runs_dir``), else the model's scratch folder."""
        return self.context.runs_dir if self.context.runs_dir is not None else self.context.scratch_dir

    def _remove_run_folder(self, work_dir: Path) -> None:
        """Remove a run's folder, with what the program made read-only in its TMPDIR; one that stays (a process
        the run detached still writing there) is tried again at unload. (The folder they share goes only with the
        server's scratch folder: made in the model's scratch folder, they went with that, after the unload.)"""
        if not remove_tree(work_dir):
            with self._runs_left_lock:
                self._runs_left.add(work_dir)

    def _launch_in_folder(self, env: dict[str, str], stdin: StdinData) -> ProcessResult:
        """``launch``, with a run that could not start in the loaded folder (or failed while the server's user
        cannot enter it) failed saying so (see :meth:`folder_refused`): the same for every subprocess backend,
        cold, warm and cpp."""
        try:
            result = self.launch(env=env, stdin=stdin)
        except OSError as err:
            if err.errno not in SERVER_LIMITS:
                raise
            # The server's passing condition, not the model's fault: UNAVAILABLE, as a run no thread could start
            # for is, and the next request tries again.
            raise run_not_started(self.context.name, err.errno, err.strerror or str(err)) from None
        except FolderNotEntered as err:
            # Told by the launcher, whatever the folder's mode is by now (a mode put back a moment later let the
            # run's traceback through as the answer).
            raise self.folder_refused(err.error) from None
        except ModelFailure as err:
            # A plain failure to start the run (a python model's parent restarted in the folder meanwhile). Not a
            # run killed, or past its timeout, nor one the scheduler sends again, NotStarted: each says what it is.
            if type(err) is ModelFailure and (refused := self.folder_refused()) is not None:
                raise refused from None
            raise
        if result.returncode != 0 and not result.timed_out and not result.terminated:
            # A run that entered the folder and failed as its mode changed under it. Looked at only once a run
            # failed: a run that succeeds pays nothing for it.
            refused = self.folder_refused()
            if refused is not None:
                raise refused
        return result

    def folder_refused(self, error: OSError | None = None) -> ModelFailure | None:
        """The failure of a run whose folder the server's user cannot enter (its mode changed while the model
        serves: ``chmod 000``): ``error``, the refusal the run met; without it, None unless the folder cannot be
        entered now.

        Each run starts in the loaded folder, its working directory, and failed
        there with the launcher's own error as the answer (the warm parent's
        ``os.fchdir`` traceback, Popen's ``Permission denied:
        '/proc/self/fd/18'``), which named neither the folder nor the remedy.
        INTERNAL (a ModelFailure), not UNAVAILABLE: the model is loaded and
        READY, and its run failed on the server's side, as Triton answers a
        failed execution (INTERNAL); UNAVAILABLE tells clients and load
        balancers to retry at once, which cannot help until an operator gives
        the folder its mode back.
        """
        fd, folder, name = self.folder_fd(), self.context.folder, self.context.name
        try:
            # Search permission (x), which the run's chdir needs: "." is looked up in the folder itself.
            os.stat(".", dir_fd=fd) if fd is not None else os.stat(folder / ".")
        except PermissionError as err:
            return ModelFailure(f"model '{name}': its folder {folder} cannot be entered by the server's user (uid "
                                f"{os.geteuid()}): {err.strerror} ({self._folder_mode('its mode is {} now')}), and "
                                "every run starts in it: give it back read and search permission (chmod u+rx "
                                f"{folder}, or the mode it had); the version loaded serves again as soon as it can "
                                "be entered")
        except OSError:  # (gone: a run still starts in the loaded folder's descriptor, see run_folder)
            pass
        if error is None:
            return None
        # Refused when the run started, and not now: its mode was changed back meanwhile (or is being changed).
        return ModelFailure(f"model '{name}': its folder {folder} could not be entered by the server's user (uid "
                            f"{os.geteuid()}) when this run started: {error.strerror or error} (its mode was changed "
                            f"while it serves; {self._folder_mode('it is {} now')}), and every run starts in it: "
                            f"keep its read and search permission (chmod u+rx {folder}); the next run starts in it "
                            "as long as it can be entered")

    def _folder_mode(self, said: str) -> str:
        """``said`` with the loaded folder's mode now (``000``); "its mode changed" when it cannot be read."""
        fd = self.folder_fd()
        try:
            return said.format(f"{os.stat(fd if fd is not None else self.context.folder).st_mode & 0o7777:03o}")
        except OSError:
            return "its mode changed"

    def relocate(self, context: ModelContext) -> None:
        """Serve on from a renamed folder with the same files (``nereid.backend.Relocatable``)."""
        self.context = context
        self.prepare_relocated()
        self._hold_folder()

    def unload(self) -> None:
        """Nothing stays running between requests; the folder is let go, run folders left behind removed."""
        fds, self._folder_fds = self._folder_fds, []
        for fd in fds:
            os.close(fd)
        with self._runs_left_lock:
            left, self._runs_left = self._runs_left, set()
        for work_dir in left:
            remove_tree(work_dir)

    def run_folder(self) -> str:
        """The working directory of a run: the loaded folder, wherever it is now.

        A run queued just before its folder was renamed or deleted (the server
        hears of it a moment later) still starts there: the path goes through a
        descriptor of the folder, which follows a rename and outlives a delete,
        and never leads to another folder put under the same name.
        """
        fd = self.folder_fd()
        if fd is not None:
            return descriptor_path(fd)  # resolved by the child, before it execs
        return str(self.context.folder)

    def folder_fd(self) -> int | None:
        """An ``O_PATH`` descriptor of the loaded folder (the newest, after renames); None where none is held
        (no ``O_PATH`` or no /proc: runs then use the folder's path)."""
        return self._folder_fds[-1] if self._folder_fds else None

    def _hold_folder(self) -> None:
        try:
            fd = os.open(self.context.folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, AttributeError):  # gone already, or no O_PATH (not Linux): runs use the path
            return
        if not os.path.isdir(descriptor_path(fd)):  # no /proc here
            os.close(fd)
            return
        # Older ones stay open a while: a run may be starting with one right now.
        self._folder_fds.append(fd)
        while len(self._folder_fds) > MAX_FOLDER_FDS:
            os.close(self._folder_fds.pop(0))

    def returns_fresh_outputs(self) -> bool:
        """Each run's outputs are read from its own output file (see ReturnsFreshOutputs)."""
        return True

    def longest_run_s(self) -> float | None:
        """``timeout_s``: a run still going then is killed (a replaced version's drain waits that long)."""
        return self.context.settings.timeout_s

    def terminate_running(self) -> None:
        """End every running program now (the server is stopping and its grace has passed), and the program of
        every run still starting (inside ``infer``, its program not yet listed) as soon as it starts."""
        self._groups.kill_all()

    def _require_file(self, file_name: str) -> None:
        """ConfigError unless the folder holds ``file_name`` as a regular file; a FIFO or a folder there is named
        as such, not reported missing."""
        path = self.context.folder / file_name
        if not os.path.lexists(path):
            raise MissingModelFile(f"model '{self.context.name}': missing {file_name} in {self.context.folder}")
        if (reason := not_regular_reason(path)) is not None:
            raise ConfigError(f"model '{self.context.name}': {reason}")

    def _check_tensor_names(self, path: Path, signature: ModelSignature) -> None:
        """Refuse names the contract's environment variables cannot carry (every run would fail otherwise).

        ``NEREID_INPUT_NAMES`` and ``NEREID_OUTPUT_NAMES`` join the names with
        commas, so a name holding one would read as two; no environment variable
        can hold a NUL; and exec refuses a variable longer than
        :data:`MAX_ENV_STRING_BYTES`. Frames carry no names, so nothing else limits them.
        """
        for kind, variable, specs in (("input", "NEREID_INPUT_NAMES", signature.inputs),
                                      ("output", "NEREID_OUTPUT_NAMES", signature.outputs)):
            for spec in specs:
                problem = None
                if "\0" in spec.name:
                    problem = "holds a NUL character, which no environment variable can carry"
                elif NAMES_SEPARATOR in spec.name:
                    problem = f"holds a comma, the separator of the names in {variable}"
                if problem is not None:
                    raise ConfigError(f"model '{self.context.name}': {path}: {kind} "
                                      f"{cap_message(repr(spec.name), 200)} {problem}; rename it")
            size = len(f"{variable}={NAMES_SEPARATOR.join(spec.name for spec in specs)}".encode()) + 1
            if size > MAX_ENV_STRING_BYTES:
                raise ConfigError(f"model '{self.context.name}': {path}: the {kind} names make {variable} "
                                  f"{size} bytes, more than the {MAX_ENV_STRING_BYTES} a program's environment "
                                  "variable may hold; shorten them")

    # -- for subclasses ---------------------------------------------------
    def check_options(self) -> None:
        """Check the model's ``runtime:`` options (nereid.yaml's ``backends:`` defaults included).

        By default a subprocess backend has none, so every key is refused, where
        it was written. Called by ``load`` before ``prepare``, so a typo fails
        before a compile.
        """
        RuntimeOptions(self.context.settings.runtime, self.context.settings_origin, self.backend_name, (),
                       prefix=f"model '{self.context.name}': ")

    def prepare(self) -> None:
        """Build the program if it needs building (called by ``load``, once ``entry_file`` is there)."""

    def prepare_relocated(self) -> None:
        """Point what ``prepare`` made at the new folder (``context`` is already the new one)."""

    def command(self) -> list[str]:
        """The argv to run, with the model folder as working directory."""
        raise NotImplementedError

    def launch(self, *, env: dict[str, str], stdin: StdinData) -> ProcessResult:
        """Run the program once for a batch (``stdin``: what its stdin gets, see ``runner.StdinData``): by default
        a fresh process running ``command()``."""
        return run_model_process(self.command(), cwd=self.run_folder(), env=env, stdin=stdin,
                                 timeout_s=self.context.settings.timeout_s, groups=self._groups)

    def base_environment(self) -> dict[str, str]:
        """What every run of this model sees: the inherited few variables, the model name, its GPU."""
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        env.setdefault("PATH", DEFAULT_PATH)
        env["NEREID_MODEL_NAME"] = self.context.name
        # A CPU model sees no GPU; a GPU model sees exactly its own.
        env["CUDA_VISIBLE_DEVICES"] = self._cuda_visible_devices
        return env

    def run_gpu(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` of this model's runs: "" for a CPU model, the GPU of ``cuda:<i>``.

        That GPU is the i-th the server may use (as jax numbers them for the xla
        backend): the i-th entry of the server's CUDA_VISIBLE_DEVICES when it has
        one. ConfigError (the model is UNAVAILABLE) when there is no such GPU.
        """
        device = self.context.device
        if not device.is_gpu:
            return ""
        gpus = visible_gpus(os.environ, self.proc_root, self.dev_root)
        origin = self.context.settings_origin or self.context.config_name
        where = f"model '{self.context.name}': device {device} ({origin})"
        if gpus.count is not None and device.index >= gpus.count:
            advice = "use one of them or set device: cpu" if gpus.count else "set device: cpu"
            raise ConfigError(f"{where}: {gpus.described}; {advice}")
        return gpus.listed[device.index] if gpus.listed is not None else str(device.index)

    # -- contract ---------------------------------------------------------
    def _environment(self, inputs: list[NamedTensor], output_path: Path, work_dir: Path) -> dict[str, str]:
        env = self.base_environment()
        env["TMPDIR"] = str(work_dir)
        env["NEREID_OUTPUT_PATH"] = str(output_path)
        signature = self.signature()
        env["NEREID_OUTPUT_NAMES"] = NAMES_SEPARATOR.join(spec.name for spec in signature.outputs)
        if signature.single_tensor_form:
            if inputs:
                env["NEREID_INPUT_SHAPE"] = ",".join(str(d) for d in inputs[0].shape)
                env["NEREID_INPUT_DTYPE"] = contract_name(inputs[0].dtype)
        else:
            env["NEREID_INPUT_NAMES"] = NAMES_SEPARATOR.join(t.name for t in inputs)
        return env

    def environment_at_load(self) -> dict[str, str]:
        """A run's environment as far as load can tell it, for a bound on what every run sends: the names of the
        textproto's tensors, TMPDIR and the output path as long as a run's (a single-tensor run's input shape and
        dtype, a few bytes, are left out)."""
        signature = self.signature()
        work_dir = longest_run_folder(self.runs_dir())
        env = self._environment([], work_dir / "output", work_dir)
        if not signature.single_tensor_form:
            env["NEREID_INPUT_NAMES"] = NAMES_SEPARATOR.join(spec.name for spec in signature.inputs)
        return env

    def _stdin(self, inputs: list[NamedTensor]) -> StdinData:
        # Views of the inputs where they already hold the bytes: a copy of a 500 MB input held the GIL for 2.5 s
        # on the run's thread, and with it every health probe of the server (found by a bug hunt). The frames of
        # several inputs are written one after the other, never joined into one copy.
        if self.signature().single_tensor_form:
            return tensor_buffer(inputs[0]) if inputs else b""
        return frame_buffers(inputs)

    def _read_outputs(self, path: Path, batch: int, output_tail: str = "") -> list[NamedTensor]:
        """The framed outputs at ``path``; ``output_tail``: what the run printed last, for an output it never
        wrote."""
        signature = self.signature()
        outputs: list[NamedTensor] = []
        taken = 0  # the bytes of the outputs read so far (BYTES with their length prefixes, as a response has them)
        with os.fdopen(self._open_output(path, output_tail), "rb") as stream:
            start = 0  # where the body of the output before this one began
            for spec in signature.outputs:
                where = f"model '{self.context.name}': output '{spec.name}'"
                try:
                    dtype, shape = read_header(stream, where)
                except ModelFailure:
                    if outputs and (hint := _overrun_hint(stream, start, outputs[-1], spec.name, where)):
                        raise ModelFailure(f"model '{self.context.name}': {hint}") from None
                    raise
                if dtype is not spec.dtype:
                    raise ModelFailure(f"{where}: the model wrote {contract_name(dtype)}, "
                                       f"expected {contract_name(spec.dtype)}")
                shape = self._check_shape(where, spec, shape, batch)
                start = stream.tell()
                try:
                    data = read_body(stream, dtype, shape, where, MAX_OUTPUT_BYTES - taken, _output_bound(taken),
                                     MAX_BYTES_ELEMENTS * min(max(1, batch), MAX_BYTES_ROWS))
                except MemoryError:
                    # The server's condition, not the model's fault (it was "model 'm' failed: MemoryError", an
                    # ERROR with a traceback; the exhaustion hunt): the same run may well be read later.
                    message = (f"{where}: the server ran out of memory reading it (shape {list(shape)}, "
                               f"{contract_name(dtype)}); try again later")
                    log.warning("%s", message)
                    raise OutOfMemory(message) from None
                taken += stream.tell() - start
                outputs.append(NamedTensor(spec.name, dtype, data))
            if stream.read(1):
                extra = os.fstat(stream.fileno()).st_size - stream.tell() + 1  # the byte just read included
                raise ModelFailure(f"model '{self.context.name}': output file has data after the last declared "
                                   f"output: {_trailing_data_hint(outputs[-1], len(outputs), extra)}")
        return outputs

    def failed_run_hint(self) -> str:
        """What to add to the message of a run that exited non-zero or wrote no output ("; ..."): "" here; a
        backend that can tell why every run fails so says it (a python model ported from Triton as it is)."""
        return ""

    def _open_output(self, path: Path, output_tail: str = "") -> int:
        """A descriptor of the regular file at ``path``, neither a symlink followed nor a FIFO waited on.

        The file itself is checked, once opened, never its path beforehand: a
        process the run left behind may swap the path meanwhile, and a FIFO
        opened for reading blocks until a writer comes, which would hold this
        instance for ever. A symlink is not the model's output either: followed,
        the server would read, and quote in its error, a file the model pointed
        it at.
        """
        missing = f"model '{self.context.name}' exited 0 without writing its output tensor to NEREID_OUTPUT_PATH"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            # What the run printed last often says why (a run that returned early); np.save adds ".npy" to a
            # name without it, so its array lands beside the path, not at it.
            saved = path.with_name(path.name + ".npy").exists()
            npy = (" (an output.npy is there: np.save adds .npy to the name and writes no framed tensor; write the "
                   "header line and the array's bytes to the path itself)" if saved else "")
            raise ModelFailure(f"{missing}{npy}{_missing_output_tail(output_tail)}{self.failed_run_hint()}") from None
        except OSError as err:
            if err.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a symlink
                raise ModelFailure(f"{missing} (a symlink is there)") from None
            raise ModelFailure(f"model '{self.context.name}': cannot open its output tensor at NEREID_OUTPUT_PATH: "
                               f"{err.strerror or err}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ModelFailure(f"{missing} (something other than a regular file is there)")
        os.set_blocking(fd, True)
        return fd

    def _check_shape(self, where: str, spec: TensorSpec, shape: tuple[int, ...], batch: int) -> tuple[int, ...]:
        if not self.signature().batches:
            if dims_match(shape, spec.dims):
                return shape
            raise ModelFailure(f"{where}: the model wrote shape {list(shape)}, expected {list(spec.dims)}")
        if len(shape) == len(spec.dims) + 1 and shape[0] == batch and dims_match(shape[1:], spec.dims):
            return shape
        if batch == 1 and dims_match(shape, spec.dims):
            return (1, *shape)  # a batch-1 result written without its batch axis
        raise ModelFailure(f"{where}: the model wrote shape {list(shape)}, expected {[batch, *spec.dims]} "
                           f"(batch size {batch})")


def _missing_output_tail(output_tail: str) -> str:
    """"; output tail: ..." for the message of a run that wrote no output file ("" when it printed nothing); a
    tensor it printed to stdout said so, its bytes left out.

    A program that writes its framed tensor to stdout, not to the file ``NEREID_OUTPUT_PATH`` names, is a
    newcomer's slip (the new user's hunt): the message quoted the tensor's raw bytes and said nothing of it.
    """
    if not output_tail:
        return ""
    header = _PRINTED_HEADER.search(output_tail)
    if header is not None:
        shown = output_tail[:header.end()] + (" <binary data left out>" if output_tail[header.end():].strip() else "")
        return (f"; it printed a frame header ('{header.group()}') to stdout: write the framed tensor to the file "
                f"NEREID_OUTPUT_PATH names, not to stdout; output tail: {shown}")
    if len(_BINARY.findall(output_tail)) > _BINARY_SHARE * len(output_tail):
        # (The header scrolled out of the tail: only its data is left.)
        return (f"; it printed binary data to stdout ({len(output_tail)} characters of its output tail, left out): "
                "was its framed tensor written there, not to the file NEREID_OUTPUT_PATH names?")
    return f"; output tail: {output_tail}"


def _output_bound(taken: int) -> str:
    """Why an output's data may take no more than :data:`MAX_OUTPUT_BYTES` less ``taken`` (the outputs before it)."""
    bound = (f"nereid reads at most {MAX_OUTPUT_BYTES} bytes of outputs from one run (what one gRPC answer "
             "carries; over HTTP too)")
    if taken:
        bound += f" and the outputs before it took {taken}"
    return bound


def _overrun_hint(stream: BinaryIO, start: int, before: NamedTensor, name: str, where: str) -> str | None:
    """Why output ``name`` has no valid header where output ``before`` (whose body began at ``start``) ends, when
    that body was written in a wider or narrower dtype than its header says; None when that is not what happened.

    Such a body (float64 from numpy under a ``float32`` header) is 2, 4 or 8 times what its header promises, or
    a half, a quarter or an eighth of it (float16, int16 under a 32-bit header): the next header, read from
    elsewhere than where it is, named neither the output at fault nor the cause.
    """
    took = before.data.nbytes
    if before.dtype is DType.BYTES or not took:
        return None
    described = f"output '{before.name}' ({contract_name(before.dtype)} {list(before.shape)}) took {took} bytes"
    for times in (2, 4, 8):
        if _header_at(stream, start + times * took, where):
            return (f"{described}, but the header of output '{name}' comes {(times - 1) * took} bytes after them "
                    f"(was '{before.name}' written as a wider dtype than declared?)")
    for part in (2, 4, 8):
        if took % part == 0 and _header_at(stream, start + took // part, where):
            return (f"{described}, but the header of output '{name}' starts {took - took // part} bytes before "
                    f"they end (was '{before.name}' written as a narrower dtype than declared?)")
    return None


def _header_at(stream: BinaryIO, offset: int, where: str) -> bool:
    """Whether a valid output header starts at ``offset`` of ``stream``."""
    stream.seek(offset)
    try:
        read_header(stream, where)
    except ModelFailure:
        return False
    return True


def _trailing_data_hint(last: NamedTensor, declared: int, extra: int) -> str:
    """What the bytes after the last declared output suggest, for the message naming them.

    The common cause is a body written in a wider dtype than its header says
    (float64 from numpy under a ``float32`` header): the file then holds 2, 4 or 8
    times the body's bytes, which is said so; otherwise more outputs than declared.
    """
    took = last.data.nbytes if last.dtype is not DType.BYTES else len(tensor_bytes(last))
    text = (f"output '{last.name}' ({contract_name(last.dtype)} {list(last.shape)}) took {took} bytes; "
            f"{extra} more {'byte follows' if extra == 1 else 'bytes follow'} it")
    if last.dtype is not DType.BYTES and took and (took + extra) % took == 0 and (took + extra) // took in (2, 4, 8):
        return f"{text} (were they written as a wider dtype than declared?)"
    return f"{text} (does the program write more than the {declared} output(s) the textproto declares?)"
