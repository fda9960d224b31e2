"""The bundle arity check: does each program take exactly inputs + weights arguments?

A bundle is served as ``executable(inputs..., weights...)``. The manifest says
how many inputs there are and the weights file how many tensors, but the number
the program actually wants lives only in the serialized artifact, so a bundle
can look right in every readable part and still fail every request with
"Execution supplied N arguments but compiled program expected N+1". These
functions read all three numbers back out of the files, whoever wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from nereid.backends.xla.bundle import DEFAULT_WEIGHTS_FILE, BundleLayout, open_bundle
from nereid.backends.xla.conformance import check_program_types
from nereid.backends.xla.manifest import MANIFEST_NAME, declares_meta
from nereid.backends.xla.program import ProgramSignature, python_callback_problem, read_program
from nereid.backends.xla.migration import local_weight_set
from nereid.backends.xla.weights import WeightSet, format_layout_problem
from nereid.errors import ConfigError

_SHOWN_PARAMETERS = 6


@dataclass(frozen=True)
class ModuleArity:
    """One program file and the number of arguments it takes (None when unreadable)."""

    file: str
    expected: int | None
    error: str = ""


@dataclass(frozen=True)
class BundleArity:
    """The arity report of one bundle; ``error`` says why it is not servable."""

    bundle: Path
    servable: bool
    n_inputs: int | None
    n_weights: int | None
    expected: int | None
    modules: tuple[ModuleArity, ...] = ()
    error: str = ""
    weights_source: str = DEFAULT_WEIGHTS_FILE  # the weights file, or its shards

    def line(self) -> str:
        """One report line, as ``nereid bundle check`` prints it."""
        if not self.servable:
            return f"{self.bundle}: UNSERVABLE: {self.error}"
        files = ", ".join(m.file for m in self.modules)
        shards = "" if self.weights_source == DEFAULT_WEIGHTS_FILE else f" in {self.weights_source}"
        return (f"{self.bundle}: servable: {self.n_inputs} input(s) + {self.n_weights} weight(s){shards} = "
                f"{self.expected} argument(s), taken by {files}")


def arity_mismatch(where: str, program: ProgramSignature, n_inputs: int, n_weights: int,
                   weights_name: str = DEFAULT_WEIGHTS_FILE, weights_present: bool = True) -> str | None:
    """The explanation of an arity mismatch, or None when the numbers agree.

    ``weights_present`` False: the bundle has no weights file at all, which is
    then the likely cause of a program wanting more arguments.
    """
    found = _mismatch_and_cause(where, program, n_inputs, n_weights, weights_name, weights_present)
    return None if found is None else f"{found[0]}. {found[1]}"


def donated_weights_problem(where: str, program: ProgramSignature, n_inputs: int,
                            weight_names: Sequence[str]) -> str | None:
    """Why the program cannot serve if it takes over (is donated) a weight's buffer, or None.

    Every run passes the weights' device buffers kept since load: donated once,
    they are gone, and every request after the first would fail. (A donated
    input is harmless: each run transfers its own.)
    """
    donated = [index - n_inputs for index in program.donated if index >= n_inputs]
    if not donated:
        return None
    names = ", ".join(f"'{weight_names[i]}'" for i in donated if i < len(weight_names))
    return (f"{where}: the program takes over the buffers of weight(s) {names} (donated: tf.aliasing_output or "
            "jax.buffer_donor, as jax.jit(..., donate_argnums=...) exports them), which every request must find "
            "again; export it without donating the weights")


def _mismatch_and_cause(where: str, program: ProgramSignature, n_inputs: int, n_weights: int,
                        weights_name: str, weights_present: bool) -> tuple[str, str] | None:
    """:func:`arity_mismatch` in two parts: what does not agree, and its likely cause (the same for every program
    of a bundle that fails the same way, so a report of several says it once)."""
    supplied = n_inputs + n_weights
    if program.arity == supplied:
        return None
    shown = ", ".join(p.describe() for p in program.parameters[:_SHOWN_PARAMETERS])
    if program.arity > _SHOWN_PARAMETERS:
        shown += ", ..."
    if not weights_present:
        weights = f"no weights ({weights_name} is missing)"
    else:
        weights = f"{n_weights} tensor(s) in {weights_name}"
    if program.arity > supplied and not weights_present:
        cause = (f"The bundle has no weights file: a program that takes weights needs its {weights_name} (or "
                 "its shards and index) beside it.")
    elif program.arity > supplied:
        cause = ("The usual cause is a value the traced function captured from outside its arguments, such as "
                 "an RNG key in layer state (a leading tensor<2xui32> or tensor<2xui64>) or a device-resident "
                 "configuration array: tracing lifts each into a parameter that no client can supply. Read "
                 "such values back to the host before tracing so they become constants.")
    else:
        cause = ("The usual cause is an argument the program never reads being dropped at export (jax.export "
                 "drops unused arguments unless the function is jitted with keep_unused=True), or a weights "
                 "file holding tensors the program does not take.")
    return (f"{where}: the program takes {program.arity} argument(s) ({shown or 'none'}) but the bundle supplies "
            f"{supplied}: {n_inputs} input(s) from the manifest + {weights}", cause)


def bundle_entry_arity(module_path: Path | str) -> int:
    """How many arguments one program file takes; ConfigError when it cannot be read."""
    path = Path(module_path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    return read_program(data, str(path)).arity


def bundle_arity_report(folder: Path | str) -> BundleArity:
    """The three numbers of a bundle (inputs, weights, what each program takes). Never raises."""
    return check_bundle(folder, types=False)[0]


def assert_bundle_arity(folder: Path | str) -> BundleArity:
    """The report of a servable bundle; ConfigError with the reason otherwise."""
    report = bundle_arity_report(folder)
    if not report.servable:
        raise ConfigError(report.error)
    return report


def bundle_type_problem(folder: Path | str) -> str | None:
    """Why the server's load would refuse the bundle's program types, or None when they conform. Never raises.

    The same check the load runs before compiling (:func:`check_program_types`:
    each parameter and result against the manifest and the weights file, for
    every compiled size and variant), without compiling: a wrong dim or dtype
    in the manifest, a weight of another dtype or shape, or the b1 program
    copied over the b4 one pass the arity report yet never load. A program
    that takes over a weight's buffer, or calls back into Python, is refused
    as the load refuses it. Meant for a bundle whose arity report is servable.
    """
    try:
        return _type_problem(_OpenedBundle.open(Path(folder)))
    except Exception as err:  # a report, not a check: every failure becomes the reason
        return str(err).strip() or type(err).__name__


def check_bundle(folder: Path | str, types: bool = True) -> tuple[BundleArity, str | None]:
    """The arity report of a bundle and, when it is servable and ``types`` is True, why its program types
    would be refused (:func:`bundle_type_problem`; None when they conform). Never raises.

    The bundle's manifest, weights index and programs are read once for both
    (``nereid bundle check`` runs both: reading them twice doubled every
    warning a broken index logs).
    """
    folder = Path(folder)
    try:
        bundle = _OpenedBundle.open(folder)
        report = _report(folder, bundle)
    except Exception as err:  # a report, not a check: every failure becomes the reason
        return BundleArity(folder, False, None, None, None, (), str(err).strip() or type(err).__name__), None
    if not (types and report.servable):
        return report, None
    try:
        return report, _type_problem(bundle)
    except Exception as err:
        return report, str(err).strip() or type(err).__name__


@dataclass
class _OpenedBundle:
    """A bundle's layout and weights, read once, and its programs, each file parsed once when first asked for."""

    layout: BundleLayout
    weight_set: WeightSet | None
    # Each file's program and its Python callbacks (the text itself is not kept: programs can be large).
    programs: dict[Path, tuple[ProgramSignature, str | None]] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path) -> _OpenedBundle:
        """Read the manifest and the weights' index (ConfigError, OSError when they cannot be)."""
        if declares_meta(folder / MANIFEST_NAME):
            raise ConfigError(f"{folder}: a meta model (meta: true in {MANIFEST_NAME}), not a bundle: it has no "
                              "program to check (nereid check loads it)")
        layout = open_bundle(folder)
        return cls(layout, local_weight_set(layout))

    def program(self, path: Path) -> tuple[ProgramSignature, str | None]:
        """The program in ``path`` and why it cannot serve for calling back into Python (None if it does not)."""
        if path not in self.programs:  # a file serving several keys is read once
            data = path.read_bytes()
            self.programs[path] = read_program(data, str(path)), python_callback_problem(data)
        return self.programs[path]


