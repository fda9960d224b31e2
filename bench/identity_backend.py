"""A tiny in-process backend plugin for the protocol-overhead benchmarks.

It claims folders holding ``identity.txt`` or ``identity_thread.txt`` and returns
the input unchanged, so what is left to measure is nereid's own path (decode,
validate, queue, batch, encode):

- ``identity.txt``: ``async def infer``, run on the event loop (as the meta
  backend's models run): the floor of nereid's per-request cost;
- ``identity_thread.txt``: a plain ``def infer``, run on the scheduler's
  worker threads, the way every blocking backend (python warm start, xla, cxx)
  runs.
"""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim, ModelContext
from nereid.hookspecs import hookimpl
from nereid.signature import TEXTPROTO_NAME, ModelSignature, load_textproto_signature
from nereid.tensors import NamedTensor

BACKEND_NAME = "bench_identity"
ON_LOOP_MARKER = "identity.txt"
THREADED_MARKER = "identity_thread.txt"


class Identity:
    platform = "bench_identity"

    def __init__(self, context: ModelContext) -> None:
        self._folder = context.folder
        self._signature: ModelSignature | None = None

    def load(self) -> None:
        self._signature = load_textproto_signature(self._folder / TEXTPROTO_NAME)

    def signature(self) -> ModelSignature:
        assert self._signature is not None
        return self._signature

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        return [NamedTensor("output", inputs[0].dtype, inputs[0].data)]

    def returns_fresh_outputs(self) -> bool:
        """The request's own input, never written again: used as it is, as the built-in backends' outputs are
        (a plugin that declares nothing has its outputs copied; see ReturnsFreshOutputs)."""
        return True

    def unload(self) -> None:
        pass


class ThreadedIdentity(Identity):
    platform = "bench_identity_thread"

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:  # type: ignore[override]
        return [NamedTensor("output", inputs[0].dtype, inputs[0].data)]


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    if (folder / THREADED_MARKER).is_file():
        return BackendClaim(ThreadedIdentity)
    if declared or (folder / ON_LOOP_MARKER).is_file():
        return BackendClaim(Identity)
    return None


def write_identity_models(models: Path, textproto: str, names: dict[str, str]) -> None:
    """Identity model folders under ``models``: ``names`` maps ``"loop"`` and ``"thread"`` to folder names."""
    for side, marker in (("thread", THREADED_MARKER), ("loop", ON_LOOP_MARKER)):
        folder = models / names[side]
        folder.mkdir(parents=True)
        (folder / marker).write_text("")
        (folder / TEXTPROTO_NAME).write_text(textproto)
