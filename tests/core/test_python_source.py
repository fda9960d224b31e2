"""Parsing Python source on threads side by side (core/python_source.py): a meta model's, a python model's and
a bundle's loads parse at once, beside the tracebacks other threads format."""

from __future__ import annotations

import ast
import contextlib
import gc
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from nereid import python_source
from nereid.backends.python.preload import imported_modules
from nereid.model_hooks import leading_imports

SOURCE = "import json\nfrom os import path\n" + (
    "def f(x):\n    return [[[(y, {z: (w for w in z)}) for y in x] for z in x] for _ in x]\n" * 50)


def _give_up_the_gil(phase: str, info: dict) -> None:
    """A collection's callback that lets another thread run, as a finalizer the collector runs can."""
    if phase == "start":
        time.sleep(0)


@contextlib.contextmanager
def _threads_switching_inside_parses() -> Iterator[None]:
    """Collections every few allocations, each giving the GIL up: a parse that meets another's does so within
    a run or two instead of once a week."""
    threshold = gc.get_threshold()
    interval = sys.getswitchinterval()
    gc.callbacks.append(_give_up_the_gil)
    gc.set_threshold(20)
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
        gc.callbacks.remove(_give_up_the_gil)


def _run_side_by_side(calls: list[Callable[[], object]], times: int) -> list[object]:
    """Each call ``times`` times on a thread of its own; each thread's last result or the exception it raised."""
    results: list[object] = [None] * len(calls)

    def repeat(index: int) -> None:
        try:
            for _ in range(times):
                results[index] = calls[index]()
        except BaseException as err:  # noqa: BLE001 - reported by the caller's assertion
            results[index] = err

    threads = [threading.Thread(target=repeat, args=(index,)) for index in range(len(calls))]
    with _threads_switching_inside_parses():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return results


def test_a_meta_model_s_and_a_python_model_s_loads_parse_side_by_side(tmp_path: Path) -> None:
    """Defect: a meta model's load read its model.py's leading imports with a parse of its own, beside the
    python backend's lock: CI refused the meta model with "SystemError: AST constructor recursion depth
    mismatch (before=45, after=40)" when a python model loaded beside it."""
    main_py = tmp_path / "main.py"
    main_py.write_text(SOURCE)
    results = _run_side_by_side([lambda: leading_imports(SOURCE.encode()),
                                 lambda: imported_modules(main_py, SOURCE.encode())], times=60)
    assert results == [["json", "os"], ["json", "os"]]


def test_a_parse_outside_nereid_does_not_spoil_nereid_s() -> None:
    """``traceback`` parses a line of source for each frame it formats, on whichever thread logs, outside
    nereid's lock: no such parse gets inside one of nereid's (the other way round is CPython's to mend)."""
    spoiled: list[SystemError] = []

    def parse_outside_the_lock() -> None:
        try:
            ast.parse(SOURCE)
        except SystemError as err:
            spoiled.append(err)

    results = _run_side_by_side([lambda: len(python_source.parse(SOURCE).body),
                                 parse_outside_the_lock], times=60)
    assert results[0] == 52
    assert all("recursion depth mismatch" in str(err) for err in spoiled)
