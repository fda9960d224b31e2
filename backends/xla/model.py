"""The xla Model: one loaded bundle, its compiled programs and its device-resident weights.

``load`` reads the manifest, checks each program's arity and types against the
manifest and the weights header, compiles (or takes from ``.cache/``) one
executable per (variant, batch size), then reads the weights with ``pread`` and
places them on the device once. ``infer`` runs ``executable(inputs...,
weights...)``: in LEADING batch mode it pads the rows with zeros up to the
smallest compiled size that fits and slices the outputs back.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from nereid.backend import ModelContext
from nereid.backends.host_cpu import host_cpu
from nereid.backends.xla.arity import arity_mismatch, donated_weights_problem
from nereid.backends.xla.bundle import CACHE_DIR, DEFAULT_WEIGHTS_FILE, BundleLayout, ProgramKey, open_bundle
from nereid.backends.xla.cache import CacheKey, CacheStats, CompileFunctions, ExecutableCache, file_sha256
from nereid.backends.xla.conformance import check_program_types
from nereid.backends.xla.device import (PjrtTarget, check_xla_flags, flags_in_force, host_lapack_problem, import_jax,
                                        jax_missing, resolve_device)
from nereid.backends.xla.dtype_tokens import token_of
from nereid.backends.xla.manifest import (EXPORT_PLATFORM, MANIFEST_NAME, DimKind, Manifest, ManifestTensor,
                                          smallest_fitting)
from nereid.backends.xla.migration import MIGRATED_FILES, migrate_for_load, open_local_bundle
from nereid.backends.xla.options import XlaOptions, parse_options
from nereid.backends.xla.program import parameter_layout_problem, python_callback_problem, read_program
from nereid.backends.xla.remote import RemoteBundle
from nereid.backends.xla.weights import format_layout_problem, read_local_weights, resolve_weights
from nereid.backends.xla.signatures import BatchMode, batch_mode, build_signature, client_axis
from nereid.backends.xla.transfer import DeviceTransfer
from nereid.daemon_pool import make_room_for_threads
from nereid.errors import ConfigError, InvalidArgument, ModelFailure
from nereid.model_hooks import ModelHooks, identity, load_model_hooks
from nereid.settings import Device
from nereid.signature import ModelSignature, bool_bytes_problem
from nereid.tensors import NamedTensor
from nereid.watched_paths import identity_of

log = logging.getLogger(__name__)

PLATFORM = "nereid_xla"
# How many times a load reads a bundle whose folder was replaced by another while it read it, before it fails.
SWAPPED_FOLDER_TRIES = 3
# The threads XLA's compile of a program may start (measured with jaxlib 0.10: 3 at the first), and a margin.
COMPILE_THREADS = 4


@dataclass(frozen=True)
class _InputAxes:
    """Where one executable input keeps its batch and variable axes, row-major."""

    batch: int | None
    variable: tuple[int, ...]


@dataclass(frozen=True)
class LoadReport:
    """What one load did: programs from the cache or compiled, and how long it took."""

    programs: tuple[str, ...]
    cache: CacheStats
    weights_bytes: int
    seconds: float


class XlaModel:
    """A bundle without ``model.py``: the executable tensors are the client-facing tensors."""

    platform = PLATFORM

    def __init__(self, context: ModelContext) -> None:
        self.context = context
        self.report: LoadReport | None = None
        self._manifest: Manifest | None = None
        self._transfer: DeviceTransfer | None = None
        self._programs: dict[ProgramKey, Any] = {}
        self._weights: list[Any] = []
        self._sizes: tuple[int, ...] = ()
        self._variants: dict[tuple[int, ...], int] = {}
        self._axes: tuple[_InputAxes, ...] = ()
        self._output_axes: tuple[int | None, ...] = ()
        self._mode = BatchMode.NONE
        self._batch_signature: ModelSignature | None = None

    # -- Model protocol ---------------------------------------------------------------------------

    def load(self) -> None:
        """Compile (or reuse) every program and place the weights on the device; raise with the reason.

        A local bundle is read from one release of its folder: the folder as it
        resolves when the load starts (a symlink flipped to another release
        meanwhile is not followed), and read again when that folder was replaced
        meanwhile (``mv m .m.old && mv .m.new m``), which gave the load one
        release's programs with the other's weights, served until its next load.
        """
        started = time.monotonic()
        context = self.context
        options = parse_options(context.settings.runtime, context.settings_origin)
        context.warn_timeout_ignored("a bundle's compiled program runs to its end once started (its requests' "
                                     "deadlines still bound their wait in the queue)")
        remote = RemoteBundle.of(context.folder, retries=options.weights_read_retries)
        # Before model.py runs (it may start jax itself): jax imported while no other load's code runs, and XLA_FLAGS
        # that would end the server refused.
        try:
            import_jax(context.name)
        except ImportError as err:
            raise jax_missing(context.name, err) from None
        check_xla_flags(context.name)
        if remote is not None:
            self._load_release(context.folder, remote, options, started)
            return
        for _ in range(SWAPPED_FOLDER_TRIES):
            # Through a symlink flipped to another release during the load (git-sync, a Kubernetes volume,
            # current -> release-7), a load read the weights of one release and the programs of the other.
            folder = Path(os.path.realpath(context.folder))
            before = identity_of(folder)
            self._load_release(folder, None, options, started)
            if identity_of(folder) == before:
                return
            self.unload()  # (of two releases, perhaps: read again)
            log.warning("model '%s': its folder %s was replaced by another during its load (moved away, another "
                        "moved in); loading it again", context.name, folder)
        raise ConfigError(f"model '{context.name}': its folder {context.folder} was replaced by another during each "
                          f"of {SWAPPED_FOLDER_TRIES} loads in a row; load it again once it stays in place")

    def _load_release(self, folder: Path, remote: RemoteBundle | None, options: XlaOptions, started: float) -> None:
        """The load of one release: the bundle in ``folder`` (the store's, with ``remote``)."""
        context = self.context
        if remote is None:
            if migrate_for_load(folder, options.weights_migration, context.name):
                context.folder_rewritten(MIGRATED_FILES)  # (in dynamic mode, not a change to load again)
        elif options.weights_migration != "off":  # nothing is ever written into the bucket
            log.warning("model '%s': weights_migration does not run for a bundle in object storage (%s)",
                        context.name, remote.location)
        if remote is not None:
            layout = open_bundle(context.folder, options.largest_batch_only, weights_elsewhere=True)
            weight_set = resolve_weights(remote, layout.manifest.weights_file)
        else:
            layout, weight_set = open_local_bundle(folder, options.largest_batch_only)
        manifest = layout.manifest
        try:  # the weights files stay open from their headers' read to their data's
            problem = format_layout_problem(manifest, weight_set)
            if problem is not None:
                raise ConfigError(problem)
            weight_types = ([(w.entry.name, w.program_shape, w.entry.dtype) for w in weight_set.weights]
                            if weight_set else [])
            self._load_hooks(layout)
            target = resolve_device(context.device, context.name, context.settings_origin)
            elsewhere = exported_elsewhere(manifest, context.device)
            if elsewhere is not None:
                log.warning("model '%s': %s", context.name, elsewhere)
            cache = ExecutableCache(folder / CACHE_DIR, options.executable_cache)
            weights_name = weight_set.describe() if weight_set else DEFAULT_WEIGHTS_FILE
            programs = {key: self._program(key, path, layout.manifest, weight_types, weights_name,
                                           weight_set is not None, target, cache, elsewhere,
                                           legacy_weights=weight_set is not None and weight_set.legacy)
                        for key, path in layout.modules.items()}
            if remote is None:  # (a bucket's programs live in its copy's own .cache, kept as its versions are)
                cache.forget_absent(folder)
            if weight_set is None:
                arrays = []
            elif remote is not None:  # streamed from the store into the arrays; no weights file on local disk
                arrays = remote.read_weights(weight_set, chunk_bytes=options.weights_chunk_bytes,
                                             concurrency=options.weights_concurrency)
            else:
                arrays = read_local_weights(layout.folder, weight_set, threads=options.weights_read_threads)
        finally:
            if weight_set is not None:
                weight_set.close()  # (read already, or a program failed: then never)
        _check_bool_weights(arrays, weight_set.describe() if weight_set else DEFAULT_WEIGHTS_FILE)
        transfer = DeviceTransfer(target.device)
        weights = place_weights(transfer, [array for _, array in arrays])
        self._manifest, self._programs, self._weights = manifest, programs, weights
        self._transfer = transfer
        self._sizes = layout.batch_sizes
        self._variants = {v: i + 1 for i, v in enumerate(manifest.input_shapes or ())}
        self._mode = batch_mode(manifest.executable_inputs, manifest.executable_outputs, bool(self._sizes))
        # Variable axes where the request has them: moved one on when the batch axis moved in front of them.
        self._axes = tuple(_InputAxes(t.row_major_batch_axis,
                                      tuple(client_axis(len(t.shape) - 1 - a, t.row_major_batch_axis)
                                            if self._mode.coalesces else len(t.shape) - 1 - a
                                            for a in t.variable_axes))
                           for t in manifest.executable_inputs)
        self._output_axes = tuple(t.row_major_batch_axis for t in manifest.executable_outputs)
        if (self._mode is BatchMode.EXACT and len(self._sizes) > 1
                and all(axes.batch is None for axes in self._axes)):
            # (Hand-made: without a batched input the exporter traces one program per size, all the same.)
            log.warning("model '%s': the manifest lists batch sizes %s, but no input has a batch axis, so no "
                        "request can choose among them: only size %d ever runs (list that one alone)",
                        context.name, list(self._sizes), self._sizes[0])
        self._batch_signature = build_signature(manifest.executable_inputs, manifest.executable_outputs,
                                                self._mode, self._sizes[-1] if self._sizes else 0)
        self.report = LoadReport(tuple(p.name for p in dict.fromkeys(layout.modules.values())), cache.stats,
                                 sum(a.nbytes for _, a in arrays), time.monotonic() - started)
        log.info("model '%s': %d program(s) on %s (%d from cache, %d compiled), %d weight(s), %.2f s",
                 context.name, len(programs), target.describe(), cache.stats.hits, cache.stats.compiled,
                 len(weights), self.report.seconds)

    def signature(self) -> ModelSignature:
        """The client-facing tensors (the executable tensors for a bundle without model.py)."""
        return self._loaded_signature()

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """Run one batch of executable inputs (signature order) and return the executable outputs."""
        manifest, transfer = self._manifest, self._transfer
        assert manifest is not None and transfer is not None, "load() first"
        key, rows = self._select(inputs)
        arrays = [t.data for t in inputs]
        if self._mode.coalesces and rows != key.batch_size:
            arrays = [_pad_rows(a, key.batch_size) for a in arrays]
        if self._mode is BatchMode.MOVED:  # the wire's leading batch axis to where the program has it
            arrays = [np.ascontiguousarray(np.moveaxis(a, 0, axes.batch)) if axes.batch else a
                      for a, axes in zip(arrays, self._axes)]
        try:
            arguments = transfer.put(arrays)
            results = self._programs[key].execute([*arguments, *self._weights])
            # The copy to the host is where an asynchronous device error (a GPU fault, an out-of-memory in
            # the running program) surfaces, so it belongs to the execution and gets the same message.
            host = [np.asarray(result) for result in results]
        except Exception as err:  # XLA runtime errors: the model's fault, reported with XLA's reason
            raise ModelFailure(f"model '{self.context.name}': execution failed ({key.describe()}): "
                               f"{type(err).__name__}: {err}") from err
        outputs: list[NamedTensor] = []
        for spec, array, axis in zip(manifest.executable_outputs, host, self._output_axes):
            if self._mode is BatchMode.MOVED and axis:
                array = np.ascontiguousarray(np.moveaxis(array, axis, 0))
            if self._mode.coalesces and rows != key.batch_size:
                array = array[:rows]
            outputs.append(NamedTensor(spec.name, spec.dtype, array))
        return outputs

    def input_check(self) -> Callable[[list[NamedTensor]], object] | None:
        """What refuses a request before it queues (ChecksInputs): sizes of its variable axes that no
        ``input_shapes`` variant was compiled for, or, where requests are not padded, a batch size that was
        not compiled; None when the signature says it all. Checked at execution alone, such a request waited
        in the queue, and in a batch of its like it was told the batch's shape rather than its own."""
        return self._select if self._variants or self._mode is BatchMode.EXACT else None

    def padded_rows(self, rows: int) -> int:
        """The compiled batch size a batch of ``rows`` runs at (PadsBatches): the scheduler then
        assembles coalesced requests straight into the padded buffer."""
        if self._mode.coalesces:
            return smallest_fitting(self._sizes, rows) or rows
        return rows

    def relocate(self, context: ModelContext) -> None:
        """Serve on under a renamed folder: the executables and weights stay resident."""
        self.context = context

    def returns_fresh_outputs(self) -> bool:
        """Each execution's outputs are its own, copied from the device (see ReturnsFreshOutputs)."""
        return True

    def unload(self) -> None:
        """Free the device buffers and executables."""
        for array in self._weights:
            try:
                array.delete()
            except Exception:  # already deleted or the client is gone: nothing left to free
                pass
        self._weights, self._programs = [], {}

    # -- helpers ------------------------------------------------------------------------------------

    def _load_hooks(self, layout: BundleLayout) -> None:
        """Nothing to load without model.py (see HookedXlaModel)."""

    def _loaded_signature(self) -> ModelSignature:
        if self._batch_signature is None:
            raise RuntimeError("load() first")
        return self._batch_signature

    def _program(self, key: ProgramKey, path: Path, manifest: Manifest,
                 weight_types: Sequence[tuple[str, tuple[int, ...], Any]], weights_name: str, weights_present: bool,
                 target: PjrtTarget, cache: ExecutableCache, elsewhere: str | None = None,
                 legacy_weights: bool = False) -> Any:
        """The executable of one program file; ``elsewhere``: why it may not suit the device (see
        :func:`exported_elsewhere`), added to a compile error's reason."""
        import jaxlib

        # A load failure's reason does not name the model: every place that shows it (RepositoryIndex,
        # "failed to load model 'x': ...", the log line, nereid check) names it already.
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
        program = read_program(data, str(path))
        mismatch = arity_mismatch(path.name, program, len(manifest.executable_inputs), len(weight_types),
                                  weights_name, weights_present)
        if mismatch:
            raise ConfigError(mismatch)
        check_program_types(path.name, program, key, manifest, weight_types, legacy_weights)
        donated = donated_weights_problem(path.name, program, len(manifest.executable_inputs),
                                          [name for name, _, _ in weight_types])
        if donated is not None:
            raise ConfigError(donated)
        # Before compiling: also a cached executable would call the host LAPACK kernels this initialises.
        problem = host_lapack_problem(target.platform, data, self.context.name) or python_callback_problem(data)
        if problem is not None:
            raise ConfigError(f"{path.name}: {problem}")
        key_fields = CacheKey(file_sha256(data), jaxlib.__version__, target.platform,
                              target.client.platform_version, target.device.device_kind,
                              flags_in_force(), host_cpu() if target.platform == "cpu" else "")
        client, devices, options = target.client, [target.device], target.compile_options

        def compile_program() -> Any:
            # (XLA's compile starts threads of its own, and aborts the process if it cannot: refused here instead.)
            make_room_for_threads(COMPILE_THREADS)
            try:
                return client.compile_and_load(data, devices, options)
            except Exception as err:
                raise ConfigError(f"{path.name}: XLA could not compile the program for {target.describe()}: "
                                  f"{err}{f'; {elsewhere}' if elsewhere else ''}") from None

        executable = cache.load_or_compile(path.name, key_fields, CompileFunctions(
            compile_program, client.serialize_executable,
            lambda payload: client.deserialize_executable(payload, devices, options)))
        problem = parameter_layout_problem(path.name, program, executable, client, target.device)
        if problem is not None:
            raise ConfigError(problem)
        return executable

    def _select(self, inputs: list[NamedTensor]) -> tuple[ProgramKey, int]:
        """The program for these inputs and the request's row count (LEADING mode)."""
        name = self.context.name
        variant = None
        if self._variants:
            sizes = tuple(t.data.shape[axis] for t, axes in zip(inputs, self._axes) for axis in axes.variable)
            variant = self._variants.get(sizes)
            if variant is None:
                raise InvalidArgument(f"model '{name}': {self._no_variant(inputs)}")
        if self._mode is BatchMode.NONE:
            return ProgramKey(variant, None), 1
        if self._mode.coalesces:
            rows = inputs[0].data.shape[0] if inputs else self._sizes[0]
            size = smallest_fitting(self._sizes, rows)
            if size is None:
                raise InvalidArgument(f"model '{name}': batch of {rows} rows exceeds the largest compiled batch "
                                      f"size {self._sizes[-1]}")
            return ProgramKey(variant, size), rows
        batch = None
        for tensor, axes in zip(inputs, self._axes):
            if axes.batch is None:
                continue
            size = tensor.data.shape[axes.batch]
            if size not in self._sizes:
                raise InvalidArgument(
                    f"model '{name}': input '{tensor.name}' has batch size {size} (axis {axes.batch}), but this "
                    f"bundle runs only at its compiled batch sizes {list(self._sizes)}: not every tensor has a "
                    "leading batch axis, so requests are not padded")
            if batch is not None and size != batch:
                raise InvalidArgument(f"model '{name}': inputs disagree on the batch size ({batch} and {size} "
                                      f"for '{tensor.name}')")
            batch = size
        if batch is None:  # only outputs are batched: the one compiled size serves
            batch = self._sizes[0]
        return ProgramKey(variant, batch), batch

    def _no_variant(self, inputs: list[NamedTensor]) -> str:
        """Why no ``input_shapes`` variant fits: the tensors with variable axes, as sent and as compiled.

        Row-major, as the client sent them (the variants are stored in manifest
        order, which reads transposed to a client), with -1 for the batch axis.
        """
        variable = [(index, tensor) for index, (tensor, axes) in enumerate(zip(inputs, self._axes))
                    if axes.variable]
        signature = self._loaded_signature()

        def accepted(variant: tuple[int, ...]) -> list[list[int]]:
            sizes = iter(variant)  # (input, manifest axis) order, the order self._axes lists them in
            shapes: dict[int, list[int]] = {}
            for index, (spec, axes) in enumerate(zip(signature.inputs, self._axes)):
                shape = [-1, *spec.dims] if signature.max_batch_size > 0 else list(spec.dims)
                for axis in axes.variable:
                    shape[axis] = next(sizes)
                shapes[index] = shape
            return [shapes[index] for index, _ in variable]

        compiled = [accepted(v) for v in self._variants]
        sent = [list(tensor.data.shape) for _, tensor in variable]
        if len(variable) == 1:
            tensor = variable[0][1]
            return (f"input '{tensor.name}' has shape {sent[0]}; the bundle is compiled for "
                    f"{', '.join(str(shapes[0]) for shapes in compiled)} (input_shapes in manifest.yaml)")
        names = [f"'{tensor.name}'" for _, tensor in variable]
        given = ", ".join(f"{n} {shape}" for n, shape in zip(names, sent))
        known = "; ".join(" with ".join(f"{n} {shape}" for n, shape in zip(names, shapes)) for shapes in compiled)
        return f"inputs have shapes {given}; the bundle is compiled for {known} (input_shapes in manifest.yaml)"


class HookedXlaModel(XlaModel):
    """A bundle with ``model.py``: client-facing tensors differ from the executable's.

    ``signature()`` is the client spec (``client_inputs`` / ``client_outputs``,
    defaulting to the executable's), ``batch_signature()`` the executable spec;
    ``preprocess`` / ``postprocess`` call the hooks model.py registered.
    """

    _hooks: ModelHooks | None = None
    _client_signature: ModelSignature | None = None

    def _load_hooks(self, layout: BundleLayout) -> None:
        assert layout.model_py is not None
        hooks = load_model_hooks(layout.model_py, self.context.name)
        check_omitted_hooks(layout.manifest, hooks, layout.model_py)
        self._hooks = hooks

    def load(self) -> None:
        """Load as a plain bundle, then derive the client signature."""
        super().load()
        manifest = self._manifest
        assert manifest is not None
        inputs = manifest.client_inputs if manifest.client_inputs is not None else manifest.executable_inputs
        outputs = manifest.client_outputs if manifest.client_outputs is not None else manifest.executable_outputs
        mode = batch_mode(inputs, outputs, bool(self._sizes))
        self._client_signature = build_signature(inputs, outputs, mode, self._sizes[-1] if self._sizes else 0)

    def signature(self) -> ModelSignature:
        """The client-facing tensors of model.py."""
        if self._client_signature is None:
            raise RuntimeError("load() first")
        return self._client_signature

    def batch_signature(self) -> ModelSignature:
        """The executable's tensors: what ``infer`` takes and returns."""
        return self._loaded_signature()

    @property
    def preprocess(self) -> Callable[[list[NamedTensor]], list[NamedTensor]] | None:
        """model.py's preprocess hook; None when it registered none, so that requests have no preprocess step (see
        :class:`~nereid.backend.Preprocesses`): the identity's result went through the check of a hook's result,
        which blamed a hook that does not exist, INTERNAL, for a client's shape the program refuses (the export
        hunt), and took every request to a hook thread for nothing."""
        assert self._hooks is not None
        return None if self._hooks.preprocess is identity else self._hooks.preprocess

    @property
    def postprocess(self) -> Callable[[list[NamedTensor]], list[NamedTensor]] | None:
        """model.py's postprocess hook, its outputs put in declared order (:func:`in_declared_order`); None when
        it registered none (no postprocess step, as for preprocess)."""
        assert self._hooks is not None
        if self._hooks.postprocess is identity:
            return None
        return self._postprocess

    def _postprocess(self, outputs: list[NamedTensor]) -> list[NamedTensor]:
        """The postprocess hook's result in declared order: matched by name, as a preprocess result is (hooks
        exchange named tensors, so a result naming each declared output once, in another order, is put in order
        rather than failing every request)."""
        assert self._hooks is not None and self._client_signature is not None
        return in_declared_order(self._hooks.postprocess(outputs), self._client_signature.output_names)


def in_declared_order(result: Any, names: Sequence[str]) -> Any:
    """``result`` reordered to ``names`` when it is a list (or tuple) of NamedTensor naming each of them once;
    otherwise as it is, for the check of the hook's result to judge and describe."""
    if not isinstance(result, (list, tuple)) or len(result) != len(names):
        return result
    if not all(isinstance(tensor, NamedTensor) for tensor in result):
        return result
    if [tensor.name for tensor in result] == list(names):
        return result
    by_name = {tensor.name: tensor for tensor in result}
    if len(by_name) != len(names) or set(by_name) != set(names):
        return result
    return [by_name[name] for name in names]


def check_omitted_hooks(manifest: Manifest, hooks: ModelHooks, model_py: Path) -> None:
    """Refuse client tensors that an omitted (identity) hook cannot turn into the executable's, or back.

    Without ``preprocess`` the client's inputs go to the program as they are,
    so ``client_inputs`` must be ``executable_inputs`` (the same names, dtypes
    and row-major shapes, in any order); without ``postprocess`` the same holds
    for ``client_outputs``. Otherwise the model loaded READY and failed every
    request, blaming a hook model.py never registered. ConfigError naming the
    manifest keys and the missing hook.
    """
    for client_key, client, executable_key, executable, hook, registered in (
            ("client_inputs", manifest.client_inputs, "executable_inputs", manifest.executable_inputs,
             "preprocess", hooks.preprocess),
            ("client_outputs", manifest.client_outputs, "executable_outputs", manifest.executable_outputs,
             "postprocess", hooks.postprocess)):
        if client is None or registered is not identity:
            continue
        difference = _tensors_difference(client, client_key, executable, executable_key)
        if difference is not None:
            raise ConfigError(f"{manifest.path}: {client_key}: {difference}, but {model_py} registers no {hook} "
                              f"hook (an omitted hook is the identity, so {client_key} must be {executable_key}): "
                              f"register {hook} to convert them, or remove {client_key}")


def _tensors_difference(client: Sequence[ManifestTensor], client_key: str, executable: Sequence[ManifestTensor],
                        executable_key: str) -> str | None:
    """How the ``client`` tensors differ from the ``executable`` ones (names, dtypes, row-major shapes; the order
    aside); None when they are the same."""
    by_name = {tensor.name: tensor for tensor in executable}
    for tensor in client:
        other = by_name.get(tensor.name)
        if other is None:
            return (f"'{tensor.name}' is not in {executable_key} "
                    f"({', '.join(repr(t.name) for t in executable)})")
        if tensor.dtype is not other.dtype or _row_major(tensor) != _row_major(other):
            return (f"'{tensor.name}' is {_described(tensor)} there and {_described(other)} in {executable_key}")
    names = {tensor.name for tensor in client}
    missing = [tensor.name for tensor in executable if tensor.name not in names]
    if missing:
        return f"lacks {executable_key[:-1].replace('_', ' ')} '{missing[0]}'"
    return None


def _row_major(tensor: ManifestTensor) -> tuple[tuple[DimKind, int], ...]:
    return tuple((dim.kind, dim.size) for dim in tensor.row_major)


def _described(tensor: ManifestTensor) -> str:
    """``f32 [batch, 64, 2]``: the dtype token and the row-major shape (-1: a variable axis)."""
    dims = ", ".join("batch" if dim.kind is DimKind.BATCH else str(dim.client_size) for dim in tensor.row_major)
    return f"{token_of(tensor.dtype)} [{dims}]"


def create_model(context: ModelContext) -> XlaModel:
    """The backend object for a bundle: with hooks when the bundle has a model.py."""
    from nereid.backends.xla.bundle import MODEL_PY

    return HookedXlaModel(context) if (context.folder / MODEL_PY).is_file() else XlaModel(context)


def exported_elsewhere(manifest: Manifest, device: Device) -> str | None:
    """Why the bundle's programs may not suit ``device``: they were lowered for another platform; None otherwise.

    jax.export lowers for one platform: a program for cpu may call LAPACK where
    one for cuda calls cuSOLVER, and either is laid out for its own platform. XLA
    often compiles it for the other platform all the same (the shipped examples
    run on both), so this is a warning, and the reason added to a compile error.
    A bundle that records no platform (another writer, an older export) is taken
    as it is.
    """
    exported = manifest.export_platform
    if exported is None:
        return None
    running = "cpu" if device.kind == "cpu" else "cuda"
    if _PLATFORM_ALIASES.get(exported.strip().lower(), exported.strip().lower()) == running:
        return None
    return (f"its programs were exported for {exported} ({MANIFEST_NAME}: provenance.{EXPORT_PLATFORM}) but run "
            f"on {running} (device {device}): a program lowered for one platform may call what only that platform "
            f"has and is tuned for it; re-export it with export_bundle(..., platform={running!r})")


# jax's names for one platform (jax.export takes cuda; "gpu" is its older generic name).
_PLATFORM_ALIASES = {"gpu": "cuda"}


def _check_bool_weights(arrays: Sequence[tuple[str, np.ndarray]], where: str) -> None:
    """ConfigError naming the weight when a BOOL weight holds a byte other than 0 or 1: XLA read such a byte as
    true for one operation and false for another (and, select), and the model answered contradictions, OK (the
    XLA read hunt); a client's BOOL input is refused alike."""
    for name, array in arrays:
        if array.dtype == np.bool_ and (problem := bool_bytes_problem(array)) is not None:
            raise ConfigError(f"{where}: BOOL weight '{name}' holds {problem}")


def place_weights(transfer: DeviceTransfer, arrays: Sequence[np.ndarray]) -> list[Any]:
    """The weights on the device, every transfer complete when this returns.

    On CPU a weight read aligned (see ``aligned_empty``) becomes the device
    buffer itself, not a copy: it is made read-only first, so that no later
    write through the host array can change a weight under the programs.
    Waiting for the transfers keeps none pending after load (and a transfer
    that fails fails the load, not the first request).
    """
    for array in arrays:
        array.flags.writeable = False
    weights = transfer.put(arrays)
    for weight in weights:
        weight.block_until_ready()
    return weights


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    padded = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    padded[:array.shape[0]] = array
    return padded
