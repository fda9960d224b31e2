"""The warning when the process runs short of file descriptors (gRPC's own line is silenced)."""

from __future__ import annotations

import logging

from nereid.descriptor_watch import DescriptorWatch, descriptor_limit, open_descriptors


def test_a_crossing_of_the_threshold_is_said_once_each_way(caplog) -> None:
    """The hunt of GRPC_VERBOSITY=NONE: a gRPC port refusing every client for want of descriptors said nothing
    (gRPC's core was the only one to, and it is silenced)."""
    caplog.set_level(logging.INFO, logger="nereid.server")
    counts = iter([10, 95, 99, 50, 50])
    watch = DescriptorWatch(count=lambda: next(counts), limit=lambda: 100)
    for _ in range(5):
        watch.look()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert said[0][1].startswith("95 file descriptors open of the limit of 100: new connections (gRPC's, HTTP's) "
                                 "and model runs may be refused")
    assert said[1][1] == "file descriptors back to 50 of the limit of 100"


def test_it_reads_this_process_s_descriptors_and_limit_and_stops() -> None:
    assert 0 < open_descriptors() < descriptor_limit()
    watch = DescriptorWatch(look_every_s=0.01)
    watch.start()
    watch.stop()
    watch._thread.join(2)
    assert not watch._thread.is_alive() and not watch.short


def test_at_the_limit_the_count_is_the_limit_where_listing_them_fails(monkeypatch) -> None:
    """The hunt of the watch: a flood fills the table between two looks, and at the limit listing /proc/self/fd
    needs a descriptor of its own: EMFILE, which the look took for "nothing to watch", saying nothing."""
    import errno

    from nereid import descriptor_watch

    def full(path):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(descriptor_watch.os, "listdir", full)
    assert descriptor_watch.open_descriptors() == descriptor_limit()
    watch = DescriptorWatch()
    watch.look()
    assert watch.short
    monkeypatch.setattr(descriptor_watch.os, "listdir", lambda path: ["0", "1", "2"])
    assert descriptor_watch.open_descriptors() == 2  # (the listing's own left out)
