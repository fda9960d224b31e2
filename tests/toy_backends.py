"""In-process toy backends for tests that need a model but not a real runtime (one module, shared).

``toy`` claims folders holding ``toy.txt`` and a textproto; its model adds one
to its input. A folder with ``fail.txt`` refuses to load with that file's text.
Every load is counted in ``LOADS`` (by model name), so tests can tell a model
that moved from one that loaded again.
"""

from __future__ import annotations

import sys
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
        failure = self.context.folder / "fail.txt"
        if failure.is_file():
            raise ConfigError(f"{failure}: {failure.read_text().strip()}")
        self._signature = load_textproto_signature(self.context.folder / TEXTPROTO_NAME)
        LOADS[self.context.name] += 1

    def signature(self) -> ModelSignature:
        assert self._signature is not None
        return self._signature

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        return [NamedTensor(self._signature.outputs[0].name, inputs[0].dtype, inputs[0].data + 1)]

    def relocate(self, context: ModelContext) -> None:
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
