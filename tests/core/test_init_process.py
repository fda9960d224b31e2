"""nereid's own init: ``nereid serve`` as PID 1 of a PID namespace (a container's entrypoint) reaps the orphans.

Real ``unshare --pid`` namespaces, a real ``nereid serve`` and a real cpp model, looked at from outside
through /proc (every process of the namespace descends from its PID 1).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as triton

from nereid.init_process import exit_status
from support import NEREID, free_port, server_ready, wait_until
from toy_backends import install_plugin

# Doubles its float32 input; first forks a helper that it never waits for, as plenty of real programs do: the
# helper outlives the run, and its parent's end hands it to the namespace's PID 1.
FORKING_MAIN = r'''
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(void) {
    if (fork() == 0) { usleep(100000); _exit(0); }
    static float values[1 << 16];
    size_t n = fread(values, sizeof(float), sizeof(values) / sizeof(float), stdin);
    for (size_t i = 0; i < n; i++) values[i] *= 2.0f;
    FILE* out = fopen(getenv("NEREID_OUTPUT_PATH"), "wb");
    fprintf(out, "float32 %s\n", getenv("NEREID_INPUT_SHAPE"));
    fwrite(values, sizeof(float), n, out);
    return fclose(out) == 0 ? 0 : 3;
}
'''

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _namespaces_allowed() -> str | None:
    """Why this machine cannot run a process as PID 1 of a new PID namespace; None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare --pid is not permitted here: {probe.stderr.strip()}"


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (zombies included), from /proc; none once it is gone."""
    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += map(int, f.read().split())
    except OSError:
        pass
    return children


def _state(pid: int) -> str:
    """The state letter of ``pid`` (Z: a zombie), from /proc; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _zombies_below(root: int) -> list[int]:
    """The zombies among the descendants of ``root`` (host pids): in a namespace whose PID 1 is ``root``, all of
    its processes."""
    zombies, todo = [], _children(root)
    while todo:
        pid = todo.pop()
        if _state(pid) == "Z":
            zombies.append(pid)
        todo += _children(pid)
    return zombies


def _namespace_pid_1(unshare: subprocess.Popen) -> int:
    """The host pid of the process ``unshare`` started as its namespace's PID 1."""
    children = wait_until(lambda: _children(unshare.pid), 10)
    assert children, "unshare started no process"
    with open(f"/proc/{children[0]}/status") as f:
        assert [line.split()[-1] for line in f if line.startswith("NSpid:")] == ["1"]
    return children[0]


@pytest.fixture
def as_pid_1():
    """Skips the test where no PID namespace can be made."""
    if (reason := _namespaces_allowed()) is not None:
        pytest.skip(reason)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
