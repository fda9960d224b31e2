"""In-process toy backends for tests that need a model but not a real runtime (one module, shared).

``toy`` claims folders holding ``toy.txt`` and a textproto; its model adds one
to its input. A folder with ``fail.txt`` refuses to load with that file's text; one with
``store_fail.txt`` fails as the object store had failed its load (a StorageError as its cause); one with
``gate.txt`` loads once the file it names exists (30 s at most): a load as long as a test wants.
Every load is counted in ``LOADS`` (by model name), so tests can tell a model
that moved from one that loaded again.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections import Counter
from pathlib import Path

from nereid.backend import BackendClaim, ModelContext
from nereid.dataplane import DataPlane
from nereid.errors import ConfigError
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.repository import ModelRepository
from nereid.settings import load_settings
from nereid.signature import TEXTPROTO_NAME, ModelSignature, load_textproto_signature
from nereid.tensors import NamedTensor

BACKEND_NAME = "toy"
LOADS: Counter[str] = Counter()


class ToyModel:
    """Adds one to its single input; relocatable, like the built-in backends."""

    platform = "toy_platform"

    def __init__(self, context: ModelContext) -> None:
        self.context = context
        self._signature: ModelSignature | None = None

    def load(self) -> None:
        gate = self.context.folder / "gate.txt"
        if gate.is_file():
            release, deadline = Path(gate.read_text()), time.monotonic() + 30
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        failure = self.context.folder / "fail.txt"
        if failure.is_file():
            raise ConfigError(f"{failure}: {failure.read_text().strip()}")
        streamed = self.context.folder / "store_fail.txt"
        if streamed.is_file():  # as a backend wraps its weights stream's failure
            from nereid.storage import StorageError
            try:
                raise StorageError(streamed.read_text().strip())
            except StorageError as err:
                raise ConfigError(f"{streamed}: cannot read the weights") from err
        self._signature = load_textproto_signature(self.context.folder / TEXTPROTO_NAME)
        LOADS[self.context.name] += 1

    def signature(self) -> ModelSignature:
        assert self._signature is not None
        return self._signature

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        return [NamedTensor(self._signature.outputs[0].name, inputs[0].dtype, inputs[0].data + 1)]

    def relocate(self, context: ModelContext) -> None:
        if (context.folder / "relocate_exit.txt").is_file():  # a plugin's own sys.exit() in its move
            raise SystemExit(8)
        if (context.folder / "relocate_raises.txt").is_file():  # a plugin's own bug in its move
            raise KeyError("weights")
        self.context = context

    def unload(self) -> None:
        pass


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    if declared or (folder / "toy.txt").is_file():
        return BackendClaim(ToyModel)
    return None


def write_toy(root: Path, name: str, textproto: str = 'input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n'
              ) -> Path:
    """A toy model folder under ``root``."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "toy.txt").write_text("")
    (folder / TEXTPROTO_NAME).write_text(textproto)
    return folder


def toy_dataplane(root: Path, control: bool = True) -> DataPlane:
    """A data plane over ``root/ml-backends`` holding two toy models: ``toy`` (2 instances) and ``spare``.

    Nothing is loaded yet. ``plane.changes`` lists one "changed" per repository
    change the plane reported.
    """
    write_toy(root / "ml-backends", "toy")
    write_toy(root / "ml-backends", "spare")
    (root / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\nmodels:\n  - name: toy\n'
                                      "    instances: 2\n")
    settings = load_settings(root / "nereid.yaml")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(sys.modules[__name__],))
    (root / "scratch").mkdir()
    repository = ModelRepository(settings, manager, root / "scratch")
    changes: list[str] = []

    async def changed() -> None:
        changes.append("changed")
    plane = DataPlane(repository, settings, repository_control=control, on_repository_change=changed)
    plane.changes = changes
    return plane


# Faulty toys: a backend whose model objects get one part of the Model protocol wrong. ``faulty``
# claims folders holding ``faulty.txt``; its text picks the fault. Each model's unload() is counted
# in UNLOADS (by model name), so tests can tell that what load() acquired was released.
UNLOADS: Counter[str] = Counter()
TERMINATES: Counter[str] = Counter()  # terminate_running() calls of the models that count them, by name


