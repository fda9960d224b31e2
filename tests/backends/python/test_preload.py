"""Reading main.py's imports (backends/python/preload.py) from many threads at once, as concurrent loads do."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from nereid.backends.python.preload import imported_modules

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
            for _ in range(60):
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
