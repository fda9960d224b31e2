"""The HTTP layer's own refusal: a status, a message and headers, before any model is involved; how it quotes what
a client sent in a header."""

from __future__ import annotations


class HttpError(Exception):
    """A request the HTTP layer itself refuses (before any model is involved)."""

    def __init__(self, status: int, message: str, headers: list | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


def header_text(value: bytes, limit: int = 64) -> str:
    """A header's value as a refusal quotes it: its first ``limit`` characters, read as the UTF-8 clients write (as
    latin-1, ``bücher`` was quoted ``bÃ¼cher``), a byte that is none as U+FFFD (an escape's backslash came back
    doubled once the message quoted the text)."""
    return value.decode("utf-8", "replace")[:limit]