class FaultyModel(ToyModel):
    """A toy model that counts its unloads."""

    def unload(self) -> None:
        UNLOADS[self.context.name] += 1


class NoPlatformModel(FaultyModel):
    """Lacks the ``platform`` attribute (ModelMetadata would fail on every call)."""

    platform = None


class PlatformRaisesModel(FaultyModel):
    """Its ``platform`` is a property that raises (its bare message was the model's reason)."""

    @property
    def platform(self) -> str:
        raise RuntimeError("no platform configured")


class NoInferModel(FaultyModel):
    """Lacks ``infer`` (nothing could run)."""

    infer = None


class DependenciesFailModel(FaultyModel):
    """Calls models, but its ``dependencies()`` raises: it fails after load() succeeded."""

    def dependencies(self) -> tuple[str, ...]:
        raise RuntimeError("dependencies unknown")

    def concurrent_executions(self) -> int:
        return 1


class DependenciesExitModel(DependenciesFailModel):
    """Its ``dependencies()`` calls ``sys.exit()`` (asked on the server's event loop)."""

    def dependencies(self) -> tuple[str, ...]:
        sys.exit(4)


class DependenciesInterruptModel(DependenciesFailModel):
    """Its ``dependencies()`` raises KeyboardInterrupt (asked on the server's event loop, the main thread)."""

    def dependencies(self) -> tuple[str, ...]:
        raise KeyboardInterrupt("no dependencies today")


class CallerModel(FaultyModel):
    """Calls the models named in its folder's ``calls.txt`` (as a meta model does; not a fault)."""

    def dependencies(self) -> tuple[str, ...]:
        return tuple((self.context.folder / "calls.txt").read_text().split())

    def concurrent_executions(self) -> int:
        return 1


class TerminateFailsModel(FaultyModel):
    """Runs each batch for 0.5 s; its ``terminate_running`` has a wrong signature (a TypeError when called)."""

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        time.sleep(0.5)
        return super().infer(inputs)

    def terminate_running(self, now: bool) -> None:
        pass


class TerminateSlowModel(FaultyModel):
    """Runs each batch for 2.5 s (terminate_running ends none); its ``terminate_running`` takes 1 s to return."""

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        time.sleep(2.5)
        return super().infer(inputs)

    def terminate_running(self) -> None:
        TERMINATES[self.context.name] += 1
        time.sleep(1)


class ReportFailsModel(FaultyModel):
    """Describes how it runs (ReportsRuntime), but its ``runtime_report()`` raises."""

    def runtime_report(self):
        raise RuntimeError("no report today")


class UnloadRaises:
    """Mixed in before a toy model: its ``unload()`` counts as the toy's, then raises ``unload_error``."""

    unload_error = "sticky unload"

    def unload(self) -> None:
        super().unload()  # type: ignore[misc]
        raise RuntimeError(self.unload_error)


class ReportAndUnloadFailModel(UnloadRaises, ReportFailsModel):
    """Its ``runtime_report()`` raises, and so does its ``unload()``: two problems for one line of nereid check."""


class DependenciesAndUnloadFailModel(UnloadRaises, DependenciesFailModel):
    """Its ``dependencies()`` raises (UNAVAILABLE after load), and so does its ``unload()``."""


class UnloadExitsModel(FaultyModel):
    """Its ``unload()`` calls ``sys.exit(3)``."""

    def unload(self) -> None:
        super().unload()
        sys.exit(3)


class InputCheckIntModel(FaultyModel):
    """Its ``input_check()`` returns 42, no function of the inputs: the server refuses it at load."""

    def input_check(self):
        return 42


class UnloadHangsModel(FaultyModel):
    """Its ``unload()`` does not return until ``UNLOAD_RELEASE`` is set (a native nereid_unload that blocks)."""

    def unload(self) -> None:
        UNLOAD_RELEASE.wait(60)


UNLOAD_RELEASE = threading.Event()


class StopIterationModel(FaultyModel):
    """Its ``load()`` makes a stray ``next()`` on an exhausted iterator."""

    def load(self) -> None:
        next(iter(()))


class KeyErrorModel(FaultyModel):
    """Its ``load()`` has a bug: a lookup of a key that is not there."""

    def load(self) -> None:
        {}["weights"]


