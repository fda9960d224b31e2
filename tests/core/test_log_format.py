"""The server log's format: one record starts each line, whatever a name or a reason holds."""

from __future__ import annotations

import logging
import re
import signal
import time
from datetime import datetime, timezone

from nereid.log_format import LOG_FORMAT, OneRecordPerLineFormatter, one_record_per_line, stderr_handler
from support import nereid_serve

FORGED = "ok\n2026-12-01 10:00:00,000 ERROR nereid.server: FORGED"


def test_a_line_break_becomes_an_indented_continuation_and_other_controls_are_escaped() -> None:
    assert one_record_per_line(FORGED) == "ok\n    2026-12-01 10:00:00,000 ERROR nereid.server: FORGED"
    assert one_record_per_line("a\r\nb\rc\x1b[2Jd\u2028e\x85f\udcff") == "a\n    b\\rc\\x1b[2Jd\\u2028e\\x85f\\udcff"
    assert one_record_per_line("model 'it's' is READY\t(é, 🙂)") == "model 'it's' is READY\t(é, 🙂)"  # unchanged
    # (Found by a bug hunt: the bidirectional formatting characters, which reorder what a terminal shows, went out
    # as they were; Arabic, Hebrew and joiners stay.)
    assert (one_record_per_line("m\u202etxt.exe\u2066x\u2069\u200f\u061c")
            == "m\\u202etxt.exe\\u2066x\\u2069\\u200f\\u061c")
    assert one_record_per_line("نموذج מודל a\u200db") == "نموذج מודל a\u200db"


def test_a_traceback_stays_readable_and_every_line_but_the_first_is_indented() -> None:
    formatter = OneRecordPerLineFormatter(LOG_FORMAT)
    try:
        raise RuntimeError("compile failed:\nline 1\nline 2")
    except RuntimeError:
        record = logging.LogRecord("nereid.repository", logging.ERROR, __file__, 1, "model '%s' failed", (FORGED,),
                                   exc_info=__import__("sys").exc_info())
    first, *rest = formatter.format(record).split("\n")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d ERROR nereid.repository: model 'ok$", first)
    assert rest and all(line.startswith("    ") for line in rest)
    assert "    Traceback (most recent call last):" in rest and "    line 2" in rest
    assert isinstance(stderr_handler().formatter, OneRecordPerLineFormatter)


def test_a_message_ending_in_a_line_break_ends_at_its_last_line_of_text() -> None:
    """Defect: Python's warnings (logged through logging.captureWarnings) end in a newline, which became a
    last line of indent alone."""
    record = logging.LogRecord("py.warnings", logging.WARNING, __file__, 1,
                               "main.py:3: SyntaxWarning: \"is\" with a literal\n  if x is 1:\n", (), None)
    assert OneRecordPerLineFormatter("%(message)s").format(record) == (
        "main.py:3: SyntaxWarning: \"is\" with a literal\n      if x is 1:")


def test_a_folder_name_cannot_forge_a_line_of_the_server_log(repo) -> None:
    """Defect: a folder named `ok\\n<timestamp> ERROR nereid.server: ...` wrote a line of its own into the log."""
    repo.python(FORGED)
    with nereid_serve(repo.write_config()) as (process, client):
        assert client.is_model_ready(FORGED)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        lines = process.stdout.read().splitlines()
    assert not [line for line in lines if line.startswith("2026-12-01 10:00:00,000")]
    ready = [i for i, line in enumerate(lines) if line.endswith("INFO nereid.repository: model 'ok")]
    assert ready and lines[ready[0] + 1].startswith("    2026-12-01 10:00:00,000 ERROR nereid.server: FORGED' is READY")


def test_a_lines_time_carries_its_utc_offset(monkeypatch) -> None:
    """Defect: logging's default time (``2026-12-02 10:40:00,123``) had no zone, so the logs of servers in two
    zones, or either side of a daylight-saving change, could not be put in order."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        record = logging.LogRecord("nereid.server", logging.INFO, __file__, 1, "hello", (), None)
        record.created = datetime(2026, 7, 1, 12, 0, 0, 250000, tzinfo=timezone.utc).timestamp()
        line = stderr_handler().format(record)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert line == "2026-07-01T08:00:00.250-04:00 INFO nereid.server: hello"
    assert datetime.fromisoformat(line.split(" ")[0]).timestamp() == record.created
    # A datefmt of one's own is still honoured.
    assert OneRecordPerLineFormatter("%(asctime)s", datefmt="%Y").format(record) == "2026"
