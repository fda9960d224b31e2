"""A meta model whose model.py uses jax in the server process, beside bundles: real `nereid check` runs, each a fresh
interpreter (jax is imported, and XLA started, once per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support import free_port

REPOSITORY = Path(__file__).resolve().parents[3] / "ml-backends"

JAX_META_MANIFEST = """format_version: "2.1"
meta: true
client_inputs:
  - {name: x, dtype: f32, shape: a, dims: {a: 4}}
client_outputs:
  - {name: y, dtype: f32, shape: a, dims: {a: 4}}
"""

# jax used as model.py is imported: it imports jax's modules and starts XLA in the server process.
JAX_META_MODEL_PY = """import numpy as np
import jax.numpy as jnp
import nereid
from nereid.tensors import NamedTensor

_ONES = np.asarray(jnp.ones(4, jnp.float32))

async def orchestrate(inputs, ctx):
    (x,) = inputs
    return [NamedTensor.from_array("y", x.data * _ONES)]

nereid.register_model(orchestrate=orchestrate)
"""


def _repository(tmp_path: Path) -> Path:
    """python_rowsum, mlp_bundle and jaxmeta (model.py using jax), all listed."""
    models = tmp_path / "ml-backends"
    for name in ("python_rowsum", "mlp_bundle"):
        shutil.copytree(REPOSITORY / name, models / name, ignore=shutil.ignore_patterns(".cache"))
    (models / "jaxmeta").mkdir()
    (models / "jaxmeta" / "manifest.yaml").write_text(JAX_META_MANIFEST)
    (models / "jaxmeta" / "model.py").write_text(JAX_META_MODEL_PY)
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: "{models}"\n  model_load_threads: 4\n'
                      "models:\n  - name: python_rowsum\n  - name: mlp_bundle\n  - name: jaxmeta\n")
    return config


def _check(config: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "nereid", "check", "--config", str(config)], capture_output=True,
                          text=True, timeout=300, env={**environ, **env})


def _lines(out: str) -> dict[str, str]:
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line}


def test_a_meta_model_importing_jax_loads_beside_a_bundles_first_load(tmp_path) -> None:
    """Found by the hunt of this session's changes: two loads importing jax's circular modules for the first time
    at once (a bundle's, a meta model's model.py) failed both, "cannot import name 'AbstractValue' from partially
    initialized module 'jax._src.core'", at every start of a server that had both (its loads run side by side)."""
    config = _repository(tmp_path)
    port = free_port()
    config.write_text(config.read_text().replace("server:\n", f'server:\n  bind_addr: "127.0.0.1:0"\n  http_addr: '
                                                               f'"127.0.0.1:{port}"\n  metrics_addr: ""\n'))
    environ = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    server = subprocess.Popen([sys.executable, "-m", "nereid", "serve", "--config", str(config)], env=environ,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        index = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/repository/index", data=b"{}",
                                                 method="POST")
                index = json.loads(urllib.request.urlopen(request, timeout=5).read())
            except OSError:
                index = None
            if index and all(entry["state"] not in ("LOADING", "UNKNOWN") for entry in index):
                break
            time.sleep(0.2)
        assert index is not None, server.stderr.read() if server.poll() is not None else "no answer"
        assert {entry["name"]: entry["state"] for entry in index} == {
            "python_rowsum": "READY", "mlp_bundle": "READY", "jaxmeta": "READY"}, index
    finally:
        server.terminate()
        server.wait(60)


def test_xla_flags_xla_refuses_fail_a_meta_model_using_jax_not_the_process(tmp_path) -> None:
    """Found by the same hunt: the XLA_FLAGS check guarded only a bundle's start of jax's backends, so a meta
    model whose model.py started jax ended the server (and nereid check) on XLA's LOG(FATAL)."""
    config = _repository(tmp_path)
    (tmp_path / "ml-backends" / "mlp_bundle").rename(tmp_path / "elsewhere")  # (only the meta model starts jax)
    config.write_text(config.read_text().replace("  - name: mlp_bundle\n", ""))
    checked = _check(config, XLA_FLAGS="--xla_no_such_flag_of_nereids=true")
    lines = _lines(checked.stdout)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert lines["python_rowsum"].startswith("OK"), lines
    assert lines["jaxmeta"].startswith("UNAVAILABLE: model 'jaxmeta': XLA ends any process that starts it with "
                                       "XLA_FLAGS='--xla_no_such_flag_of_nereids=true'"), lines


@pytest.fixture(autouse=True)
def _no_gpu_needed() -> None:
    if list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("jax would start a GPU backend here too")
