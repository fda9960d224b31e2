"""Lines that can repeat without end, limited: nereid's own and a library's."""

from __future__ import annotations

import asyncio
import logging
import time

from nereid.log_limit import RateLimitedLog, RateLimitFilter, say_suppressed_counts_now


def test_the_next_line_let_through_says_how_many_were_dropped():
    always_new = RateLimitFilter(("flood",), burst=1, window_s=0.0)  # each window over at once
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "flood", None, None)
    assert always_new.filter(record) and always_new.filter(record)
    limited = RateLimitFilter(("flood",), burst=1, window_s=3600)
    first, second, third = (logging.LogRecord("x", logging.ERROR, __file__, 1, "flood", None, None)
                            for _ in range(3))
    assert limited.filter(first) and not limited.filter(second) and not limited.filter(third)
    limited._budget._window_start -= 3600  # the window ends
    fourth = logging.LogRecord("x", logging.ERROR, __file__, 1, "flood", None, None)
    assert limited.filter(fourth) and fourth.getMessage().endswith("(2 more such line(s) were dropped before this one)")


def test_a_flood_that_stops_still_says_how_many_lines_were_suppressed(caplog):
    """The count of suppressed lines went with the next line written: a flood that stopped never said how
    large it was. On the event loop, the count has a line of its own at the window's end."""
    limited = RateLimitedLog(logging.getLogger("nereid.test_flood"), burst=2, window_s=0.2)
    shared = limited.sharing(logging.getLogger("nereid.test_flood.other"))

    async def flood() -> None:
        for i in range(5):
            limited.warning("garbage %d", i)
        shared.warning("other garbage")  # counted in the same budget, told once
        await asyncio.sleep(0.6)  # (past the window's end, with room for a busy machine)

    with caplog.at_level(logging.INFO, logger="nereid.test_flood"):
        asyncio.run(flood())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("nereid.test_flood")]
    assert lines == [("WARNING", "garbage 0"), ("WARNING", "garbage 1"),
                     ("WARNING", "4 similar message(s) suppressed in the last 0.2 s (at most 2 written per window); "
                                 "the last: other garbage")]
    assert [r.name for r in caplog.records if r.name.startswith("nereid.test_flood")][-1] == "nereid.test_flood.other"


def test_the_counts_not_yet_told_are_told_at_once_when_asked(caplog):
    """Defect (the operator hunt): a flood just before the server stopped was never told, its window's timer
    cancelled with the loop; the stop asks every log to tell its count now."""
    limited = RateLimitedLog(logging.getLogger("nereid.test_stop"), burst=1, window_s=10)

    async def flood_then_stop() -> None:
        for i in range(4):
            limited.warning("garbage %d", i)
        say_suppressed_counts_now()  # (as the server's stop does)

    with caplog.at_level(logging.INFO, logger="nereid.test_stop"):
        asyncio.run(flood_then_stop())
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.test_stop"] == [
        "garbage 0", "3 similar message(s) suppressed in the last 10 s (at most 1 written per window); the last: "
                     "garbage 3"]


def test_a_line_written_after_the_window_carries_the_count_instead(caplog):
    limited = RateLimitedLog(logging.getLogger("nereid.test_flood"), burst=1, window_s=0.2)

    async def flood() -> None:
        limited.warning("first")
        limited.warning("refused")
        limited._budget._window_start -= 1  # the window ends before its report runs ...
        limited.warning("next")  # ... and this line says it
        await asyncio.sleep(0.3)

    with caplog.at_level(logging.INFO, logger="nereid.test_flood"):
        asyncio.run(flood())
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.test_flood"] == [
        "first", "next (1 similar message(s) suppressed before this one)"]


def test_the_count_keeps_no_reference_to_what_the_last_line_was_about(caplog):
    """A model's fault is logged with the failure as its argument, whose traceback can hold the request's
    tensors: the pending count must keep its words, not the failure."""
    import gc
    import weakref

    class Failure(Exception):
        pass

    limited = RateLimitedLog(logging.getLogger("nereid.test_flood"), burst=1, window_s=0.2)

    async def flood() -> None:
        limited.error("%s", Failure("first"))
        refused = Failure("model 'm' failed: boom")
        kept = weakref.ref(refused)
        limited.error("%s", refused)
        del refused
        gc.collect()
        assert kept() is None
        await asyncio.sleep(0.6)

    with caplog.at_level(logging.INFO, logger="nereid.test_flood"):
        asyncio.run(flood())
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.test_flood"][-1].endswith(
        "the last: model 'm' failed: boom")


def test_a_count_due_on_a_loop_that_closed_is_told_on_the_next_loop(caplog):
    """A review: the report timer of a loop that had closed (a server stopped in the process) kept the next
    loop from scheduling one for the rest of the window, so its count was never told."""
    limited = RateLimitedLog(logging.getLogger("nereid.test_flood"), burst=1, window_s=0.3)

    async def flood(label: str, linger_s: float) -> None:
        for i in range(3):
            limited.warning("%s %d", label, i)
        await asyncio.sleep(linger_s)

    with caplog.at_level(logging.INFO, logger="nereid.test_flood"):
        asyncio.run(flood("first loop", 0.01))  # closes before its window ends
        asyncio.run(flood("second loop", 0.8))
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.test_flood"] == [
        "first loop 0", "5 similar message(s) suppressed in the last 0.3 s (at most 1 written per window); the last: "
        "second loop 2"]


def test_a_report_that_runs_late_tells_one_window_once(caplog):
    """A review: a loop held past a window's end ran its report timer late; a second timer was scheduled beside
    it, and one window's count came in two lines, the second before its window had ended."""
    limited = RateLimitedLog(logging.getLogger("nereid.test_flood"), burst=1, window_s=0.3)

    async def flood() -> None:
        limited.warning("a")
        limited.warning("refused")
        time.sleep(0.35)  # the loop held past the window's end: its report is overdue
        limited.warning("b")  # begins a new window, carrying the first window's count
        limited.warning("refused again")
        limited.warning("and again")
        await asyncio.sleep(0.8)

    with caplog.at_level(logging.INFO, logger="nereid.test_flood"):
        asyncio.run(flood())
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.test_flood"] == [
        "a", "b (1 similar message(s) suppressed before this one)",
        "2 similar message(s) suppressed in the last 0.3 s (at most 1 written per window); the last: and again"]


def test_a_shared_rate_limited_log_writes_through_its_own_logger_within_the_first_ones_limit(caplog):
    """The HTTP listener and application log what a client can trigger at will through one limit: a client
    mixing both kinds of hostile request must not get twice the lines."""
    from nereid.log_limit import RateLimitedLog

    first = RateLimitedLog(logging.getLogger("nereid.test.app"), burst=3, window_s=60)
    second = first.sharing(logging.getLogger("nereid.test.listener"))
    with caplog.at_level(logging.INFO, logger="nereid.test"):
        written = [log.log(logging.INFO, "line %d", n) for n in range(3) for log in (first, second)]
    assert written == [True, True, True, False, False, False]
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("nereid.test.app", "line 0"), ("nereid.test.listener", "line 0"), ("nereid.test.app", "line 1")]