class OutOfMemoryModel(FaultyModel):
    """Its ``load()`` asks for more memory than any machine has: MemoryError, as a load under a memory limit
    meets it."""

    def load(self) -> None:
        bytearray(1 << 62)


class CreateFailsModel(FaultyModel):
    """Its class, the backend's ``create()``, raises (a constructor with a bug)."""

    def __init__(self, context: ModelContext) -> None:
        raise AttributeError("'NoneType' object has no attribute 'device'")


class RefusesModel(FaultyModel):
    """Its ``load()`` refuses the model the documented way: a ConfigError with the reason."""

    def load(self) -> None:
        raise ConfigError("weights.bin is for another version of this model")


class SignatureNoneModel(FaultyModel):
    """Its ``signature()`` returns None (a plugin that forgot its return)."""

    def signature(self):
        return None


class SignatureNoneUnloadFailsModel(UnloadRaises, SignatureNoneModel):
    """Its ``signature()`` returns None, and the ``unload()`` that cleans up after the refused load raises."""

    unload_error = "unload exploded during cleanup"


class SignatureRaisesModel(FaultyModel):
    """Its ``signature()`` raises a ValueError of its own."""

    def signature(self):
        raise ValueError("no sig")


class AsyncLoadModel(FaultyModel):
    """Its ``load()`` is ``async def``: called as a plain function, it would never run."""

    async def load(self) -> None:  # type: ignore[override]
        super().load()


class AsyncHooksModel(FaultyModel):
    """Its ``preprocess`` hook and ``relocate()`` are ``async def``: every request would fail on a coroutine, and
    a rename would be said done in place without relocate running."""

    async def preprocess(self, inputs):
        return inputs

    async def relocate(self, context) -> None:
        self.context = context


class AsyncUnloadModel(FaultyModel):
    """Its ``unload()`` is ``async def``: called as a plain function, it would never run."""

    async def unload(self) -> None:  # type: ignore[override]
        super().unload()


class InputCheckAsyncModel(FaultyModel):
    """Its ``input_check()`` returns an ``async def`` check: called as a plain function, it would check nothing."""

    def input_check(self):
        async def check(inputs):
            raise AssertionError("never awaited")
        return check


class NoDeviceRaisesModel(FaultyModel):
    """Its ``uses_no_device()`` raises (asked on every ModelConfig, it failed each naming no model)."""

    def uses_no_device(self) -> bool:
        raise RuntimeError("uses_no_device exploded")


class NoDeviceStrModel(FaultyModel):
    """Its ``uses_no_device()`` answers a str."""

    def uses_no_device(self):
        return "yes"


class FreshStrModel(FaultyModel):
    """Its ``returns_fresh_outputs()`` answers a str."""

    def returns_fresh_outputs(self):
        return "always"


class ForwardingModel(FaultyModel):
    """Forwards what it lacks to an object its ``load()`` makes (a wrapper plugin's pattern): before the load, reading
    any method it lacks recurses for ever. Not a fault: it must load."""

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def load(self) -> None:
        super().load()
        self._inner = types.SimpleNamespace()


class NoDeviceNumpyModel(FaultyModel):
    """Its ``uses_no_device()`` answers numpy's True, as a computed answer may be. Not a fault: it must load."""

    def uses_no_device(self):
        import numpy
        return numpy.bool_(True)


class RunBoundNegativeModel(FaultyModel):
    """Its ``longest_run_s()`` answers a negative number of seconds."""

    def longest_run_s(self):
        return -1


class RunBoundHugeModel(FaultyModel):
    """Its ``longest_run_s()`` answers an int no float can hold."""

    def longest_run_s(self):
        return 10**400


class RunBoundRaisesModel(FaultyModel):
    """Its ``longest_run_s()`` raises."""

    def longest_run_s(self):
        raise RuntimeError("no bound today")


