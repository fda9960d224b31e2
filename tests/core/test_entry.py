"""The ``nereid`` command's entry point: ``python -m nereid``, and standard streams it was started without."""

from __future__ import annotations

import json
import subprocess
import sys

# Closes descriptors 0, 1 and 2, runs the guard, opens a file, and writes where each of 0-3 leads (to argv[1]).
_STARTED_WITHOUT_STREAMS = """
import json, os, sys
result = sys.argv[1]
for fd in (0, 1, 2):
    os.close(fd)
from nereid.entry import open_closed_standard_streams
open_closed_standard_streams()
opened = os.open(result, os.O_WRONLY | os.O_CREAT)
os.write(opened, json.dumps([os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)] + [opened]).encode())
"""


def test_descriptors_0_1_and_2_started_closed_are_dev_null_before_the_server_opens_any(tmp_path) -> None:
    """Found by the deployment hunt: started with them closed, asyncio's self-pipe took descriptors 1 and 2, so
    bytes a native library wrote to stderr were read as signals (15 stopped the server)."""
    result = tmp_path / "fds.json"
    child = subprocess.run([sys.executable, "-c", _STARTED_WITHOUT_STREAMS, str(result)], timeout=60,
                           capture_output=True)
    assert child.returncode == 0, child.stderr
    assert json.loads(result.read_text()) == ["/dev/null", "/dev/null", "/dev/null", 3]


def test_python_dash_m_nereid_is_the_nereid_command() -> None:
    """What Triton's and MLServer's users try first: it said No module named nereid.__main__."""
    child = subprocess.run([sys.executable, "-m", "nereid", "--help"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0 and child.stdout.startswith("usage: nereid "), child


def test_the_bundle_tools_run_under_python_dash_oo() -> None:
    """Found by the deployment hunt: under -OO (no docstrings) the migration tool failed on its own description."""
    for tool in ("migrate", "examples"):
        child = subprocess.run([sys.executable, "-OO", "-m", f"nereid.backends.xla.export.{tool}", "--help"],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0 and child.stdout.startswith("usage: "), (tool, child.stderr)
