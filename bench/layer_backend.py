"""An in-process backend plugin running the numpy layer of bench_subprocess.py's ``numpy_layer`` model.

It claims folders holding a ``layer.txt``. Its ``infer`` is a plain method that
runs on the scheduler's worker thread, the path every real in-process model
takes, so that the subprocess benchmark can set a warm-started ``main.py``
beside the same numpy work done in the server's own process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nereid.backend import BackendClaim, ModelContext
from nereid.hookspecs import hookimpl
from nereid.signature import TEXTPROTO_NAME, ModelSignature, load_textproto_signature
from nereid.tensors import NamedTensor

BACKEND_NAME = "bench_layer"
WIDTH, UNITS = 16, 4


def layer_weights() -> tuple[np.ndarray, np.ndarray]:
    """The layer's fixed weights and bias (the main.py model builds the same)."""
    weights = (np.arange(WIDTH * UNITS, dtype=np.float32).reshape(WIDTH, UNITS) - 32) / 64
    return weights, np.linspace(-1, 1, UNITS, dtype=np.float32)


class NumpyLayer:
    platform = "bench_layer"

    def __init__(self, context: ModelContext) -> None:
        self._folder = context.folder
        self._signature: ModelSignature | None = None
        self._weights, self._bias = layer_weights()

    def load(self) -> None:
        self._signature = load_textproto_signature(self._folder / TEXTPROTO_NAME)

    def signature(self) -> ModelSignature:
        assert self._signature is not None
        return self._signature

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        result = np.tanh(inputs[0].data @ self._weights + self._bias).astype(np.float32)
        return [NamedTensor("output", inputs[0].dtype, result)]

    def unload(self) -> None:
        pass


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    if declared or (folder / "layer.txt").is_file():
        return BackendClaim(NumpyLayer)
    return None
