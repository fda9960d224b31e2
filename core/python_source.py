"""Parsing Python source in a server whose models load on several threads at once.

CPython 3.11 keeps the AST constructor's recursion count in interpreter-wide state, not per thread
(python/cpython#106905). A parse that lets another thread run and meets that thread's parse fails with
"SystemError: AST constructor recursion depth mismatch", and the model being loaded was refused for it. The
constructor runs no Python code of its own; only a garbage collection inside it does (the finalizers it
calls), and that code can give the GIL up. So nereid's parses run with the collector paused, which lets no
other thread in, and take turns under :data:`PARSE_LOCK` besides, should code outside nereid turn the
collector back on.
"""

from __future__ import annotations

import ast
import threading

from nereid.collector_pause import collector_paused

# Held by every parse nereid makes in the server's process.
PARSE_LOCK = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, safe beside other threads' parses.

    Raises what ``ast.parse`` raises for the source itself (SyntaxError, ValueError for null bytes).
    """
    with PARSE_LOCK, collector_paused():
        return ast.parse(source, filename=filename)
