"""Soak: valid and hostile traffic against one ``nereid serve`` for a while; RSS must stay flat.

Valid clients call two models over and over (an in-process identity, on the event
loop, and a python-backend echo, one process per batch) and check every answer.
Hostile clients meanwhile send, in a loop: bytes that are not a message (unary
and mid-stream), requests over ``max_message_bytes``, megabytes of 1-byte BYTES
elements for a ``[1, 1]`` input, rank-65 shapes, 9,000-character model names,
large requests rejected after decoding, requests abandoned at a 50 ms deadline on
a model that takes a second, unload/load churn of that model, and idle
connections to /metrics. The server's RSS is sampled every second.

Passes when every valid request was answered correctly, ServerLive never took
more than 0.5 s, and RSS at the end is within 10% (+32 MiB) of RSS after a
warm-up with the same mix.

    python3 bench/soak_hostile.py [--seconds 60] [--warmup 15]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, running  # noqa: E402  (found through the path above)

ECHO_MAIN = '''
import os, sys
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode())
    out.write(data)
'''
SLOW_MAIN = "import time\ntime.sleep(1)\n"
SERVICE = "/inference.GRPCInferenceService/"
MAX_MESSAGE = 16 << 20


def write_repository(root: Path) -> Path:
    models = root / "ml-backends"
    for name, main, textproto in (
            ("echo", ECHO_MAIN, 'input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\ndata_type: "FP32"\n'),
            ("slow", SLOW_MAIN, 'input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 0\ndata_type: "FP32"\n'),
            ("words", ECHO_MAIN, 'input_shape: [1, 1]\noutput_shape: [1, 1]\nmax_batch_size: 0\n'
                                 'data_type: "BYTES"\n')):
        (models / name).mkdir(parents=True)
        (models / name / "main.py").write_text(main)
        (models / name / "model_inference.textproto").write_text(textproto)
    (models / "ident").mkdir()
    (models / "ident" / "identity.txt").write_text("")
    (models / "ident" / "model_inference.textproto").write_text(
        'input_shape: [-1]\noutput_shape: [-1]\nmax_batch_size: 0\ndata_type: "FP32"\n')
    config = root / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: ml-backends\n  metrics_addr: "127.0.0.1:{free_port()}"\n'
                      f'  http_addr: ""\n  shutdown_grace_s: 2\n  max_message_bytes: {MAX_MESSAGE}\n'
                      'models:\n  - name: echo\n  - name: ident\n  - name: words\n'
                      '  - name: slow\n    instances: 2\n    timeout_s: 5\n')
    return config


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def infer_bytes(model: str, name: str, datatype: str, shape: list[int], raw: bytes, request_id: str = "") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request.SerializeToString()


class Soak:
    """The traffic, its counters and the RSS samples."""

    def __init__(self, address: str, metrics_port: int, pid: int, seconds: float) -> None:
        self.address, self.metrics_port, self.pid = address, metrics_port, pid
        self.end = time.monotonic() + seconds
        self.valid = Counter()
        self.hostile = Counter()
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.live_ms: list[float] = []
        self.samples: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", -1),
                                                            ("grpc.max_receive_message_length", -1)])

    def running(self) -> bool:
        return time.monotonic() < self.end

    # -- valid clients -----------------------------------------------------------
    def valid_client(self, model: str, index: int) -> None:
        with self.channel() as channel:
            infer = channel.unary_unary(SERVICE + "ModelInfer")
            count = 0
            while self.running():
                values = np.full(4, index * 1000 + count % 1000, np.float32)
                started = time.monotonic()
                try:
                    reply = service_pb2.ModelInferResponse.FromString(
                        infer(infer_bytes(model, "input", "FP32", [4], values.tobytes()), timeout=30))
                    ok = np.array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), values)
                except grpc.RpcError as err:
                    ok = False
                    with self.lock:
                        self.errors.append(f"{model}: {err.code()} {err.details()[:200]}")
                with self.lock:
                    self.valid["sent"] += 1
                    self.valid["answered ok" if ok else "failed"] += 1
                    self.latencies.append(time.monotonic() - started)
                count += 1

    def liveness(self) -> None:
        with self.channel() as channel:
            live = channel.unary_unary(SERVICE + "ServerLive")
            while self.running():
                started = time.monotonic()
                live(service_pb2.ServerLiveRequest().SerializeToString(), timeout=10)
                self.live_ms.append((time.monotonic() - started) * 1000)
                time.sleep(0.1)

    def sampler(self) -> None:
        start = time.monotonic()
        while self.running():
            self.samples.append((time.monotonic() - start, rss_mib(self.pid)))
            time.sleep(1)

    # -- hostile clients ---------------------------------------------------------
    def _expect_error(self, kind: str, call) -> None:
        try:
            call()
        except grpc.RpcError:
            pass
        with self.lock:
            self.hostile[kind] += 1

    def hostile_requests(self) -> None:
        element = struct.pack("<I", 1) + b"x"
        bomb = infer_bytes("words", "input", "BYTES", [1, 1], element * ((8 << 20) // len(element)))
        oversize = infer_bytes("ident", "input", "FP32", [(MAX_MESSAGE // 4) + 1024], bytes(MAX_MESSAGE + 4096))
        rejected_large = infer_bytes("ident", "input", "FP32", [1 << 20], bytes((4 << 20) - 4))
        rank = infer_bytes("echo", "input", "FP32", [1] * 65, bytes(4))
        long_name = infer_bytes("m" * 9000, "input", "FP32", [4], bytes(16))
        with self.channel() as channel:
            infer = channel.unary_unary(SERVICE + "ModelInfer")
            stream = channel.stream_stream(SERVICE + "ModelStreamInfer")
            while self.running():
                self._expect_error("garbage message", lambda: infer(b"\xff" * 16, timeout=10))
                self._expect_error("BYTES element bomb", lambda: infer(bomb, timeout=30))
                self._expect_error("over max_message_bytes", lambda: infer(oversize, timeout=30))
                self._expect_error("large, rejected after decode", lambda: infer(rejected_large, timeout=30))
                self._expect_error("rank 65", lambda: infer(rank, timeout=10))
                self._expect_error("9,000-character name", lambda: infer(long_name, timeout=10))
                valid = [infer_bytes("ident", "input", "FP32", [4], bytes(16), request_id=str(i)) for i in range(5)]
                answers = list(stream(iter([*valid, b"\xff" * 16]), timeout=30))
                with self.lock:
                    self.hostile["garbage mid-stream"] += 1
                    if len(answers) != 6:
                        self.errors.append(f"stream with garbage: {len(answers)} answers for 6 messages")

    def abandoner(self) -> None:
        with self.channel() as channel:
            infer = channel.unary_unary(SERVICE + "ModelInfer")
            control = channel.unary_unary(SERVICE + "RepositoryModelUnload")
            load = channel.unary_unary(SERVICE + "RepositoryModelLoad")
            rounds = 0
            while self.running():
                self._expect_error("abandoned at 50 ms", lambda: infer(
                    infer_bytes("slow", "input", "FP32", [4], bytes(16)), timeout=0.05))
                rounds += 1
                if rounds % 10 == 0:
                    control(service_pb2.RepositoryModelUnloadRequest(model_name="slow").SerializeToString(),
                            timeout=30)
                    load(service_pb2.RepositoryModelLoadRequest(model_name="slow").SerializeToString(), timeout=30)
                    with self.lock:
                        self.hostile["unload+load after abandons"] += 1

    def idle_metrics(self) -> None:
        while self.running():
            sockets = []
            for _ in range(200):
                try:
                    sockets.append(socket.create_connection(("127.0.0.1", self.metrics_port), timeout=5))
                except OSError:
                    break
            with self.lock:
                self.hostile["idle /metrics connections"] += len(sockets)
            time.sleep(2)
            for connection in sockets:
                connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup", type=float, default=15, help="seconds of the same mix before the baseline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = write_repository(Path(folder))
        metrics_port = int(config.read_text().split("127.0.0.1:")[1].split('"')[0])
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, str(Path(__file__).with_name("serve_with_plugin.py")), str(config), address]
        with running(argv, address) as process:
            time.sleep(3)  # let the models load
            # Warm-up: the same mix for a while, so that pools, arenas and caches reach their size.
            run_mix(Soak(address, metrics_port, process.pid, args.warmup))
            time.sleep(2)
            baseline = rss_mib(process.pid)
            soak = Soak(address, metrics_port, process.pid, args.seconds)
            run_mix(soak)
            time.sleep(2)
            final = rss_mib(process.pid)
    report(soak, baseline, final, args.seconds)


def run_mix(soak: Soak) -> None:
    """All the clients at once, until the soak's end."""
    threads = [threading.Thread(target=soak.valid_client, args=(model, index))
               for index, model in enumerate(["ident", "ident", "echo", "echo"])]
    threads += [threading.Thread(target=soak.hostile_requests) for _ in range(2)]
    threads += [threading.Thread(target=target) for target in (soak.abandoner, soak.idle_metrics,
                                                                soak.liveness, soak.sampler)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def report(soak: Soak, baseline: float, final: float, seconds: float) -> None:
    rss = [value for _, value in soak.samples]
    print(f"soak: {seconds:.0f} s of mixed traffic against nereid serve\n")
    print("| valid requests | count |\n|---|---|")
    for key in ("sent", "answered ok", "failed"):
        print(f"| {key} | {soak.valid[key]} |")
    latencies = sorted(soak.latencies)
    if latencies:
        print(f"| latency p50 / p99 | {latencies[len(latencies) // 2] * 1000:.1f} / "
              f"{latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms |")
    print("\n| hostile traffic | count |\n|---|---|")
    for kind, count in sorted(soak.hostile.items()):
        print(f"| {kind} | {count} |")
    print("\n| server | value |\n|---|---|")
    print(f"| RSS after warm-up | {baseline:.0f} MiB |")
    print(f"| RSS min / median / max during the soak | {min(rss):.0f} / {statistics.median(rss):.0f} / "
          f"{max(rss):.0f} MiB |")
    print(f"| RSS at the end | {final:.0f} MiB |")
    timeline = " ".join(f"{value:.0f}" for when, value in soak.samples[::10])
    print(f"| RSS every 10 s | {timeline} MiB |")
    print(f"| ServerLive max | {max(soak.live_ms):.0f} ms over {len(soak.live_ms)} calls |")
    flat = final <= baseline * 1.1 + 32
    every_answered = soak.valid["sent"] == soak.valid["answered ok"] and not soak.errors
    responsive = max(soak.live_ms) < 500
    for error in soak.errors[:10]:
        print(f"error: {error}")
    print(f"\nRSS flat: {'yes' if flat else 'NO'}; every valid request answered: "
          f"{'yes' if every_answered else 'NO'}; ServerLive under 0.5 s: {'yes' if responsive else 'NO'}")
    sys.exit(0 if flat and every_answered and responsive else 1)


if __name__ == "__main__":
    main()
