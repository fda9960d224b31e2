"""What the cxx backend's test modules share: the compiler, the shipped cxx_scale example, and small helpers to
declare a cxx model in nereid.yaml and to send it a tensor."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

EXAMPLES = Path(__file__).resolve().parents[3] / "ml-backends"
CXX = shutil.which(os.environ.get("CXX", "c++"))

TRIPLE = (EXAMPLES / "cxx_scale" / "scale.cpp").read_text().replace("* 2.0f", "* 3.0f")

SCALE_TEXTPROTO = (EXAMPLES / "cxx_scale" / "model_inference.textproto").read_text()
ROWS = np.arange(-8, 16, dtype=np.float32).reshape(3, 8) * 0.25


def index_of(server) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def tensor(name: str, array: np.ndarray, datatype: str = "FP32") -> triton.InferInput:
    value = triton.InferInput(name, list(array.shape), datatype)
    value.set_data_from_numpy(array)
    return value


def scale_model(repo, name: str, textproto: str = SCALE_TEXTPROTO) -> Path:
    return repo.add(name, textproto)


def entry(name: str, runtime: str, extra: str = "") -> str:
    return f'- name: "{name}"\n  backend: "cxx"\n  runtime: {runtime}\n{extra}'
