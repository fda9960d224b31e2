"""Soak: a python model swapped for its next version by rename, under load; no request may fail.

One ``nereid serve`` with ``watch: true`` serves a python model ``m`` (warm start)
whose ``main.py`` imports ``helper.py`` a moment after it starts and checks that
both carry the same version. Four gRPC clients call it back to back while the
folder is swapped for the next version as the README advises
(``mv m .m.old && mv .m.new m``, then ``rm -rf .m.old`` once the new version
answers), again and again. A run of the loaded version that starts just before
a swap and imports its helper just after it must still find its own helper.

    python3 bench/soak_swap.py [--seconds 60] [--pause-ms 2]

``--pause-ms``: how long ``main.py`` waits between its start and its import,
which widens the window a swap can land in. Prints the swaps made, the requests
answered and those that failed (with the first few errors); exits 1 on a
failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, wait_until_serving  # noqa: E402

CLIENTS = 4
TEXTPROTO = 'input_shape: [1]\noutput_shape: [1]\nmax_batch_size: 1\ndata_type: "BYTES"\n'


def main_py(version: int, pause_ms: float) -> str:
    """A main.py answering its version, once it has checked that the helper it imports is of the same one."""
    return f'''import json, os, sys, time
VERSION = {version}
sys.stdin.buffer.read()
time.sleep({pause_ms / 1000!r})
import helper
assert helper.VERSION == VERSION, f"main.py is version {{VERSION}}, its helper version {{helper.VERSION}}"
answer = json.dumps(VERSION).encode()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(b"bytes 1,1\\n" + len(answer).to_bytes(4, "little") + answer)
'''


def write_version(folder: Path, version: int, pause_ms: float) -> None:
    folder.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text(TEXTPROTO)
    (folder / "main.py").write_text(main_py(version, pause_ms))
    (folder / "helper.py").write_text(f"VERSION = {version}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--pause-ms", type=float, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "ml-backends"
        write_version(models / "m", 1, args.pause_ms)
        (root / "nereid.yaml").write_text('server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n'
                                          '  http_addr: ""\n  watch: true\n  watch_settle_ms: 300\n')
        address = f"127.0.0.1:{free_port()}"
        with open(root / "server.log", "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "nereid.cli", "serve", "--config",
                                       str(root / "nereid.yaml"), "--bind", address, "--log-level", "WARNING"],
                                      stderr=log)
        try:
            wait_until_serving(address)
            client = triton.InferenceServerClient(address)
            while not client.is_model_ready("m"):
                time.sleep(0.1)
            stop = threading.Event()
            answered, failed, newest = [0], [], [1]
            lock = threading.Lock()

            def call() -> None:
                caller = triton.InferenceServerClient(address)
                tensor = triton.InferInput("input", [1, 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
                while not stop.is_set():
                    try:
                        version = json.loads(caller.infer("m", [tensor]).as_numpy("output")[0, 0])
                    except Exception as err:  # noqa: BLE001 - counted and shown
                        with lock:
                            failed.append(str(err))
                        continue
                    with lock:
                        answered[0] += 1
                        newest[0] = max(newest[0], version)

            clients = [threading.Thread(target=call) for _ in range(CLIENTS)]
            for thread in clients:
                thread.start()
            ends, version, swaps = time.monotonic() + args.seconds, 1, 0
            while time.monotonic() < ends:
                version += 1
                write_version(models / ".m.new", version, args.pause_ms)
                os.rename(models / "m", models / ".m.old")
                os.rename(models / ".m.new", models / "m")
                swaps += 1
                deadline = time.monotonic() + 30
                while newest[0] < version and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # the old version's last runs end
                shutil.rmtree(models / ".m.old")
            stop.set()
            for thread in clients:
                thread.join()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"{swaps} swaps, {answered[0]} requests answered, {len(failed)} failed")
    for error in failed[:3]:
        print("  ", error[:400])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
