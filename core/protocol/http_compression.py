"""Compressed HTTP infer bodies, as Triton's HTTP endpoint takes and gives them: gzip and deflate.

A request body coded gzip or deflate (``Content-Encoding``; tritonclient's
``request_compression_algorithm``) is decompressed before it is read, bounded by
the body limit however small the compressed body; an answer is compressed when
the client prefers gzip or deflate (``Accept-Encoding``, with Triton's rule for
its q-values; tritonclient's ``response_compression_algorithm``).
"""

from __future__ import annotations

import re
import zlib

from nereid.protocol.http_errors import HttpError, header_text

# Either coding is inflated as Triton inflates both: zlib's automatic header detection (a zlib or a gzip header).
_INFLATE_WBITS = 32 | zlib.MAX_WBITS
# How each coding is written (gzip: a gzip header; deflate: HTTP's "deflate", a zlib stream), at zlib's default
# level, as Triton writes them.
_DEFLATE_WBITS = {"gzip": 16 | zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# The codings a request body may have (RFC 9110 18.6: x-gzip is gzip), by their lower-case names.
_REQUEST_CODINGS = {b"gzip": "gzip", b"x-gzip": "gzip", b"deflate": "deflate"}
# The most members (gzip's, or zlib streams) one after another that a body may hold: each costs a fresh
# decompressor, and a body of millions of one-byte members is no client's. (HTTP's deflate is one zlib stream, and
# Triton inflates one stream of either.)
MAX_MEMBERS = 64
# A weight in Accept-Encoding (RFC 9110 12.4.2: "q=" and 0 to 1 with up to three decimals; float() alone took
# "q=1_0" for 10).
_QVALUE = re.compile(r"[qQ]=((?:0(?:\.[0-9]{0,3})?)|(?:1(?:\.0{0,3})?))")
# How much of a body is handed to zlib at a time (see decompressed).
_FEED_BYTES = 64 << 10
# Said to a client whose coding is refused (RFC 9110 15.5.16), as Triton says it.
ACCEPTED_CODINGS = [(b"accept-encoding", b"gzip, deflate")]


def request_coding(headers: dict[bytes, bytes], who: str) -> str | None:
    """The coding of a request body (``gzip`` or ``deflate``), from its ``Content-Encoding``; None for none
    (absent, or ``identity``). HttpError 400 for another coding, or for more than one."""
    given = headers.get(b"content-encoding")
    if given is None:
        return None
    codings = [coding.strip().lower() for coding in given.split(b",")]  # (any case; a list)
    codings = [coding for coding in codings if coding not in (b"identity", b"")]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in _REQUEST_CODINGS:
        return _REQUEST_CODINGS[codings[0]]
    raise HttpError(400, f"{who}Content-Encoding {header_text(given)!r} is not supported: send the body "
                         "uncompressed, or compressed once, with gzip or deflate", ACCEPTED_CODINGS)


def decompressed(body: bytes | memoryview, coding: str, limit: int, who: str) -> bytes:
    """``body`` decoded from ``coding``. HttpError 413 once the result passes ``limit`` bytes (nothing past it is
    made: a few kilobytes of gzip can hold gigabytes), 400 for data that is not ``coding``'s or ends early, or
    that holds more than :data:`MAX_MEMBERS` members.

    Concatenated members (gzip's, as RFC 1952 reads them; zlib streams alike) are one body, empty ones included.
    The body is fed a slice at a time, so that what zlib hands back unread (the rest of a member's input, the
    input after it) is at most a slice: handed the whole body, each of N members copied what followed it, and a
    5 MB body of 600,000 one-byte members took half a minute of the server's CPU (the hunt of this session's
    changes). Works in zlib's C code with the GIL released, so a large body can be decompressed on a worker
    thread without holding the event loop.
    """
    view = memoryview(body)
    parts: list[bytes] = []
    size = position = members = 0
    try:
        while position < len(view) or not members:
            members += 1
            if members > MAX_MEMBERS:
                raise HttpError(400, f"{who}the request body holds more than {MAX_MEMBERS} {coding} members one "
                                     f"after another (Content-Encoding: {coding}); send it compressed as one")
            inflater = zlib.decompressobj(_INFLATE_WBITS)
            pending: bytes | memoryview = b""  # (what zlib left unread of the slice fed last)
            while not inflater.eof:
                if not pending and position < len(view):
                    pending = view[position:position + _FEED_BYTES]
                    position += len(pending)
                part = inflater.decompress(pending, limit + 1 - size)  # (at most one byte past the limit)
                pending = inflater.unconsumed_tail
                if part:
                    size += len(part)
                    if size > limit:
                        raise HttpError(413, f"{who}the request body, decompressed ({coding}), exceeds the limit of "
                                             f"{limit} bytes (server.max_message_bytes)")
                    parts.append(part)
                elif not pending and position >= len(view) and not inflater.eof:
                    raise HttpError(400, f"{who}the request body ends before its {coding} data does "
                                         f"(Content-Encoding: {coding}); send the whole compressed body")
            position -= len(inflater.unused_data) + len(inflater.unconsumed_tail)  # (the next member's start)
    except zlib.error as err:
        raise HttpError(400, f"{who}the request body is not valid {coding} data (Content-Encoding: {coding}): "
                             f"{err}; send it uncompressed, or compressed with {coding}") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def response_coding(headers: dict[bytes, bytes]) -> str | None:
    """The coding an answer is given for the client's ``Accept-Encoding``: ``gzip`` or ``deflate``, None for none.

    Triton's rule: of ``identity``, ``gzip`` and ``deflate``, the one of the highest q-value (1 when not
    given; the first of equals); a malformed entry or other coding is passed over. Names are compared in any
    case (RFC 9110 8.4.1), where Triton's are exact.
    """
    given = headers.get(b"accept-encoding")
    if given is None:
        return None
    chosen, best = "identity", 0.0
    for entry in given.decode("latin-1").split(","):
        name, _, weight = entry.partition(";")
        name = name.strip().lower()
        if weight:
            valid = _QVALUE.fullmatch(weight.strip())
            if valid is None:
                continue  # (a malformed weight, or another parameter)
            quality = float(valid.group(1))
        else:
            quality = 1.0
        if name in ("identity", "gzip", "deflate") and quality > best:
            chosen, best = name, quality
    return None if chosen == "identity" else chosen


def compressed(parts: list[bytes | memoryview], coding: str) -> bytes:
    """An answer's body parts as one body coded ``coding`` (``gzip`` or ``deflate``)."""
    deflater = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, _DEFLATE_WBITS[coding])
    return b"".join([*(deflater.compress(part) for part in parts), deflater.flush()])
