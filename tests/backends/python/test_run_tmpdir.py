"""A run's TMPDIR: short enough for the AF_UNIX sockets multiprocessing makes in it (real servers, real forks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from support import textproto_single

REPORT = textproto_single("BYTES", input_shape="[1]", output_shape="[1]", max_batch_size=8)

# A forkserver Pool (Python 3.14's default start method on Linux) and a Manager: each listens on an AF_UNIX socket
# in TMPDIR (pymp-XXXXXXXX/listener-XXXXXXXX), whose path may be at most 107 bytes. Answers the squares the pool
# computed, the manager's list, and the run's TMPDIR.
FORKSERVER_MAIN = '''
import json, multiprocessing, os, sys

def square(value):
    return value * value

if __name__ == "__main__":
    sys.stdin.buffer.read()
    with multiprocessing.get_context("forkserver").Pool(2) as pool:
        squares = pool.map(square, [1, 2, 3])
    with multiprocessing.Manager() as manager:
        shared = manager.list([4, 5])
        listed = list(shared)
    answer = json.dumps([squares, listed, os.environ["TMPDIR"]]).encode()
    with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
        out.write(b"bytes 1,1\\n" + len(answer).to_bytes(4, "little") + answer)
'''

# As long as a model folder's name gets in practice: it used to be part of every run's TMPDIR.
LONG_NAME = "a_model_whose_name_is_forty_characters_x"


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_forkserver_pool_and_a_manager_work_in_a_model_with_a_long_name(repo, serve, no_zombies, warm):
    """Defect: a run's TMPDIR was <TMPDIR>/nereid-<pid>-<8>/<model name>/run-<32 hex>, so in a model whose name
    was longer than 12 characters (the README's python_rowsum) every forkserver Pool failed (OSError: AF_UNIX path
    too long) and every multiprocessing.Manager() too (EOFError), warm and cold; `python main.py` worked."""
    assert len(LONG_NAME) == 40
    repo.python_warm_start = warm
    repo.python(LONG_NAME, textproto=REPORT, main=FORKSERVER_MAIN)
    server = serve(repo.write_config(f"- name: {LONG_NAME}\n  timeout_s: 60\n"))
    tensor = triton.InferInput("input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    for _ in range(2):  # (a warm parent's second child too)
        squares, listed, tmpdir = json.loads(server.client.infer(LONG_NAME, [tensor]).as_numpy("output")[0, 0])
        assert (squares, listed) == ([1, 4, 9], [4, 5])
        # Independent of the name: in the server's scratch folder, 40 bytes at most past the server's TMPDIR.
        assert LONG_NAME not in tmpdir and tmpdir.startswith(f"{server.server.scratch_dir}{os.sep}"), tmpdir
        assert len(os.fsencode(tmpdir)) <= len(os.fsencode(str(server.server.scratch_dir.parent))) + 41, tmpdir


# Mounts a tmpfs in its TMPDIR (the run is root of a user namespace of its own: see below), which no removal of
# the run's folder gets past until it is unmounted, and echoes its input.
MOUNTING_MAIN = '''
import os, subprocess, sys
data = sys.stdin.buffer.read()
mounted = os.path.join(os.environ["TMPDIR"], "mounted")
os.mkdir(mounted)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", mounted], check=True)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode() + data)
'''

# Loads the model of the folder argv[1] (scratch folder argv[2]), runs it once, and prints whether its run's folder
# is there after the run, and, once the tmpfs is unmounted, after the unload.
_RUN_AND_UNLOAD = """
import subprocess, sys
from pathlib import Path
import numpy as np
from nereid.backend import ModelContext
from nereid.backends.python.plugin import PythonModel
from nereid.dtypes import DType
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor
folder, scratch = Path(sys.argv[1]), Path(sys.argv[2])
model = PythonModel(ModelContext("mounting", folder, ModelSettings("mounting"), scratch, "test"))
model.load()
model.infer([NamedTensor("input", DType.FP32, np.zeros((1, 4), dtype=np.float32))])
[mounted] = [line.split()[1] for line in open("/proc/self/mounts") if line.split()[1].startswith(str(scratch))]
run_folder = Path(mounted).parent
print(run_folder.exists())
subprocess.run(["umount", mounted], check=True)
model.unload()
print(run_folder.exists())
"""


def test_a_run_folder_that_could_not_be_removed_after_its_run_is_removed_at_unload(repo, tmp_path):
    """The folder of a run that could not be removed whole after the run (a process it detached still using
    it; here a mount point) went with the model's scratch folder, which held it; in the folder the runs of every
    model share, it is tried again as the version is unloaded, which comes before that."""
    folder = repo.python("mounting", main=MOUNTING_MAIN)
    scratch = (tmp_path / "scratch").resolve()
    scratch.mkdir()
    namespace = ["unshare", "-rm"]
    probe = subprocess.run([*namespace, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot make a user and mount namespace here: {probe and probe.stderr.strip()}")
    child = subprocess.run([*namespace, sys.executable, "-c", _RUN_AND_UNLOAD, str(folder), str(scratch)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["True", "False"], child.stdout


# An installed module that, as it is imported, listens on an AF_UNIX socket where multiprocessing makes its own
# (TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX), and keeps what that gave: a warm parent imports it once, its runs see it.
LISTENING_MODULE = '''
import os, socket, tempfile
folder = tempfile.mkdtemp(prefix="pymp-")
listener = socket.socket(socket.AF_UNIX)
try:
    listener.bind(os.path.join(folder, "listener-abcdefgh"))
    BOUND = "bound"
except OSError as err:
    BOUND = str(err)
finally:
    listener.close()
'''

LISTENING_MAIN = '''
import json, os, sys
import listening
sys.stdin.buffer.read()
answer = json.dumps([listening.BOUND, listening.__name__ in sys.modules]).encode()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(b"bytes 1,1\\n" + len(answer).to_bytes(4, "little") + answer)
'''


def test_a_preloaded_import_listening_on_a_socket_in_tmpdir_works_in_a_model_with_a_long_name(repo, tmp_path,
                                                                                            monkeypatch, no_zombies):
    """Defect: a warm parent's TMPDIR was <TMPDIR>/nereid-<pid>-<8>/<model name>/warm-parent-<8>/tmp, so a module
    preloaded by a model named 13 characters or more that listened on a socket there as it was imported (as
    multiprocessing's Manager() or forkserver do) failed: AF_UNIX path too long. The parent's folder is named as a
    run's now, beside theirs."""
    import tempfile

    from nereid.backend import ModelContext
    from nereid.backends.python.plugin import PythonModel
    from nereid.dtypes import DType
    from nereid.settings import ModelSettings
    from nereid.tensors import NamedTensor

    installed = tmp_path / "site"  # (an installed module: the folder's own are imported by each run)
    installed.mkdir()
    (installed / "listening.py").write_text(LISTENING_MODULE)
    monkeypatch.syspath_prepend(str(installed))  # (the load's look at main.py's imports)
    folder = repo.python(LONG_NAME, textproto=REPORT, main=LISTENING_MAIN)
    scratch = Path(tempfile.mkdtemp(prefix="nereid-0-"))  # (as short as a server's scratch folder in /tmp)
    (scratch / LONG_NAME).mkdir()  # (the model's own, which the server makes)
    try:
        context = ModelContext(LONG_NAME, folder, ModelSettings(LONG_NAME, runtime={"warm_start": True}),
                               scratch / LONG_NAME, "test", runs_dir=scratch / ".r")
        model = PythonModel(context)
        base_environment = model.base_environment
        model.base_environment = lambda: {**base_environment(), "PYTHONPATH": str(installed)}  # (the parent's path)
        model.load()
        try:
            assert model.runtime_report().summary == "warm_start=on"
            [output] = model.infer([NamedTensor("input", DType.BYTES, np.array([[b"x"]], dtype=object))])
            assert json.loads(output.data[0, 0]) == ["bound", True]
            parents = [path for path in (scratch / ".r").iterdir() if (path / "log").exists()]
            assert len(parents) == 1 and LONG_NAME not in str(parents[0])
        finally:
            model.unload()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
