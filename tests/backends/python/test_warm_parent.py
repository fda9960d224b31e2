"""The warm parent on its own: its run handling in process (what it does when no child can be forked), and its
preload in an interpreter of its own (the CUDA check)."""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import subprocess
import sys

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
        assert answer == {"error": "no child could be forked for the run: [Errno 11] Resource temporarily unavailable",
                          "errno": errno.EAGAIN, "strerror": "Resource temporarily unavailable"}  # (told apart)
    finally:
        for fd in (stdin_read, stdin_write, output_read, output_write):
            os.close(fd)
        for sock in (control, server_side, reply, reply_for_parent):
            sock.close()


def test_a_spare_that_cannot_be_forked_is_said_once_while_the_reason_lasts(monkeypatch, capsys):
    """Found by a leak hunt (from the code): under a process limit that lasts, every run added one line to the
    warm parent's log, which grew without end."""
    reason = [errno.EAGAIN]

    def no_fork() -> int:
        raise OSError(reason[0], os.strerror(reason[0]))

    monkeypatch.setattr(warm_parent.os, "fork", no_fork)
    runs = warm_parent.Runs(select.poll(), set())
    for _ in range(5):
        runs.try_fork_spare()
    assert capsys.readouterr().err.count("cannot fork a spare child now") == 1
    reason[0] = errno.ENOMEM  # another reason is said again
    runs.try_fork_spare()
    runs.try_fork_spare()
    assert capsys.readouterr().err.count("Cannot allocate memory") == 1


# Preloads, in one warm-parent interpreter, each list of modules in argv[2] (JSON) in turn; prints, for each, what
# preload() answered (as extra preloads) and whether a libcuda was mapped into the process after it.
PRELOAD_IN_TURN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("warm_parent", sys.argv[1])
warm_parent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(warm_parent)
answers = []
for modules in json.loads(sys.argv[2]):
    reason = warm_parent.preload([], modules)
    with open("/proc/self/maps") as maps:
        answers.append([reason, "libcuda.so" in maps.read()])
print(json.dumps(answers))
"""


def test_preloading_that_initialises_cuda_is_refused_naming_the_module(tmp_path, fake_libcuda):
    """Defect: a preloaded module that initialised CUDA (torch.cuda.init() at import) left the warm parent with an
    initialised driver, and every forked child that used CUDA failed; only Python threads were checked."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "loads_cuda.py").write_text("import ctypes\ndriver = ctypes.CDLL('libcuda.so.1')\n")
    (site / "inits_cuda.py").write_text("from loads_cuda import driver\nassert driver.cuInit(0) == 0\n")
    # The fake driver is where a dlopen("libcuda.so.1") would find it: the check must not load it itself.
    env = {**os.environ, "PYTHONPATH": str(site), "LD_LIBRARY_PATH": str(fake_libcuda.parent)}
    done = subprocess.run([sys.executable, "-c", PRELOAD_IN_TURN, warm_parent.__file__,
                           json.dumps([["json"], ["loads_cuda"], ["decimal", "inits_cuda"]])],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        [None, False],  # no driver loaded: none asked, none loaded
        [None, True],  # loaded, never initialised: forking is fine
        ["fallback preloading 'inits_cuda' initialised CUDA, which a forked child cannot use; initialise CUDA in the "
         "code that runs per batch (main.py's body or a function it calls), not at import", True],
    ]


LAZY_PRELOAD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("warm_parent", sys.argv[1])
warm_parent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(warm_parent)
print(json.dumps([warm_parent.preload(["lazy"], [], [name]) for name in sys.argv[2:]]))
"""


def test_a_lazy_package_s_getattr_asked_for_a_from_import_is_checked_as_an_import(tmp_path, fake_libcuda):
    """Asking whether `from lazy import Model` takes a submodule runs the package's __getattr__ (lazy packages import
    there): one that initialised CUDA left warm start on, and one that raised ended the warm parent."""
    site = tmp_path / "site"
    (site / "lazy").mkdir(parents=True)
    (site / "lazy" / "__init__.py").write_text(
        "def __getattr__(name):\n"
        "    if name == 'Model':\n"
        "        import ctypes\n"
        "        assert ctypes.CDLL('libcuda.so.1').cuInit(0) == 0\n"
        "        return object\n"
        "    if name == 'Broken':\n"
        "        raise RuntimeError('the lazy import failed')\n"
        "    raise AttributeError(name)\n")
    env = {**os.environ, "PYTHONPATH": str(site), "LD_LIBRARY_PATH": str(fake_libcuda.parent)}
    for name, answer in (
            ("lazy.Broken", "fallback preloading 'lazy.Broken' failed (RuntimeError: the lazy import failed)"),
            ("lazy.Model", "fallback preloading 'lazy.Model' initialised CUDA, which a forked child cannot use; "
                           "initialise CUDA in the code that runs per batch (main.py's body or a function it calls), "
                           "not at import")):
        done = subprocess.run([sys.executable, "-c", LAZY_PRELOAD, warm_parent.__file__, name], env=env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [answer]


# Preloads, in one warm-parent interpreter, each list of modules in argv[2] (JSON) in turn: what preload() answered
# (as extra preloads) for each.
PRELOAD_ANSWERS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("warm_parent", sys.argv[1])
warm_parent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(warm_parent)
print(json.dumps([warm_parent.preload([], modules) for modules in json.loads(sys.argv[2])]))
"""


def preload_answers(site, *module_lists: list[str]) -> list:
    done = subprocess.run([sys.executable, "-c", PRELOAD_ANSWERS, warm_parent.__file__, json.dumps(module_lists)],
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_threads_a_preload_started_are_said_with_the_imports_that_started_them(tmp_path):
    """Found by a bug hunt: a joblib Parallel at import gave `preloading started threads (ExecutorManagerThread,
    QueueFeederThread)`, naming neither the module nor the library; nor did it say what to do."""
    starts = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name={!r}, daemon=True).start()\n"
    (tmp_path / "busy.py").write_text(starts.format("busy"))
    (tmp_path / "also_busy.py").write_text(starts.format("more"))
    (tmp_path / "briefly.py").write_text("import threading\nt = threading.Thread(target=int)\nt.start()\nt.join()\n")
    advice = ("forking a threaded process is unsafe; start them in the code that runs per batch (main.py's body or a "
              "function it calls), not at import")
    assert preload_answers(tmp_path, ["json", "busy", "decimal"]) == [
        f"fallback preloading 'busy' started threads (busy); {advice}"]
    assert preload_answers(tmp_path, ["briefly", "busy", "csv", "also_busy"]) == [
        f"fallback preloading 'busy', 'also_busy' started threads (busy, more); {advice}"]


def test_the_openmp_probe_refuses_a_pool_that_a_fork_leaves_hanging_only(tmp_path):
    """Defect (found by a bug hunt): a preload whose warm-up started GNU OpenMP's pool left every forked run that
    entered a parallel region hanging. libgomp loaded, or a region run on one thread (no pool started), is fine."""
    region = ("import ctypes\nctypes.CDLL('libgomp.so.1').GOMP_parallel(ctypes.cast(ctypes.CDLL(None).free, "
              "ctypes.c_void_p), None, {threads}, 0)\n")
    (tmp_path / "loads.py").write_text("import ctypes\nctypes.CDLL('libgomp.so.1')\n")
    (tmp_path / "one_thread.py").write_text(region.format(threads=1))
    (tmp_path / "two_threads.py").write_text(region.format(threads=2))
    answers = preload_answers(tmp_path, ["json"], ["loads"], ["one_thread"], ["two_threads"])
    assert answers[:3] == [None, None, None]
    assert answers[3].startswith("fallback preloading started an OpenMP thread pool (/"), answers[3]
    assert "libgomp" in answers[3] and answers[3].endswith(", not at import"), answers[3]


def test_a_module_file_of_any_kind_in_the_folder_hides_the_parent_s_module_of_its_name(tmp_path) -> None:
    """As `python main.py` finds the folder's module first, whatever its kind: a compiled extension and a .pyc
    (found by a bug hunt: only .py files and packages counted, so the child kept the parent's module)."""
    import importlib.machinery
    import types

    extension = importlib.machinery.EXTENSION_SUFFIXES[0]
    names = {"nereid_test_ext": f"nereid_test_ext{extension}", "nereid_test_pyc": "nereid_test_pyc.pyc",
             "nereid_test_src": "nereid_test_src.py", "nereid_test_kept": None}
    for name, file in names.items():
        sys.modules[name] = types.ModuleType(name)
        if file is not None:
            (tmp_path / file).write_bytes(b"")
    try:
        warm_parent._unshadow(str(tmp_path))
        assert [name for name in names if name in sys.modules] == ["nereid_test_kept"]
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_the_longest_run_request_is_what_one_message_of_the_control_socket_takes_here() -> None:
    """The bound a python model's tensor names are checked against at load (see PythonModel._check_run_request)
    is the real one: a request of that many bytes, with a run's descriptors, goes to the parent in one message, one
    byte more does not; and it is no more than the parent reads of a request."""
    import pytest

    from nereid.backends.python.warm import PARENT_MAX_REQUEST_BYTES, max_request_bytes, run_request

    assert PARENT_MAX_REQUEST_BYTES == warm_parent.MAX_REQUEST_BYTES
    limit, bound = max_request_bytes()
    assert limit <= warm_parent.MAX_REQUEST_BYTES and bound
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read, write = os.pipe()
    try:
        base = len(run_request({"X": ""}, "/", None))
        fits = run_request({"X": "x" * (limit - base)}, "/", None)
        assert len(fits) == limit
        socket.send_fds(ours, [fits], [read, write, theirs.fileno()])
        message, fds, _, _ = socket.recv_fds(theirs, warm_parent.MAX_REQUEST_BYTES, 4)
        for fd in fds:
            os.close(fd)
        assert message == fits and json.loads(message)["cwd"] == "/"
        too_long = run_request({"X": "x" * (limit - base + 1)}, "/", None)
        if limit < warm_parent.MAX_REQUEST_BYTES:  # bound by the socket: refused by the kernel
            with pytest.raises(OSError) as refused:
                socket.send_fds(ours, [too_long], [read, write, theirs.fileno()])
            assert refused.value.errno == errno.EMSGSIZE
    finally:
        for fd in (read, write):
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_child_that_cannot_enter_the_folder_says_so_in_the_form_the_server_reads() -> None:
    """The run's child reports a folder it cannot enter (its mode changed while the model serves) by an exit status
    and a last line of output that the server's side reads back as that refusal, errno and all; the two programs'
    constants are equal, and a model's own output that merely ends otherwise is no such report."""
    from nereid.backends.python import warm
    from nereid.backends.subprocess.runner import FolderNotEntered

    assert (warm.FOLDER_NOT_ENTERED_EXIT, warm.FOLDER_NOT_ENTERED_LINE) == \
        (warm_parent.FOLDER_NOT_ENTERED_EXIT, warm_parent.FOLDER_NOT_ENTERED_LINE)
    child = subprocess.run([sys.executable, "-c", "import errno, os, sys\nfrom nereid.backends.python import "
                            "warm_parent\nprint('a banner an at-fork handler printed', flush=True)\n"
                            "sys.exit(warm_parent.report_folder_not_entered(PermissionError(errno.EACCES, "
                            "os.strerror(errno.EACCES))))"], capture_output=True, text=True)
    assert child.returncode == warm.FOLDER_NOT_ENTERED_EXIT, child.stderr
    refused = warm.folder_not_entered(f"{child.stdout}{child.stderr}".strip())
    assert isinstance(refused, FolderNotEntered)
    assert isinstance(refused.error, PermissionError)
    assert (refused.error.errno, refused.error.strerror) == (errno.EACCES, "Permission denied")
    assert warm.folder_not_entered("Traceback (most recent call last):\nPermissionError: denied") is None
    assert warm.folder_not_entered(f"{warm.FOLDER_NOT_ENTERED_LINE}x y") is None


SPARE_WITHOUT_GO = '''
import json, os, socket, sys
from nereid.backends.python import warm_parent

folder = sys.argv[1]
warm_parent.compile_entry(os.path.join(folder, "main.py"), os.path.join(folder, "main.py"))
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
pid = os.fork()
if pid == 0:
    ours.close()
    warm_parent.run_spare(theirs, set(), os.getppid())
theirs.close()
stdin_read, stdin_write = os.pipe()
os.close(stdin_write)
output = os.open(os.path.join(folder, "output"), os.O_WRONLY | os.O_CREAT, 0o600)
request = {"env": {"PATH": "/usr/bin:/bin", "NEREID_OUTPUT_PATH": os.path.join(folder, "out")}, "cwd": folder}
socket.send_fds(ours, [json.dumps(request).encode()], [stdin_read, output])
ours.close()  # (the parent dies here, as it were: no go)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), os.path.exists(os.path.join(folder, "ran")))
'''


def test_a_spare_handed_a_run_without_the_go_ends_without_running_it(tmp_path) -> None:
    """Found by a full-suite run under load: a warm parent killed after it handed a run to its spare but before
    it told the server the run had started left the child running the batch, which the server, never told, sent
    again to the next parent: the batch ran twice. The spare now runs it only once the parent says go, which it
    says once the server knows."""
    (tmp_path / "main.py").write_text("open('ran', 'w').write('1')\n")
    done = subprocess.run([sys.executable, "-c", SPARE_WITHOUT_GO, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["0", "False"], (done.stdout, done.stderr[-2000:])


def test_a_parent_that_cannot_be_restarted_at_a_server_limit_fails_its_batch_unavailable() -> None:
    """The review hunt of 2aabc24: a warm parent that could not be restarted at a process limit (EAGAIN) failed
    its batch INTERNAL, a model's fault counted as a batch, where a run's child not forked is UNAVAILABLE."""
    from nereid.backends.python.warm import WarmParent, WarmParentBlocked
    from nereid.errors import ModelFailure, RunNotStarted

    parent = object.__new__(WarmParent)  # (only what the failure reads: its name, and its blocked state)
    parent.name, parent.warm, parent.cold_reason, parent._blocked = "m", True, None, None
    limited = parent._blocked_failure(WarmParentBlocked(
        "Resource temporarily unavailable",
        cause=OSError(errno.EAGAIN, "Resource temporarily unavailable")))
    assert isinstance(limited, RunNotStarted) and str(limited).startswith(
        "model 'm': the server could not start a run (EAGAIN: Resource temporarily unavailable")
    other = parent._blocked_failure(WarmParentBlocked("cannot prepare its folder /x: read-only file system"))
    assert type(other) is ModelFailure


def test_the_fast_local_instructions_of_later_pythons_are_read_as_3_11_s() -> None:
    """The 3.12/3.13 hunt: an exit function holding os.remove in a local was not recognised as removing files on
    3.12 (LOAD_FAST_CHECK, for a local that may be unbound) nor on 3.13 (LOAD_FAST_LOAD_FAST ('rm', 'p'), two
    loads in one instruction), so a preloaded library's exit removed files at the first warm run's end. Those
    instructions are made here from 3.11's, as the later versions emit them."""
    import dis

    def remove_later(rm, p):
        rm(p)

    loads = [i for i in dis.get_instructions(remove_later.__code__) if i.opname == "LOAD_FAST"]
    first, second = loads[:2]
    later = [first._replace(opname="LOAD_FAST_LOAD_FAST", argval=("rm", "p")),
             second._replace(opname="LOAD_FAST_CHECK"), second._replace(opname="LOAD_FAST_AND_CLEAR"),
             first._replace(opname="STORE_FAST_LOAD_FAST", argval=("x", "rm")),
             first._replace(opname="STORE_FAST_STORE_FAST", argval=("x", "y"))]
    plain = [(i.opname, i.argval) for i in warm_parent._plain_instructions(later)]
    assert plain == [("LOAD_FAST", "rm"), ("LOAD_FAST", "p"), ("LOAD_FAST", "p"), ("LOAD_FAST", "p"),
                     ("STORE_FAST", "x"), ("LOAD_FAST", "rm"), ("STORE_FAST", "x"), ("STORE_FAST", "y")]
