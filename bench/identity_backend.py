"""A tiny in-process backend plugin for the protocol-overhead benchmark.

It claims folders holding an ``identity.txt`` and returns its input unchanged,
with an ``async def infer`` so that it runs on the event loop: what is left to
measure is nereid's own path (decode, validate, queue, batch, encode).
"""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim, ModelContext
from nereid.hookspecs import hookimpl
from nereid.signature import TEXTPROTO_NAME, ModelSignature, load_textproto_signature
from nereid.tensors import NamedTensor

BACKEND_NAME = "bench_identity"


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

    def unload(self) -> None:
        pass


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    if declared or (folder / "identity.txt").is_file():
        return BackendClaim(BACKEND_NAME, Identity)
    return None
