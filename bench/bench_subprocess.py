"""Subprocess models: warm against cold starts, the wait for a child's exit, cpp spawning, batching.

Everything is measured side by side in one run, on one server (warm and cold
variants of each model are separate model folders that differ only in
``runtime: {warm_start: ...}``), with perf_analyzer as the client:

1. exit wait: main.py models that sleep 20 ms and 65 ms, served one request at a
   time (default ``timeout_s``; tritonclient, cold and warm) against the same
   program run directly with ``subprocess.run`` (no timeout), alternating.
   Target: cold served at most 3 ms over the direct run.
2. warm start: a numpy model (imports numpy, runs a 16x4 layer) and a
   standard-library echo, cold against warm p50 at concurrency 1 (targets: warm
   at most 1/15 and 1/5 of cold), and the numpy model at concurrency 16 with
   batching on (throughput).
3. in-process: the same numpy layer as an in-process plugin backend, against
   the warm main.py.
4. cpp: one batch of the cpp_scale example through the backend, against a bare
   ``os.posix_spawn`` of the same binary (no server around either).
5. batching on/off for the python_rowsum example at concurrency 16, warm.

    python3 bench/bench_subprocess.py [--concurrency 16] [--repeat 40]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import BENCH_DIR, REPO_ROOT, free_port, perf_analyzer, print_table, running, wait_model_ready

TEXTPROTO = 'input_shape: [16]\noutput_shape: [{out}]\nmax_batch_size: 16\ndata_type: "FP32"\n'

SLEEP_MAIN = '''
import os, sys, time
raw = sys.stdin.buffer.read()
time.sleep({seconds})
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("float32 %s\\n" % os.environ["NEREID_INPUT_SHAPE"]).encode() + raw)
'''

ECHO_MAIN = '''
import os, sys
raw = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("float32 %s\\n" % os.environ["NEREID_INPUT_SHAPE"]).encode() + raw)
'''

# The same layer as layer_backend.NumpyLayer.
NUMPY_MAIN = '''
import os, sys
import numpy as np
rows = int(os.environ["NEREID_INPUT_SHAPE"].split(",")[0])
x = np.frombuffer(sys.stdin.buffer.read(), dtype="<f4").reshape(rows, 16)
weights = (np.arange(64, dtype=np.float32).reshape(16, 4) - 32) / 64
result = np.tanh(x @ weights + np.linspace(-1, 1, 4, dtype=np.float32)).astype("<f4")
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("float32 %d,4\\n" % rows).encode() + result.tobytes())
'''

PYTHON_MODELS = {  # name: (main.py, output width)
    "sleep20": (SLEEP_MAIN.format(seconds=0.020), 16),
    "sleep65": (SLEEP_MAIN.format(seconds=0.065), 16),
    "echo": (ECHO_MAIN, 16),
    "numpy_layer": (NUMPY_MAIN, 4),
}


def write_repository(root: Path, concurrency: int) -> Path:
    """Every model, warm and ``<name>_cold``, the in-process layer and the rowsum example on/off."""
    models = root / "ml-backends"
    entries = []
    for name, (main, width) in PYTHON_MODELS.items():
        for variant, warm in ((name, True), (f"{name}_cold", False)):
            folder = models / variant
            folder.mkdir(parents=True)
            (folder / "main.py").write_text(main)
            (folder / "model_inference.textproto").write_text(TEXTPROTO.format(out=width))
            entries.append(f"  - name: {variant}\n    queue_capacity: {4 * concurrency}\n"
                           f"    runtime: {{warm_start: {'true' if warm else 'false'}}}\n")
    inprocess = models / "numpy_inprocess"
    inprocess.mkdir()
    (inprocess / "layer.txt").write_text("")
    (inprocess / "model_inference.textproto").write_text(TEXTPROTO.format(out=4))
    entries.append(f"  - name: numpy_inprocess\n    queue_capacity: {4 * concurrency}\n")
    for variant, batching in (("rowsum_batching_on", True), ("rowsum_batching_off", False)):
        shutil.copytree(REPO_ROOT / "ml-backends" / "python_rowsum", models / variant)
        entries.append(f"  - name: {variant}\n    queue_capacity: {4 * concurrency}\n"
                       f"    batching: {{enabled: {'true' if batching else 'false'}}}\n")
    config = root / "nereid.yaml"
    config.write_text('server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n  http_addr: ""\nmodels:\n'
                      + "".join(entries))
    return config


def exit_wait_ms(address: str, models: Path, name: str, repeat: int) -> tuple[float, float, float]:
    """Median ms of: ``python main.py`` run directly with subprocess.run (no timeout), as the server feeds it;
    the same model served cold; served warm. The three alternate, so a slow spell hits all alike."""
    import tritonclient.grpc as triton

    data = np.ones((1, 16), dtype="<f4")
    client = triton.InferenceServerClient(address)
    tensor = triton.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(data)
    times: dict[str, list[float]] = {"direct": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NEREID_INPUT_SHAPE": "1,16",
               "NEREID_INPUT_DTYPE": "float32", "NEREID_OUTPUT_PATH": str(Path(tmp) / "out"), "TMPDIR": tmp}
        for _ in range(repeat):
            started = time.perf_counter()
            subprocess.run([sys.executable, "main.py"], cwd=models / name, env=env, input=data.tobytes(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times["direct"].append(time.perf_counter() - started)
            for kind, model in (("cold", f"{name}_cold"), ("warm", name)):
                started = time.perf_counter()
                client.infer(model, [tensor])
                times[kind].append(time.perf_counter() - started)
    client.close()
    return tuple(statistics.median(times[kind]) * 1e3 for kind in ("direct", "cold", "warm"))


def cpp_spawn_ms(repeat: int) -> tuple[float, float]:
    """Median ms of one cpp_scale batch through CppModel.infer, and of a bare posix_spawn of its binary."""
    from nereid.backend import ModelContext
    from nereid.backends.cpp.plugin import CppModel
    from nereid.settings import ModelSettings
    from nereid.tensors import NamedTensor

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "cpp_scale"
        shutil.copytree(REPO_ROOT / "ml-backends" / "cpp_scale", folder)
        model = CppModel(ModelContext("cpp_scale", folder, ModelSettings("cpp_scale"), Path(tmp)))
        model.load()
        x = np.ones((1, 8), dtype=np.float32)
        inputs = [NamedTensor("input", model.signature().inputs[0].dtype, x)]
        binary = model.command()[0]
        env = {"NEREID_INPUT_SHAPE": "1,8", "NEREID_OUTPUT_PATH": str(Path(tmp) / "out")}

        def bare() -> None:
            read_end, write_end = os.pipe()
            pid = os.posix_spawn(binary, [binary], env, setsid=True,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0), (os.POSIX_SPAWN_CLOSE, write_end)])
            os.close(read_end)
            os.write(write_end, x.tobytes())
            os.close(write_end)
            os.waitpid(pid, 0)

        served, direct = [], []
        for _ in range(repeat):  # alternate, so a slow spell of the machine hits both
            started = time.perf_counter()
            model.infer(inputs)
            served.append(time.perf_counter() - started)
            started = time.perf_counter()
            bare()
            direct.append(time.perf_counter() - started)
        model.unload()
    return statistics.median(served) * 1e3, statistics.median(direct) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=40, help="direct runs per model for the exit-wait table")
    args = parser.parse_args()
    c = args.concurrency
    with tempfile.TemporaryDirectory() as tmp:
        config = write_repository(Path(tmp), c)
        models = Path(tmp) / "ml-backends"
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, str(BENCH_DIR / "serve_with_plugin.py"), str(config), address]
        runs: dict[tuple[str, int], dict[str, float]] = {}
        with running(argv, address, lambda a: wait_model_ready(a, "numpy_inprocess")):
            for name in ("echo", "echo_cold", "numpy_layer", "numpy_layer_cold", "numpy_inprocess"):
                runs[name, 1] = perf_analyzer(address, name, 1)
            for name in ("numpy_layer", "numpy_layer_cold", "numpy_inprocess", "rowsum_batching_on",
                         "rowsum_batching_off"):
                runs[name, c] = perf_analyzer(address, name, c)
            exit_wait = {name: exit_wait_ms(address, models, name, args.repeat) for name in ("sleep20", "sleep65")}
    cpp_served, cpp_bare = cpp_spawn_ms(300)

    def p50(name: str, concurrency: int = 1) -> float:
        return runs[name, concurrency]["p50_us"] / 1e3

    print_table(f"1. Exit wait: the program run directly vs served (tritonclient, one at a time), medians of "
                f"{args.repeat} alternating runs (ms)",
                ["model", "direct", "served cold", "added", "served warm"],
                [[n, d, cold, cold - d, warm] for n, (d, cold, warm) in exit_wait.items()])
    print_table("2. Warm start at concurrency 1: p50 latency (ms)",
                ["model", "cold", "warm", "warm / cold"],
                [[n, p50(f"{n}_cold"), p50(n), p50(n) / p50(f"{n}_cold")] for n in ("numpy_layer", "echo")])
    warm_c, cold_c = runs["numpy_layer", c]["throughput"], runs["numpy_layer_cold", c]["throughput"]
    print_table(f"   numpy_layer at concurrency {c}, batching on (infer/s)",
                ["cold", "warm", "warm / cold"], [[cold_c, warm_c, warm_c / cold_c]])
    inproc_1, inproc_c = p50("numpy_inprocess"), runs["numpy_inprocess", c]["throughput"]
    print_table("3. Warm main.py vs the same numpy layer in-process",
                ["", "in-process", "warm main.py", "ratio"],
                [["p50 ms at concurrency 1", inproc_1, p50("numpy_layer"), p50("numpy_layer") / inproc_1],
                 [f"infer/s at concurrency {c}", inproc_c, warm_c, warm_c / inproc_c]])
    print_table("4. One cpp_scale batch (ms, median of 300, no server)",
                ["CppModel.infer", "bare posix_spawn", "added"], [[cpp_served, cpp_bare, cpp_served - cpp_bare]])
    on, off = runs["rowsum_batching_on", c]["throughput"], runs["rowsum_batching_off", c]["throughput"]
    print_table(f"5. python_rowsum (warm) at concurrency {c} (infer/s)", ["batching off", "batching on", "on / off"],
                [[off, on, on / off]])


if __name__ == "__main__":
    main()
