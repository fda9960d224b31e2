"""The HTTP layer's own refusals (``nereid.protocol.http_errors``): what one carries, and how it quotes a header's
value a client sent (the refusals themselves, on the wire: test_http_listener.py and test_http_service.py)."""

from __future__ import annotations

from nereid.protocol.http_errors import HttpError, header_text


def test_a_refusal_carries_its_status_its_message_and_its_headers() -> None:
    refused = HttpError(413, "the request body is over server.max_message_bytes", [(b"connection", b"close")])
    assert (refused.status, str(refused), refused.headers) == (
        413, "the request body is over server.max_message_bytes", [(b"connection", b"close")])
    assert HttpError(400, "bad").headers == []  # (none given: an empty list of its own)
    assert HttpError(400, "bad").headers is not HttpError(400, "bad").headers


def test_a_header_value_is_quoted_as_the_utf_8_a_client_writes() -> None:
    assert header_text("bücher.example".encode()) == "bücher.example"  # (as latin-1: bÃ¼cher.example)
    assert header_text(b"a\\b") == "a\\b"  # one backslash, as sent


def test_a_byte_that_is_no_utf_8_is_quoted_as_the_replacement_character() -> None:
    assert header_text(b"caf\xe9 ok") == "caf\ufffd ok"


def test_a_long_header_value_is_quoted_by_its_first_characters_only() -> None:
    assert header_text(b"x" * 1000) == "x" * 64
    assert header_text("ü".encode() * 100, limit=3) == "üüü"  # (characters, not bytes)
