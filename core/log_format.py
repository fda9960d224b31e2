"""The server log's format: one record starts each line, whatever the names and reasons it quotes hold.

A model folder's name, a path, a model's exception text and a compiler's
message all reach the log. A newline in any of them (a folder named
``ok\\n2026-12-01 10:00:00,000 ERROR nereid.server: ...``) would write a line
that reads as a record of its own, and terminal escapes or a carriage return
could hide what came before. Escaping each value at each log call would miss
the next call; the formatter does it once, for every record: a line break
becomes a break followed by an indent (a multi-line compiler message or
traceback stays readable, and no continuation line starts where a record
does), and every other control character is written as Python writes it.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTINUATION = "\n    "

# C0 and C1 controls but tab, DEL, the Unicode line and paragraph separators (which some log readers
# break lines at), the bidirectional formatting characters (which make a terminal show a line's text in another
# order than it holds: "Trojan Source") and lone surrogates (a name that is not UTF-8, which the stream could not
# encode); a newline is matched apart, to be kept as an indented break.
_UNSAFE = re.compile("(\r\n|\n)|[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")


def _replace(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return CONTINUATION
    return repr(match.group())[1:-1]  # '\r' -> \r, '\x1b' -> \x1b, '\u2028' -> \u2028, '\udcff' -> \udcff


def one_record_per_line(text: str) -> str:
    """``text`` with every line break indented and every other control character escaped."""
    return _UNSAFE.sub(_replace, text)


class OneRecordPerLineFormatter(logging.Formatter):
    """A Formatter whose every output line but a record's first is indented, and holds no control character.

    Without a ``datefmt``, times are ISO 8601 with milliseconds and the UTC offset
    (``2026-12-02T10:40:00.123+00:00``): logging's default has no offset, so lines
    from servers in different zones, or from either side of a daylight-saving
    change, could not be put in order.
    """

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        """``record.created`` as local time with its UTC offset, unless a ``datefmt`` was given."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")

    def format(self, record: logging.LogRecord) -> str:
        """The record formatted as usual (traceback included), then made safe by :func:`one_record_per_line`.

        Trailing line breaks are dropped first: a message that ends in one (Python's warnings, as
        ``logging.captureWarnings`` passes them) would end in a line of indent alone.
        """
        return one_record_per_line(super().format(record).rstrip("\r\n"))


def stderr_handler() -> logging.Handler:
    """The handler ``nereid`` commands log through: standard error, :data:`LOG_FORMAT`, one record per line."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneRecordPerLineFormatter(LOG_FORMAT))
    return handler