FAULTS = {"signature_none": SignatureNoneModel, "no_platform": NoPlatformModel, "no_infer": NoInferModel, "dependencies_fail": DependenciesFailModel,
          "dependencies_exit": DependenciesExitModel, "dependencies_interrupt": DependenciesInterruptModel,
          "terminate_fails": TerminateFailsModel, "terminate_slow": TerminateSlowModel,
          "report_fails": ReportFailsModel, "input_check_int": InputCheckIntModel,
          "stop_iteration": StopIterationModel, "unload_hangs": UnloadHangsModel, "caller": CallerModel,
          "key_error": KeyErrorModel, "out_of_memory": OutOfMemoryModel, "create_fails": CreateFailsModel, "refuses": RefusesModel,
          "signature_none_unload_fails": SignatureNoneUnloadFailsModel, "async_load": AsyncLoadModel,
          "async_unload": AsyncUnloadModel, "input_check_async": InputCheckAsyncModel,
          "signature_raises": SignatureRaisesModel, "platform_raises": PlatformRaisesModel,
          "report_and_unload_fail": ReportAndUnloadFailModel, "unload_exits": UnloadExitsModel,
          "dependencies_and_unload_fail": DependenciesAndUnloadFailModel, "no_device_raises": NoDeviceRaisesModel,
          "async_hooks": AsyncHooksModel, "forwarding": ForwardingModel, "no_device_numpy": NoDeviceNumpyModel,
          "no_device_str": NoDeviceStrModel, "run_bound_negative": RunBoundNegativeModel,
          "run_bound_raises": RunBoundRaisesModel, "run_bound_huge": RunBoundHugeModel, "fresh_str": FreshStrModel}


class FaultyToys:
    """The ``faulty`` backend plugin (an object, so that it can sit next to ``toy`` in one module)."""

    BACKEND_NAME = "faulty"

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        marker = folder / "faulty.txt"
        if marker.is_file():
            return BackendClaim(FAULTS[marker.read_text().strip()])
        return None


def write_faulty(root: Path, name: str, fault: str) -> Path:
    """A toy model folder under ``root`` that the ``faulty`` backend claims, with ``fault`` (a key of FAULTS)."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "faulty.txt").write_text(fault)
    (folder / TEXTPROTO_NAME).write_text('input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n')
    return folder


def install_plugin(site: Path, distribution: str, entry_point: str, module: str, source: str) -> None:
    """Install a plugin into ``site`` as pip lays it out: ``module``.py plus a dist-info naming its entry point."""
    info = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (site / f"{module}.py").write_text(source)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[nereid.backends]\n{entry_point} = {module}\n")


# Broken third-party plugins, as (distribution, entry point, module, source): one of each way a plugin
# can fail at start-up. None of them may stop a nereid command.
BROKEN_AT_STARTUP = (
    ("broken-import", "broken_import", "broken_import_plugin",
     "import nereid_missing_dependency  # not installed\n"),
    ("broken-args", "broken_args", "broken_args_plugin",
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared, settings):\n    return None\n"),
    ("python-lookalike", "python", "python_lookalike_plugin",
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    raise AssertionError('never asked')\n"),
    ("broken-commands", "broken_commands", "broken_commands_plugin",
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"
     "@hookimpl\ndef nereid_add_commands(commands):\n    raise RuntimeError('tooling bug')\n"),
    ("check-taker", "check_taker", "check_taker_plugin",
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"
     "@hookimpl\ndef nereid_add_commands(commands):\n"
     "    commands.add_parser('taker-tool').set_defaults(run=lambda args: 0)\n"
     "    commands.add_parser('check').set_defaults(run=lambda args: 0)\n"),
)

# Third-party plugins whose per-folder hooks are faulty, in the same form.
FAULTY_HOOKS = (
    ("flaky-claims", "flaky", "flaky_plugin",  # raises on every folder without flaky.json
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return (folder / 'flaky.json').read_text()\n"),
    ("falsy-claims", "falsy", "falsy_plugin",  # declines with False instead of None
     "from nereid.backend import BackendClaim\nfrom nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n"
     "    return (folder / 'falsy.txt').is_file() and BackendClaim(object)\n"),
    ("classy-claims", "classy", "classy_plugin",  # returns its model class instead of a BackendClaim
     "from nereid.hookspecs import hookimpl\nclass M: pass\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return M\n"),
    ("hinty-hints", "hinty", "hinty_plugin",  # its declaration hint raises
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"
     "@hookimpl\ndef nereid_declaration_hint(folder):\n    raise KeyError('hinty')\n"),
)
