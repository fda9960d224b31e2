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
import io
import threading
import tokenize

from nereid.collector_pause import collector_paused

# Held by every parse nereid makes in the server's process.
PARSE_LOCK = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, safe beside other threads' parses.

    Raises what ``ast.parse`` raises for the source itself (SyntaxError, ValueError for null bytes).
    """
    with PARSE_LOCK, collector_paused():
        return ast.parse(source, filename=filename)


def syntax_error_text(err: SyntaxError) -> str:
    """``err`` as a load's reason says it: ``line 3: invalid syntax``; the message alone where Python knows no
    line (3.11's null bytes: "line None" was said)."""
    return f"line {err.lineno}: {err.msg}" if err.lineno is not None else str(err.msg)


def undecodable(source: bytes) -> str | None:
    """Why ``python file.py`` refuses ``source`` before it parses it, its bytes not text in the file's encoding
    (PEP 263: UTF-8 unless a coding line declares another), with the line; None when they decode.

    compile() of bytes does not tell: it let bytes that are no UTF-8 pass in a comment, where ``python main.py``
    stops (found by the error hunt: a model READY whose warm runs each failed inside the tokenizer).
    """
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    except SyntaxError as err:
        if not str(err.msg).startswith("invalid or missing encoding declaration"):
            return syntax_error_text(err)  # a coding line naming no codec Python knows, say
        encoding = "utf-8"  # (said of a first or second line that is no UTF-8: the byte is found below)
    try:
        source.decode(encoding)
    except UnicodeDecodeError as err:
        line = source.count(b"\n", 0, err.start) + 1
        return (f"line {line}: byte {source[err.start:err.start + 1]!r} is not {err.encoding} text (PEP 263: a file "
                "is UTF-8 unless a coding line, such as '# -*- coding: latin-1 -*-', declares another)")
    return None
