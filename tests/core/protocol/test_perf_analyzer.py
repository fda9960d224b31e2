"""Triton's perf_analyzer (tritonclient 2.41.0's binary) against a real server, over HTTP and gRPC.

perf_analyzer asks for server metadata, model metadata, the model config and
(because nereid lists the ``statistics`` extension) model statistics before it
sends, then drives the model at a fixed concurrency and reads the statistics
again: every one of those calls has to answer the way Triton's would.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import toy_backends
from nereid.plugins import make_plugin_manager

REQUESTS_PER_WINDOW = 40


def perf_analyzer() -> tuple[str, dict[str, str]]:
    """The binary and an environment it starts in; skips the test where it cannot start."""
    binary = Path(sys.executable).with_name("perf_analyzer")
    found = str(binary) if binary.exists() else shutil.which("perf_analyzer")
    if found is None:
        pytest.skip("perf_analyzer is not installed (it ships in tritonclient 2.41.0, part of .[test])")
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")  # it links the CUDA runtime, even for CPU servers
    if spec is not None and spec.submodule_search_locations:
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    started = subprocess.run([found, "--help"], capture_output=True, text=True, env=env, timeout=60)
    if "error while loading shared libraries" in started.stderr:
        pytest.skip(f"perf_analyzer cannot start here: {started.stderr.strip()} "
                    "(Debian: apt-get install libb64-0d)")
    return found, env


@pytest.fixture
def toy_server(repo, serve):
    """A server with the in-process toy model (adds one to FP32 [4], batches up to 8); HTTP and gRPC on."""
    toy_backends.write_toy(repo.models_dir, "toy")
    server = serve(repo.write_config(), manager=make_plugin_manager(extra_plugins=(toy_backends,)))
    return server


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_drives_the_model_and_every_request_is_counted(toy_server, protocol, tmp_path) -> None:
    binary, env = perf_analyzer()
    port = toy_server.server.http_port if protocol == "http" else toy_server.url.rsplit(":", 1)[1]
    report = tmp_path / "report.csv"
    argv = [binary, "-m", "toy", "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency-range", "4",
            "--measurement-mode", "count_windows", "--measurement-request-count", str(REQUESTS_PER_WINDOW),
            "--max-trials", "3", "--stability-percentage", "999", "-f", str(report)]
    completed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "error" not in output.lower(), output[-3000:]

    row = next(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 0
    # perf_analyzer read the server-side view through ModelStatistics and printed it.
    assert "Server:" in output and "Inference count:" in output, output[-3000:]

    stats = toy_server.client.get_inference_statistics("toy").model_stats[0]
    assert stats.inference_stats.fail.count == 0
    # At least one measured window of requests, plus the warm-up ones, all succeeded and were counted.
    assert stats.inference_stats.success.count >= REQUESTS_PER_WINDOW
    assert stats.inference_count == stats.inference_stats.success.count
