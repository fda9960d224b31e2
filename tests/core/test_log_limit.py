"""Lines that can repeat without end, limited: nereid's own and a library's."""

from __future__ import annotations

import logging
import resource

import pytest

from nereid.cli import limit_repeated_library_lines, raise_open_file_limit
from nereid.log_limit import RateLimitFilter


def test_asyncio_out_of_descriptors_lines_are_limited_while_others_pass(caplog):
    """Out of file descriptors, asyncio logged "socket.accept() out of system resource" with a traceback for
    every pending connection: about 12,000 lines a second, 109 MB of log in 22 s."""
    asyncio_log = logging.getLogger("asyncio")
    filters = list(asyncio_log.filters)
    limit_repeated_library_lines()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):
                asyncio_log.error("socket.accept() out of system resource\nsocket: <socket>")
            asyncio_log.error("Task exception was never retrieved")
    finally:
        asyncio_log.filters[:] = filters
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert sum(m.startswith("socket.accept() out of system resource") for m in messages) == 5
    assert "Task exception was never retrieved" in messages  # other lines pass untouched


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


def test_grpc_s_error_for_an_answer_to_an_ended_call_is_a_debug_line(caplog):
    """A deadline passing in gRPC's core as nereid answered DEADLINE_EXCEEDED logged an ERROR and a traceback
    (the client had its status either way): about one in thirty requests expiring in a queue."""
    grpc_log, nereid_log = logging.getLogger("grpc._cython.cygrpc"), logging.getLogger("nereid")
    filters, level = list(grpc_log.filters), nereid_log.level
    limit_repeated_library_lines()

    def ended_call() -> None:
        try:
            raise RuntimeError('Failed "execute_batch"')
        except RuntimeError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/inference/ModelInfer")
    try:
        with caplog.at_level(logging.DEBUG):
            nereid_log.setLevel(logging.INFO)  # as nereid serve logs by default
            ended_call()
            grpc_log.error("Unexpected [ValueError] raised by servicer method [/x]")  # others pass untouched
            nereid_log.setLevel(logging.DEBUG)
            ended_call()
    finally:
        grpc_log.filters[:] = filters
        nereid_log.setLevel(level)
    records = [r for r in caplog.records if r.name == "grpc._cython.cygrpc"]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in records] == [
        ("ERROR", "Unexpected [ValueError] raised by servicer method [/x]", None),
        ("DEBUG", "gRPC could not send the answer of [/inference/ModelInfer]: the call had already ended", None)]


def test_serving_raises_the_soft_open_file_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no finite hard limit to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        raise_open_file_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


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
