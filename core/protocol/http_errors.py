"""The HTTP layer's own refusal: a status, a message and headers, before any model is involved."""

from __future__ import annotations


class HttpError(Exception):
    """A request the HTTP layer itself refuses (before any model is involved)."""

    def __init__(self, status: int, message: str, headers: list | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []
