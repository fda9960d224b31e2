"""Shared test support: toy model folders, real servers on free ports, error checks.

Servers run in the test process on their own asyncio loop thread and are reached
over real gRPC on 127.0.0.1 with tritonclient, exactly as a user would.
Import it as ``support`` (pyproject puts tests/ on the path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import textwrap
import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator

import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from nereid.cli import LEFT_TASKS_WAIT_S
from nereid.collector_pause import collector_paused
from nereid.server import NereidServer
from nereid.settings import load_settings


def echo_main(prelude: str = "") -> str:
    """A main.py that echoes its single input tensor, whatever its datatype and shape, after running ``prelude``
    (lines of Python, with os and sys imported)."""
    return f'''
import os, sys
{prelude}data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode())
    out.write(data)
'''


ECHO_MAIN = echo_main()
# A prelude of echo_main: the run appends a line to calls.txt, in the model folder, so a test counts the runs.
COUNT_THE_RUN = 'with open("calls.txt", "a") as calls:\n    calls.write("1\\n")\n'

# A main.py that copies its framed inputs to its outputs, one for one (multi-tensor form).
FRAMED_ECHO_MAIN = '''
import os, sys
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(data)
'''


def textproto_single(dtype: str = "FP32", input_shape: str = "[4]", output_shape: str | None = None,
                     max_batch_size: int = 8) -> str:
    """A single-tensor model_inference.textproto."""
    return (f'input_shape: {input_shape}\noutput_shape: {output_shape or input_shape}\n'
            f'max_batch_size: {max_batch_size}\ndata_type: "{dtype}"\n')


@contextlib.contextmanager
def reference_counting_only() -> Iterator[None]:
    """Run the body as a server runs between two garbage collections: Python's cyclic collector paused, so what
    only a collection frees stays; and nothing logged, since pytest's capture keeps every record, and with it an
    error's traceback and the frames under test."""
    logged = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with collector_paused():
            yield
    finally:
        logging.disable(logged)


class ModelRepo:
    """Writes model folders and a nereid.yaml into a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models_dir = root / "ml-backends"
        self.models_dir.mkdir()
        # False writes ``backends: {python: {warm_start: false}}``: every python model starts cold.
        self.python_warm_start = True

    def add(self, name: str, textproto: str | None, **files: str) -> Path:
        """A model folder with a textproto (None: none) and the given files (``main_py`` -> main.py)."""
        folder = self.models_dir / name
        folder.mkdir()
        if textproto is not None:
            (folder / "model_inference.textproto").write_text(textproto)
        for key, content in files.items():
            (folder / key.replace("_", ".", 1) if key in ("main_py", "main_cpp") else folder / key).write_text(
                textwrap.dedent(content))
        return folder

    def python(self, name: str, main: str = ECHO_MAIN, textproto: str | None = None) -> Path:
        """A python-backend model (an echo of one FP32 [4] tensor by default)."""
        return self.add(name, textproto if textproto is not None else textproto_single(), main_py=main)

    def write_config(self, models_yaml: str | None = None, server_extra: str = "",
                     metrics_addr: str = "127.0.0.1:0") -> Path:
        """Write nereid.yaml; ``models_yaml`` is the ``models:`` list body (None: no models key)."""
        text = (f"server:\n  bind_addr: \"127.0.0.1:0\"\n  ml_backends_path: \"ml-backends\"\n"
                f"  metrics_addr: \"{metrics_addr}\"\n  http_addr: \"127.0.0.1:0\"\n{server_extra}")
        if not self.python_warm_start:
            text += "backends:\n  python:\n    warm_start: false\n"
        if models_yaml is not None:
            text += "models:\n" + textwrap.indent(textwrap.dedent(models_yaml), "  ")
        path = self.root / "nereid.yaml"
        path.write_text(text)
        return path


class RunningServer:
    """A NereidServer on a background event loop, with a tritonclient connected to it."""

    def __init__(self, config: Path, **server_kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="nereid-test-loop", daemon=True)
        self._thread.start()
        settings = load_settings(config)

        async def create() -> NereidServer:
            return NereidServer(settings, **server_kwargs)

        self.server: NereidServer = self.call(create())
        port = self.call(self.server.start())
        self.call(self.server.load_models())
        self.url = f"127.0.0.1:{port}"
        self.client = triton.InferenceServerClient(self.url)

    def call(self, coroutine: Coroutine, timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.client.close()
        self.call(self.server.stop(grace_s=5))
        self.call(_left_tasks_end())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _left_tasks_end() -> None:
    """Cancel what still runs on the loop of a stopped server and give it LEFT_TASKS_WAIT_S to end, as `nereid
    serve`'s run_to_the_end does. A model's coroutine that swallowed its cancellation, which its test let go before
    this teardown, was left pending on a closed loop and destroyed later, in whichever test collected it: an ERROR
    ("Task was destroyed but it is pending!") that test counted (tests/core/test_watch_properties.py in CI)."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=LEFT_TASKS_WAIT_S)


