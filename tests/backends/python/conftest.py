"""Fixtures of the python backend's tests: a fake CUDA driver, for the warm parent's CUDA check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# The two driver calls the warm parent's check relies on, as NVIDIA documents them: every call but cuInit
# returns CUDA_ERROR_NOT_INITIALIZED (3) until cuInit has been called.
FAKE_LIBCUDA_C = r"""
static int initialised;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) {
    if (!initialised)
        return 3;
    *count = 1;
    return 0;
}
"""


@pytest.fixture
def fake_libcuda(tmp_path: Path) -> Path:
    """A ``libcuda.so.1`` with only cuInit and cuDeviceGetCount, compiled into its own folder of tmp_path
    (skips the test where no C compiler is installed)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) to build a fake libcuda.so.1")
    folder = tmp_path / "fake_cuda"
    folder.mkdir()
    (folder / "libcuda.c").write_text(FAKE_LIBCUDA_C)
    library = folder / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "libcuda.c")], check=True)
    return library