def test_serve_as_pid_1_reaps_the_orphans_of_its_runs_and_exits_zero_on_sigterm(repo, as_pid_1) -> None:
    """Found by a deployment hunt: as a container's entrypoint (PID 1, no --init), nereid serve adopted every
    orphan of its runs and never reaped them: one zombie per request, until the pids limit made every run fail."""
    repo.add("forks", "input_shape: [8]\noutput_shape: [8]\nmax_batch_size: 4\n", main_cpp=FORKING_MAIN)
    port = free_port()
    unshare = subprocess.Popen([*UNSHARE, *NEREID, "serve", "--config", str(repo.write_config()),
                                "--bind", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        pid_1 = _namespace_pid_1(unshare)
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        ready = wait_until(lambda: unshare.poll() is not None or server_ready(client), 60)
        assert ready and unshare.poll() is None, f"server did not become ready: {unshare.stdout.read()[-2000:]}"
        rows = np.arange(8, dtype=np.float32).reshape(1, 8)
        tensor = triton.InferInput("input", [1, 8], "FP32")
        tensor.set_data_from_numpy(rows)
        for _ in range(5):
            assert client.infer("forks", [tensor]).as_numpy("output").tolist() == (rows * 2).tolist()
        client.close()
        # Each helper ends 0.1 s after its run: all of them have by now, and none may stay a zombie.
        time.sleep(0.3)
        assert wait_until(lambda: not _zombies_below(pid_1), 3), f"zombies in the namespace: {_zombies_below(pid_1)}"
        os.kill(pid_1, signal.SIGTERM)  # as docker stop does: to PID 1, which has the server drain and stop
        assert unshare.wait(30) == 0
        output = unshare.stdout.read()
        assert "running under nereid's own init (PID 1)" in output and "nereid stopped" in output
    finally:
        if unshare.poll() is None:
            unshare.kill()  # (--kill-child: the namespace's PID 1 goes with it, and everything in it)
            unshare.wait()


@pytest.mark.parametrize("no_init", ["", "1"])
def test_the_init_exits_with_the_servers_status_and_nereid_no_init_leaves_serve_pid_1(repo, as_pid_1,
                                                                                     no_init) -> None:
    """A server killed under the init (the out-of-memory killer) ends the container with its status, 128 + the
    signal, as a shell or tini reports it; with NEREID_NO_INIT=1 (an init already there) serve is PID 1 itself."""
    port = free_port()
    unshare = subprocess.Popen([*UNSHARE, *NEREID, "serve", "--config", str(repo.write_config()),
                                "--bind", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "NEREID_NO_INIT": no_init})
    try:
        pid_1 = _namespace_pid_1(unshare)
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        ready = wait_until(lambda: unshare.poll() is not None or server_ready(client), 60)
        assert ready and unshare.poll() is None, f"server did not become ready: {unshare.stdout.read()[-2000:]}"
        client.close()
        if no_init:
            assert _children(pid_1) == []  # (no model: the server itself has no child)
            os.kill(pid_1, signal.SIGTERM)
            assert unshare.wait(30) == 0
            assert "nereid's own init" not in unshare.stdout.read()
        else:
            [server] = _children(pid_1)
            os.kill(server, signal.SIGKILL)
            assert unshare.wait(30) == 128 + signal.SIGKILL
    finally:
        if unshare.poll() is None:
            unshare.kill()
            unshare.wait()


def test_a_stop_during_a_check_s_imports_ends_it_as_pid_1_too(repo, tmp_path, as_pid_1) -> None:
    """Defect (the hunt of the console script's fix): a SIGTERM recorded while `nereid check` imported was raised
    again once it had read its command line; as PID 1, whose signals the kernel gives no default action, that was
    ignored, and the check ran to its end with 0. It exits 143 now, as the signal would have ended it."""
    repo.python("echo")
    site, began = tmp_path / "site", tmp_path / "import.began"
    install_plugin(site, "slow-import", "slow_import", "slow_import_plugin",
                   f"import pathlib, time\npathlib.Path({str(began)!r}).touch()\ntime.sleep(0.5)\n")
    unshare = subprocess.Popen([*UNSHARE, sys.executable, "-c", "import sys\nfrom nereid.entry import main\n"
                                "sys.exit(main())", "check", "--config", str(repo.write_config())],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                                   str(site), os.environ.get("PYTHONPATH")))), "NEREID_NO_INIT": "1"})
    try:
        pid_1 = _namespace_pid_1(unshare)
        assert wait_until(lambda: began.exists() or unshare.poll() is not None, 60) and unshare.poll() is None
        os.kill(pid_1, signal.SIGTERM)
        assert unshare.wait(60) == 128 + signal.SIGTERM, unshare.stdout.read()[-2000:]
        assert "echo" not in unshare.stdout.read()  # (the check's report of the model: it never ran)
    finally:
        if unshare.poll() is None:
            unshare.kill()
            unshare.wait()


def test_exit_status_is_the_code_or_128_plus_the_signal() -> None:
    assert exit_status(0) == 0
    assert exit_status(3 << 8) == 3
    assert exit_status(signal.SIGKILL) == 128 + signal.SIGKILL
