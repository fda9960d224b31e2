"""The warm parent's run handling on its own, in process: what it does when no child can be forked."""

from __future__ import annotations

import errno
import json
import os
import select
import socket

from nereid.backends.python import warm_parent


def test_a_run_whose_child_cannot_be_forked_fails_saying_why_and_the_parent_serves_on(monkeypatch, capsys):
    """A failed fork (a process limit, no memory) ended the parent with exit 1, and with it every run in
    progress, while the reason was logged nowhere."""
    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(warm_parent.os, "fork", no_fork)
    runs = warm_parent.Runs(select.poll(), set())
    runs.try_fork_spare()  # the spare ahead: left for later
    assert runs.spare is None and "cannot fork a spare child now" in capsys.readouterr().err
    control, server_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reply, reply_for_parent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stdin_read, stdin_write = os.pipe()
    output_read, output_write = os.pipe()
    try:
        socket.send_fds(server_side, [json.dumps({"env": {}, "cwd": "/"}).encode()],
                        [stdin_read, output_write, reply_for_parent.fileno()])
        assert runs.start(control) is True  # it serves on
        answer = json.loads(reply.recv(4096))
        assert answer == {"error": "no child could be forked for the run: [Errno 11] Resource temporarily unavailable"}
    finally:
        for fd in (stdin_read, stdin_write, output_read, output_write):
            os.close(fd)
        for sock in (control, server_side, reply, reply_for_parent):
            sock.close()
