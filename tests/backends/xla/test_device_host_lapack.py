"""CPU programs that call jaxlib's LAPACK kernels (cholesky, eigh, solve, qr), served by a process that never lowers
anything with jax (as the server never does).

Defect: those kernels get their LAPACK functions only when jax lowers a linear-algebra op, so such a bundle loaded
READY and its first request killed the server with SIGSEGV. Each test runs the server or the model in its own
process: this one has lowered linear algebra (to export the bundle), which would hide the defect, and a crash
there fails the test instead of pytest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from support import nereid_serve

from nereid.backends.xla.export import export_bundle

OUTPUTS = ["chol", "eigenvalues", "solved", "r_abs"]
X = np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32)
W = np.arange(16, dtype=np.float32).reshape(4, 4)


def linear_algebra(x, w):
    """potrf, syevd, getrf + trsm, geqrf + orgqr: each a LAPACK custom call in a CPU program."""
    import jax.numpy as jnp

    a = x @ x.T + 4 * jnp.eye(x.shape[0], dtype=x.dtype)  # symmetric positive definite
    return jnp.linalg.cholesky(a), jnp.linalg.eigvalsh(a), jnp.linalg.solve(a, w), jnp.abs(jnp.linalg.qr(x)[1])


def doubled(x, w):
    """No linear algebra."""
    return (x * w,)


def expected(x: np.ndarray) -> list[np.ndarray]:
    a = x.astype(np.float64) @ x.T.astype(np.float64) + 4 * np.eye(len(x))
    return [np.linalg.cholesky(a), np.linalg.eigvalsh(a), np.linalg.solve(a, W), np.abs(np.linalg.qr(x)[1])]


@pytest.fixture(scope="module")
def lapack_bundle(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("host-lapack") / "linalg"
    export_bundle(linear_algebra, [X], {"w": W}, directory=folder, input_names=["x"], output_names=OUTPUTS,
                  provenance=False)
    assert b"lapack_spotrf_ffi" in (folder / "model.mlir").read_bytes()  # what the tests are about
    return folder


def test_a_server_answers_cpu_linear_algebra_and_stays_up(repo, lapack_bundle) -> None:
    shutil.copytree(lapack_bundle, repo.models_dir / "linalg")
    with nereid_serve(repo.write_config("- name: linalg\n  device: cpu\n", metrics_addr="")) as (process, client):
        assert client.is_model_ready("linalg")
        tensor = triton.InferInput("x", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)
        try:
            result = client.infer("linalg", [tensor])
        except Exception as err:
            process.kill()
            pytest.fail(f"infer on model 'linalg' failed ({err}); server exit status {process.wait()}, "
                        f"output:\n{process.stdout.read()[-3000:]}")
        for name, want in zip(OUTPUTS, expected(X)):
            np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-4, atol=1e-4, err_msg=name)
        assert process.poll() is None, "the server exited after answering"


# Loads the LAPACK bundle, then one without linear algebra, with scipy's LAPACK (where jaxlib takes it from) made
# unimportable: prints what happened as JSON.
WITHOUT_SCIPY_LAPACK = textwrap.dedent('''
    import json, logging, sys
    import numpy as np
    from nereid.backend import ModelContext
    from nereid.backends.xla.model import XlaModel
    from nereid.settings import ModelSettings
    from nereid.tensors import NamedTensor

    sys.modules["scipy.linalg.cython_lapack"] = None  # import fails: ModuleNotFoundError
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("nereid").addHandler(handler)

    def model(folder):
        from pathlib import Path
        folder = Path(folder)
        return XlaModel(ModelContext(folder.name, folder, ModelSettings(folder.name), folder.parent, "test"))

    report = {}
    try:
        model(sys.argv[1]).load()
        report["lapack"] = "loaded"
    except Exception as err:
        report["lapack"] = f"{type(err).__name__}: {err}"
    plain = model(sys.argv[2])
    plain.load()
    y = plain.infer([NamedTensor.from_array("x", np.ones((1, 3), np.float32))])[0].data
    report["plain"] = y.tolist()
    report["warnings"] = warnings
    print(json.dumps(report))
''')


def test_without_lapack_a_program_that_calls_it_does_not_load_and_others_do(tmp_path, lapack_bundle) -> None:
    lapack = shutil.copytree(lapack_bundle, tmp_path / "linalg")
    plain = export_bundle(doubled, [np.zeros((1, 3), np.float32)], {"w": np.float32(2)},
                          directory=tmp_path / "doubled", input_names=["x"], output_names=["y"], provenance=False)
    run = subprocess.run([sys.executable, "-c", WITHOUT_SCIPY_LAPACK, str(lapack), str(plain)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    reason = report["lapack"]
    assert reason.startswith("ConfigError: model.mlir: the program calls jaxlib's CPU linear algebra (LAPACK) "
                             "kernels ("), reason
    assert "lapack_spotrf_ffi" in reason and "lapack_ssyevd_ffi" in reason, reason
    assert "scipy.linalg.cython_lapack" in reason and "pip install scipy" in reason, reason
    assert report["plain"] == [[2.0, 2.0, 2.0]]
    assert len(report["warnings"]) == 1 and "could not be initialised" in report["warnings"][0], report["warnings"]


# The kernels' first initialisation while another load's first imports hold CODE_LOCK: prints whether
# scipy.linalg was imported before, while the lock was held, the initialisation's answer, and after.
INITIALISES_BESIDE_ANOTHER_LOAD_S_IMPORTS = """
import json, sys, threading
from nereid.backends.xla.device import host_lapack_problem, import_jax
from nereid.model_hooks import CODE_LOCK

import_jax("bundle")
before = "scipy.linalg" in sys.modules
outcome = []
with CODE_LOCK:
    initialising = threading.Thread(target=lambda: outcome.append(host_lapack_problem("cpu", b"", "bundle")))
    initialising.start()
    initialising.join(1.0)
    during = "scipy.linalg" in sys.modules
initialising.join(60)
print(json.dumps([before, during, outcome, "scipy.linalg" in sys.modules]))
"""


def test_the_kernels_first_import_of_scipy_takes_its_turn_with_other_loads_first_imports() -> None:
    """Defect (the thread-safety hunt): the initialisation imported all of scipy.linalg on a bundle's load thread
    outside CODE_LOCK, beside a meta model's load importing scipy.linalg: one of them could fail with
    `_DeadlockError: deadlock detected by _ModuleLock('scipy.linalg.cython_blas')`."""
    run = subprocess.run([sys.executable, "-c", INITIALISES_BESIDE_ANOTHER_LOAD_S_IMPORTS], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == [False, False, [None], True]