def _report(folder: Path, bundle: _OpenedBundle) -> BundleArity:
    layout, weight_set = bundle.layout, bundle.weight_set
    n_inputs = len(layout.manifest.executable_inputs)
    n_weights = len(weight_set.weights) if weight_set else 0
    weights_name = weight_set.describe() if weight_set else DEFAULT_WEIGHTS_FILE
    modules: list[ModuleArity] = []
    problems: list[str] = []
    causes: dict[str, None] = {}  # of the arity mismatches, each said once after them all
    for path in dict.fromkeys(layout.modules.values()):
        try:
            program, _ = bundle.program(path)
        except (ConfigError, OSError) as err:
            modules.append(ModuleArity(path.name, None, str(err)))
            problems.append(str(err))
            continue
        modules.append(ModuleArity(path.name, program.arity))
        mismatch = _mismatch_and_cause(path.name, program, n_inputs, n_weights, weights_name,
                                       weight_set is not None)
        if mismatch:
            problems.append(mismatch[0])
            causes[mismatch[1]] = None
    expected = {m.expected for m in modules}
    common = expected.pop() if len(expected) == 1 else None
    error = "; ".join(problems) + (f". {' '.join(causes)}" if causes else "")
    return BundleArity(folder, not problems, n_inputs, n_weights, common, tuple(modules), error, weights_name)


def _type_problem(bundle: _OpenedBundle) -> str | None:
    """:func:`bundle_type_problem` of an opened bundle (raising what it turns into the reason)."""
    layout = bundle.layout
    problem = format_layout_problem(layout.manifest, bundle.weight_set)
    if problem is not None:
        return problem
    weights = bundle.weight_set.weights if bundle.weight_set else ()
    weight_types = [(w.entry.name, w.program_shape, w.entry.dtype) for w in weights]
    for key, path in layout.modules.items():
        program, callback = bundle.program(path)
        # In the order the load checks them, so both name the same first problem.
        check_program_types(path.name, program, key, layout.manifest, weight_types,
                            bundle.weight_set is not None and bundle.weight_set.legacy)
        donated = donated_weights_problem(path.name, program, len(layout.manifest.executable_inputs),
                                          [name for name, _, _ in weight_types])
        if donated is not None:
            return donated
        if callback is not None:  # (text matching, as the load does before compiling: no client needed)
            return f"{path.name}: {callback}"
    return None