def zombie_children() -> list[int]:
    """PIDs of this process's children that exited but were never reaped."""
    zombies = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(entry))
    return zombies


def expect_grpc_error(status: str, call: Callable[[], object], *fragments: str) -> str:
    """Run ``call``; it must fail with gRPC ``status`` (e.g. ``INVALID_ARGUMENT``) and a message
    containing every fragment. Returns the message."""
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == f"StatusCode.{status}", info.value
    message = info.value.message()
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# The nereid command, run as its own process.
NEREID = [sys.executable, "-m", "nereid.cli"]


# Ports handed to another process come from a band of this xdist worker's own, below Linux's ephemeral range
# (32768-60999). A port the kernel picked (bind to 0) is free only until the next pick: another worker's server
# once got the same one between the pick and the child's bind, and the test spoke to that server instead.
# A band for each worker and one for a run without xdist: 200 ports each up to 62 workers; more workers (three a
# core: 64 from 22 cores) share the span in narrower bands, where a band taken modulo 63 handed two workers one.
_PORT_BASE, _PORT_SPAN = 20000, 12600  # 20000-32599
_PORT_BAND = min(200, _PORT_SPAN // (int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) + 1))
_next_port_in_band = int.from_bytes(os.urandom(2), "little") % _PORT_BAND  # two runs at once start apart


def free_port() -> int:
    """A TCP port on 127.0.0.1, free a moment ago, that no other test worker of this run is handed."""
    global _next_port_in_band
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")
    band_start = _PORT_BASE + (int(worker.removeprefix("gw")) + 1) * _PORT_BAND
    for _ in range(_PORT_BAND):
        port = band_start + _next_port_in_band
        _next_port_in_band = (_next_port_in_band + 1) % _PORT_BAND
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held by another run, or a server of this worker's still closing
                continue
            return port
    raise RuntimeError(f"no free port in 127.0.0.1:{band_start}-{band_start + _PORT_BAND - 1}")


@contextlib.contextmanager
def nereid_serve(config: Path, *extra_args: str, ignore_sighup: bool = False, ignore_sigint: bool = False):
    """``nereid serve`` (with ``extra_args``) in its own process, ready; yields (process, client). Killed if still
    running. ``ignore_sighup`` starts it as ``nohup`` does (which execs it: the pid is the server's);
    ``ignore_sigint`` as a script's shell starts a job in the background (``nereid serve &``), SIGINT ignored."""
    port = free_port()
    starter = [*(["nohup"] if ignore_sighup else []),
               *(["sh", "-c", 'trap "" INT; exec "$@"', "sh"] if ignore_sigint else [])]
    process = subprocess.Popen([*starter, *NEREID, "serve", "--config", str(config), "--bind", f"127.0.0.1:{port}",
                                *extra_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        # A server that exits (a port another test took meanwhile) is told at once, with what it said.
        ready = wait_until(lambda: process.poll() is not None or server_ready(client), 30)
        assert ready and process.poll() is None, (f"server did not become ready (exit status {process.poll()}): "
                                                  f"{process.stdout.read()[-2000:] if process.poll() is not None else ''}")
        yield process, client
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def serve_until_listening(config: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``nereid serve --config CONFIG`` in its own process (stdout and stderr as one text pipe), read until its
    gRPC listener is up; (the process, its lines so far). The caller ends it."""
    process = subprocess.Popen([*NEREID, "serve", "--config", str(config)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "listening" in line:
            break
    return process, lines


def popen_with_ctrl_c(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen``, with SIGINT at its default in the child, as a command started from a terminal has it.

    A test run in the background (a shell's ``&``, as CI scripts and agents start pytest) inherits SIGINT
    ignored, and exec keeps an ignored signal ignored: `nereid check`, which leaves an ignored SIGINT alone (as
    `nereid check &` in a script asks), then never saw the test's Ctrl-C, and the test timed out. A signal this
    process handles is reset to its default by exec, so it is handled here for the moment of the spawn.
    """
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_as_non_root(command: list[str], writable_after: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``command`` (its output captured as text) as a server that is not root runs: from root, under setpriv
    without the capabilities that override permission bits (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER).
    Skips the test where setpriv is missing or cannot drop them. Afterwards every folder under
    ``writable_after`` is made writable again, so that pytest can remove what the command left."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's right to read and write any folder")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    finally:
        for folder, subfolders, _ in os.walk(writable_after):
            for name in subfolders:
                os.chmod(os.path.join(folder, name), 0o755)
    if "setpriv:" in done.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()}")
    return done


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (False when it is gone, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False


def server_ready(client: triton.InferenceServerClient) -> bool:
    """Whether the server ``client`` talks to answers ServerReady true (False while it cannot be reached)."""
    try:
        return client.is_server_ready()
    except Exception:  # not listening yet
        return False


def wait_until(condition: Callable[[], Any], timeout_s: float = 10) -> Any:
    """Poll ``condition`` (a test's way to wait for another process) until it is truthy; its value, or False."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return value


def fail_thread_starts(monkeypatch: pytest.MonkeyPatch, prefix: str, times: int = 1) -> list[str]:
    """Make the next ``times`` starts of a thread whose name begins with ``prefix`` raise what CPython raises at a
    process or thread limit (RLIMIT_NPROC, a cgroup's pids.max), every other start left alone; the names of the
    threads refused, as they are."""
    real_start = threading.Thread.start
    refused: list[str] = []
    lock = threading.Lock()

    def start(self: threading.Thread) -> None:
        with lock:
            refuse = len(refused) < times and self.name.startswith(prefix)
            if refuse:
                refused.append(self.name)
        if refuse:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refused


async def until(condition: Callable[[], object], timeout_s: float = 30.0, what: str = "") -> None:
    """In a test's event loop: poll ``condition`` until it is truthy; AssertionError after ``timeout_s`` (long: it
    costs only a test that fails, and a starved machine took past 5 s to load a model from a moto bucket)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not met within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def run_with_tmpdir_mounted_noexec(tmpdir: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` with TMPDIR on a fresh tmpfs mounted noexec at ``tmpdir``, as hardened containers mount /tmp."""
    return run_with_tmpdir_on_a_tmpfs(tmpdir, argv, "noexec,size=64m")


def run_with_tmpdir_on_a_tmpfs(tmpdir: Path, argv: list[str], options: str) -> subprocess.CompletedProcess:
    """Run ``argv`` with TMPDIR on a fresh tmpfs mounted at ``tmpdir`` with ``options`` ("size=1m").

    The mount is made in a user and mount namespace of the run's own (``unshare -rm``: no root needed, and
    nothing outside sees it); the test is skipped where this machine allows no such namespace.
    """
    tmpdir.mkdir()
    mount = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o {options} tmpfs "$0" && TMPDIR="$0" exec "$@"',
             str(tmpdir)]
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a namespace here: {probe and probe.stderr.strip()}")
    return subprocess.run([*mount, *argv], capture_output=True, text=True, timeout=120)


def private_names(repository, suffix: str) -> list[str]:
    """``suffix`` under real private folders of ``repository`` (ml_backends_path, the scratch folder, nereid's
    install folder): each rewritten by its path scrubbing, as checked here."""
    import nereid

    folders = (repository.root.resolve(), repository.scratch_dir, Path(nereid.__file__).resolve().parent)
    names = [f"{folder}{os.sep}{suffix}" for folder in folders]
    assert all(repository.public_text(name) != name for name in names)
    return names


def both_loopbacks(monkeypatch: pytest.MonkeyPatch, name: str = "loopbacks") -> None:
    """Make ``name`` resolve to ::1 and 127.0.0.1 (as localhost does on many hosts; here it may name one)."""
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host != name:
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def fake_gpu_machine(tmp_path: Path, gpus: int | None = None, wsl: bool = False) -> Path:
    """A /proc and /dev tree: the NVIDIA driver's folder with ``gpus`` GPUs (no folder for None), WSL's /dev/dxg."""
    root = tmp_path / "machine"
    (root / "proc").mkdir(parents=True)
    (root / "dev").mkdir()
    if gpus is not None:
        driver = root / "proc" / "driver" / "nvidia" / "gpus"
        driver.mkdir(parents=True)
        for bus in range(gpus):
            (driver / f"0000:{bus + 1:02x}:00.0").mkdir()
    if wsl:
        (root / "dev" / "dxg").write_text("")
    return root


def scrape(port: int, query: str = "") -> dict[tuple[str, tuple], float]:
    """The samples of the metrics endpoint on ``port``: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics{query}", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def unreadable_chunked_infer(port: int, model: str) -> bytes:
    """The whole answer to an HTTP infer of ``model`` whose chunked body the HTTP parser cannot read, sent in the
    same packet as its head (the listener answers it before the server's handler runs)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           "Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".encode())
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def zero_text_section(path: Path) -> int:
    """Overwrite the ``.text`` section of the 64-bit little-endian ELF file ``path`` with zeros, its headers left
    whole, as a torn write or bit-rot leaves a file: the same size, and still a whole ELF file. Returns how many
    bytes were zeroed."""
    import struct

    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)

    def section(index: int) -> tuple[int, int, int]:  # (sh_name, sh_offset, sh_size)
        name, = struct.unpack_from("<I", data, shoff + index * entry_size)
        offset, size = struct.unpack_from("<QQ", data, shoff + index * entry_size + 0x18)
        return name, offset, size
    names_offset = section(names_index)[1]
    for index in range(count):
        name, offset, size = section(index)
        if data[names_offset + name:].startswith(b".text\0"):
            data[offset:offset + size] = bytes(size)
            path.write_bytes(bytes(data))
            return size
    raise AssertionError(f"{path} has no .text section")


def made_deep(folder: Path, levels: int, leaf: str = "leaf.txt") -> None:
    """Folders ``a/a/.../a`` ``levels`` deep in ``folder``, the file ``leaf`` at the bottom: made a level at a time
    from the last, for a path this long is longer than one call takes."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("a", dir_fd=descriptor)
            inner = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
        os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=descriptor))
    finally:
        os.close(descriptor)


def removed_deep(folder: Path, levels: int, leaf: str = "leaf.txt") -> None:
    """Remove what :func:`made_deep` made in ``folder``, from the bottom up."""
    descriptors = [os.open(folder, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for _ in range(levels):
            descriptors.append(os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=descriptors[-1]))
        os.unlink(leaf, dir_fd=descriptors[-1])
        while len(descriptors) > 1:
            os.close(descriptors.pop())
            os.rmdir("a", dir_fd=descriptors[-1])
    finally:
        for descriptor in descriptors:
            os.close(descriptor)
