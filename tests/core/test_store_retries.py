"""Loads the store failed, tried again ever less often: the backoff, what is logged, what is forgotten."""

from __future__ import annotations

import logging

from nereid.folder_states import FolderState
from nereid.store_retries import STORE_RETRY_CAP_S, StoreRetries

SEEN = FolderState((("main.py", 10, "etag-1"),), "one look at the folder")
EDITED = FolderState((("main.py", 11, "etag-2"),), "another")


def test_each_failure_doubles_the_wait_up_to_the_cap(caplog) -> None:
    retries = StoreRetries(poll_s=10)
    with caplog.at_level(logging.DEBUG, logger="nereid.watch"):
        waits = [retries.failed("m", SEEN, "GET failed: 503 Slow Down", reloading=False).delay_s for _ in range(8)]
    assert waits == [10, 20, 40, 80, 160, STORE_RETRY_CAP_S, STORE_RETRY_CAP_S, STORE_RETRY_CAP_S]
    assert retries.get("m").failures == 8
    levels = [r.levelname for r in caplog.records if r.name == "nereid.watch"]
    assert levels == ["WARNING"] + ["DEBUG"] * 7  # the same failure again is no news
    assert "did not load because of the store (GET failed: 503 Slow Down)" in caplog.records[0].getMessage()
    assert StoreRetries(poll_s=600).failed("m", SEEN, "x", reloading=True).delay_s == 600  # never under a poll


def test_a_failure_for_another_reason_is_a_warning_again(caplog) -> None:
    retries = StoreRetries(poll_s=1)
    with caplog.at_level(logging.DEBUG, logger="nereid.watch"):
        retries.failed("m", SEEN, "[Errno 17] File exists", reloading=True)
        retries.failed("m", SEEN, "[Errno 21] Is a directory", reloading=True)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nereid.watch"]
    assert said[0][0] == "WARNING" and "did not reload because of the store" in said[0][1]
    assert said[1][0] == "WARNING" and "failed it again, for another reason" in said[1][1]


def test_a_folder_changed_or_gone_since_its_failure_is_a_new_start() -> None:
    retries = StoreRetries(poll_s=1)
    for name in ("same", "edited", "gone"):
        retries.failed(name, SEEN, "x", reloading=False)
    retries.forget_changed({"same": SEEN, "edited": EDITED})
    assert ("same" in retries, "edited" in retries, "gone" in retries) == (True, False, False)
    assert retries.forget("same").failures == 1 and retries.forget("same") is None
