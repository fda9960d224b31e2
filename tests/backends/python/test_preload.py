"""Reading main.py's imports (backends/python/preload.py): what is refused, and from many threads at once, as
concurrent loads do."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from nereid.backends.python.preload import imported_modules, triton_python_model
from nereid.errors import ConfigError

MAIN = "import json\nfrom os import path\n" + (
    "def f(x):\n    return [[[(y, {z: (w for w in z)}) for y in x] for z in x] for _ in x]\n" * 50)


class _Cycle:
    """Cyclic garbage with a finalizer: the collector runs Python code in whichever thread allocates."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(50))


def test_concurrent_loads_read_imports_without_a_system_error(tmp_path: Path) -> None:
    # Finalizers run by the collector in the middle of a parse let another thread in. Without the
    # parse lock, CPython 3.11.7 fails most runs of this with "AST constructor recursion depth
    # mismatch" (python/cpython#106905); models load on worker threads side by side.
    main_py = tmp_path / "main.py"
    main_py.write_text(MAIN)
    results: list[list[str] | BaseException] = []

    def load() -> None:
        try:
            for _ in range(20):  # without the lock, each of 10 runs failed (60 took 2 s once main.py was compiled too)
                for _ in range(200):
                    _Cycle()
                found = imported_modules(main_py, main_py.read_bytes())
            results.append(found)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads at every chance
    try:
        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert results == [["json", "os"]] * 4


@pytest.mark.parametrize("body, line, message", [
    ("return data\n", 3, "'return' outside function"),
    ("for i in []:\n    pass\nelse:\n    break\n", 6, "'break' outside loop"),
    ("continue\n", 3, "'continue' not properly in loop"),
    ("nonlocal total\n", 3, "nonlocal declaration not allowed at module level"),
    ("await data\n", 3, "'await' outside function"),
    ("def f(:\n    pass\n", 3, "invalid syntax"),  # found by the parser already
])
def test_main_py_that_python_would_not_run_is_refused_naming_the_file_line_and_error(tmp_path: Path, body: str,
                                                                                    line: int, message: str) -> None:
    # Defect: errors only the compiler finds (not the parser) passed: the model was READY, every run failed,
    # and with watch: true such an edit replaced the working version.
    main_py = tmp_path / "main.py"
    main_py.write_text("import os, sys\ndata = sys.stdin.buffer.read()\n" + body)
    with pytest.raises(ConfigError) as caught:
        imported_modules(main_py, main_py.read_bytes())
    assert str(caught.value) == f"{main_py}: not valid Python (line {line}: {message})"


TRITON_MODEL = "import numpy as np\n\n\nclass TritonPythonModel:\n    def execute(self, requests):\n        return []\n"


@pytest.mark.parametrize("source, sign", [
    ("import triton_python_backend_utils as pb_utils\n" + TRITON_MODEL, "imports triton_python_backend_utils"),
    ("try:\n    from triton_python_backend_utils import Tensor\nexcept ImportError:\n    pass\n",
     "imports triton_python_backend_utils"),
    ('"""A port."""\nVERSION = 2\n' + TRITON_MODEL,
     "defines class TritonPythonModel and runs nothing at its top level"),
    # A port that calls its class from its own top-level code may be right: its runs tell.
    (TRITON_MODEL + "TritonPythonModel().execute([])\n", None),
    (TRITON_MODEL + "if __name__ == '__main__':\n    main()\n", None),
    ("import os, sys\nraw = sys.stdin.buffer.read()\n", None),
    ("# TritonPythonModel was here\nimport sys\n", None),
])
def test_a_main_py_ported_from_triton_as_it_is_is_told_by_its_source(source: str, sign: str | None) -> None:
    assert triton_python_model(source.encode()) == sign
