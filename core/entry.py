"""The ``nereid`` console script's entry point: stop signals are recorded from its first instant.

``nereid`` imports for half a second or more (the command line's modules, numpy, the plugins) before it reads its
command line. A stop signal in that time ended it with 143, no line said, and a container's PID 1, which the
kernel gives no default action, dropped it: the server started and served on until the orchestrator's SIGKILL
(the operator hunt). Here, before anything of the server is imported, the stop signals are recorded instead (see
:func:`nereid.processes.record_early_stops`): ``nereid serve`` then ends before it starts, with its line; any other
command gets the signal back, as its default, once it has read its command line.
"""

from __future__ import annotations

from nereid.processes import record_early_stops, stop_signals


def main() -> int:
    """Run the ``nereid`` command (see :func:`nereid.cli.main`), its stop signals recorded until it has started."""
    record_early_stops(stop_signals())
    open_closed_standard_streams()
    from nereid.cli import main as run_command  # (the half second)

    return run_command()


def open_closed_standard_streams() -> None:
    """Open /dev/null as each of descriptors 0, 1 and 2 that is closed (a daemon's guard).

    Started with them closed (``nereid serve <&- >&- 2>&-``, by a supervisor
    that closes them), the first descriptors the server opened took their
    numbers: asyncio's self-pipe became 1 and 2, so what any native library
    wrote to stderr was read as signal numbers (byte 15 stopped the server),
    and the log's stderr handler wrote into the loop's epoll descriptor (the
    deployment hunt).
    """
    import os

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            # Opened at the lowest free number, which is fd itself: the ones below it are open by now.
            os.open(os.devnull, os.O_RDWR)
