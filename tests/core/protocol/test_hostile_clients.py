"""What a hostile or careless client can do to a real server, over real gRPC on the loopback.

Each test reproduces a defect an adversarial probe found: one client must never
freeze the server, lose another request's answer, or get a wrong status code.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from support import expect_grpc_error, textproto_single

# A model that takes 10 s: longer than any client here is willing to wait.
SLEEPY_MAIN = '''
import time
time.sleep(10)
'''


def int8_input(values, name: str = "input") -> triton.InferInput:
    array = np.asarray(values, dtype=np.int8)
    tensor = triton.InferInput(name, list(array.shape), "INT8")
    tensor.set_data_from_numpy(array)
    return tensor


def live_latency(url: str) -> float:
    """Seconds one ServerLive takes on a fresh channel (fails after 10 s)."""
    client = triton.InferenceServerClient(url)
    try:
        started = time.monotonic()
        assert client.is_server_live(client_timeout=10)
        return time.monotonic() - started
    finally:
        client.close()


def test_unload_after_an_abandoned_request_keeps_the_server_answering(repo, serve):
    """Defect 1: a request abandoned at its client deadline, then an unload, froze every RPC."""
    repo.python("sleepy", main=SLEEPY_MAIN, textproto=textproto_single("INT8", max_batch_size=0))
    server = serve(repo.write_config('- name: "sleepy"\n  timeout_s: null\n',
                                     server_extra="  shutdown_grace_s: 1\n"))
    expect_grpc_error("DEADLINE_EXCEEDED",
                      lambda: server.client.infer("sleepy", [int8_input([1] * 4)], client_timeout=1))
    started = time.monotonic()
    unloader = threading.Thread(target=server.client.unload_model, args=("sleepy",))
    unloader.start()
    latencies = []
    while unloader.is_alive() and time.monotonic() - started < 8:
        latencies.append(live_latency(server.url))
        time.sleep(0.05)
    unloader.join(10)
    took = time.monotonic() - started
    assert not unloader.is_alive()
    # The loop never blocked: the defect froze every RPC until the model's 10 s run ended (a ServerLive on a
    # fresh channel took 0.56 s once, the 2-core machine busy with the suite and more: the bound is not 0.5 s).
    assert latencies and max(latencies) < 2, latencies
    assert took < 5, took  # grace 1 s, then the running program was killed (not 10 s)
    index = {m.name: m for m in server.client.get_model_repository_index().models}
    assert (index["sleepy"].state, index["sleepy"].reason) == ("UNAVAILABLE", "unloaded")


# --------------------------------------------------------------------------- helpers for raw wire traffic

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def raw_channel(server) -> grpc.Channel:
    """A plain grpc channel that sends bytes as given (no serializer), as a hostile client would."""
    return grpc.insecure_channel(server.url, options=[("grpc.max_send_message_length", -1),
                                                      ("grpc.max_receive_message_length", -1)])


def infer_request(model: str, name: str, datatype: str, shape: list[int], raw: bytes,
                  request_id: str = "") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request.SerializeToString()


def call_raw(server, method: str, payload: bytes, timeout: float = 30) -> tuple[grpc.StatusCode, str]:
    with raw_channel(server) as channel:
        try:
            channel.unary_unary(method)(payload, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture
def echo_server(repo, serve):
    repo.python("echo", textproto=textproto_single("INT8"))
    repo.python("tiny_bytes", textproto=textproto_single("BYTES", "[1]", max_batch_size=1))
    return serve(repo.write_config())


# --------------------------------------------------------------------------- defect 4: stream garbage


def test_garbage_on_a_stream_is_answered_in_stream_after_every_accepted_request(echo_server, caplog):
    """Defect 4: 5 valid requests then 16 bytes of garbage gave 0 or 1 answers, silently."""
    valid = [infer_request("echo", "input", "INT8", [4], bytes([i] * 4), request_id=f"r{i}") for i in range(5)]
    with raw_channel(echo_server) as channel:
        call = channel.stream_stream(MODEL_STREAM_INFER)
        answers = [service_pb2.ModelStreamInferResponse.FromString(answer)
                   for answer in call(iter([*valid, b"\xff" * 16]), timeout=30)]
    assert len(answers) == 6
    ok = {a.infer_response.id: a for a in answers if not a.error_message}
    assert sorted(ok) == [f"r{i}" for i in range(5)]
    for i in range(5):
        assert ok[f"r{i}"].infer_response.raw_output_contents[0] == bytes([i] * 4)
    (garbage,) = [a for a in answers if a.error_message]
    assert "cannot parse the 16-byte request as ModelInferRequest" in garbage.error_message
    logged = [r for r in caplog.records if "cannot parse the 16-byte request" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None  # logged, on one line
    assert logged[0].getMessage().startswith("ModelStreamInfer from 127.0.0.1:")  # naming the client


# --------------------------------------------------------------------------- defect 9: status codes, echoes


def test_unparseable_request_is_invalid_argument_and_logs_one_line(echo_server, caplog):
    code, details = call_raw(echo_server, MODEL_INFER, b"\xff" * 16)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot parse the 16-byte request as ModelInferRequest" in details
    # (The gRPC hunt: protobuf's text named nereid's own copy of the package, 'nereid.v2.ModelInferRequest'.)
    assert "with type 'inference.ModelInferRequest'" in details, details
    logged = [r for r in caplog.records if "cannot parse" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None and "\n" not in logged[0].getMessage()
    assert logged[0].getMessage().startswith("ModelInfer from 127.0.0.1:")  # naming the client
    # Every other RPC too, not only inference.
    code, _ = call_raw(echo_server, "/inference.GRPCInferenceService/ModelMetadata", b"\x0a\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_rank_above_the_limit_is_invalid_argument(echo_server):
    """A rank above numpy's 64 dimensions gave INTERNAL."""
    payload = infer_request("echo", "input", "INT8", [1] * 65, b"\x01")
    code, details = call_raw(echo_server, MODEL_INFER, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "65 dimensions; at most 33" in details  # (a model's 32 declared dims and its batch axis)


def test_a_huge_model_name_is_not_found_with_a_capped_message(echo_server):
    """A 9,000-character name gave RESOURCE_EXHAUSTED: its echo overflowed gRPC's 16 KiB metadata."""
    name = "m" * 9000
    expect_grpc_error("NOT_FOUND", lambda: echo_server.client.get_model_metadata(name), "unknown model")
    code, details = call_raw(echo_server, MODEL_INFER, infer_request(name, "input", "INT8", [4], b"\0" * 4))
    assert code == grpc.StatusCode.NOT_FOUND
    assert len(details) <= 4096 and "characters cut" in details
    code, details = call_raw(echo_server, MODEL_INFER, infer_request("echo", "i" * 20000, "INT8", [4], b"\0" * 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) <= 4096


def test_a_non_ascii_name_is_answered_with_its_status_not_resource_exhausted(echo_server):
    """3,000 'é' fit the 4,096-character cap, but gRPC percent-encodes each of their bytes into three: the
    18 KiB trailer passed the clients' 16 KiB metadata limit, and they got RESOURCE_EXHAUSTED instead."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = "é" * 3000
    code, details = call_raw(echo_server, MODEL_INFER, infer_request(name, "input", "INT8", [4], b"\0" * 4))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown model 'éé" in details and "characters cut" in details
    code, details = call_raw(echo_server, MODEL_INFER, infer_request("echo", "模型" * 2000, "INT8", [4], b"\0" * 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'echo'" in details
    with raw_channel(echo_server) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="%" * 9000), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "unknown service '%%%" in info.value.details()


def test_error_messages_do_not_reveal_server_paths(echo_server):
    expect_grpc_error("NOT_FOUND", lambda: echo_server.client.get_model_metadata("nope"), "unknown model 'nope'")
    with pytest.raises(InferenceServerException) as info:
        echo_server.client.load_model("nope")
    assert str(echo_server.server.repository.root) not in info.value.message()


# --------------------------------------------------------------------------- defect 3: tiny BYTES elements


def test_surplus_tiny_bytes_elements_are_refused_at_once_without_stalling_others(echo_server):
    """Defect 3: 64 MiB of 1-byte elements for a [1, 1] input stalled the loop for 6.5 s."""
    element = struct.pack("<I", 1) + b"x"
    raw = element * ((32 << 20) // len(element))
    payload = infer_request("tiny_bytes", "input", "BYTES", [1, 1], raw)
    del raw
    result: list = []
    sender = threading.Thread(target=lambda: result.append(call_raw(echo_server, MODEL_INFER, payload)))
    loop_clock = _loop_cpu_clock(echo_server)
    loop_cpu, all_cpu, own_cpu = time.clock_gettime(loop_clock), time.process_time(), time.thread_time()
    sender.start()
    latencies = []
    while sender.is_alive():
        latencies.append(live_latency(echo_server.url))
    sender.join()
    loop_cpu = time.clock_gettime(loop_clock) - loop_cpu
    others_cpu = (time.process_time() - all_cpu) - (time.thread_time() - own_cpu)  # (all but this probing thread)
    (code, details), = result
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 1 BYTES element(s) the shape allows" in details
    # CPU, not wall time: a starved machine stretched the 0.1 s this takes to 6 s of waiting for a core, and a
    # ServerLive meanwhile past 3 s (the flaky-test hunt). The defect decoded every element on the loop: 6.5 s.
    assert others_cpu < 2.5, (others_cpu, latencies)  # refused at once
    assert loop_cpu < 1.0, (loop_cpu, latencies)  # the loop never held by it


def _loop_cpu_clock(server) -> int:
    """The CPU clock of the thread that runs ``server``'s event loop."""
    async def ident() -> int:
        return threading.get_ident()
    return time.pthread_getcpuclockid(asyncio.run_coroutine_threadsafe(ident(), server.loop).result(10))


def test_a_stream_with_more_requests_than_the_in_flight_cap_answers_them_all(echo_server):
    """Reading pauses at STREAM_IN_FLIGHT unanswered requests; it must resume, not deadlock."""
    from nereid.protocol.grpc_service import STREAM_IN_FLIGHT

    count = STREAM_IN_FLIGHT + 44
    requests = [infer_request("echo", "input", "INT8", [4], bytes([i % 128] * 4), request_id=str(i))
                for i in range(count)]
    with raw_channel(echo_server) as channel:
        answers = [service_pb2.ModelStreamInferResponse.FromString(answer)
                   for answer in channel.stream_stream(MODEL_STREAM_INFER)(iter(requests), timeout=60)]
    assert len(answers) == count
    # The echo model's queue holds 128: the others wait for room (each was refused "queue is full" before).
    assert [a.error_message for a in answers] == [""] * count
    assert [a.infer_response.id for a in answers] == [str(i) for i in range(count)]
    assert all(a.infer_response.raw_output_contents[0] == bytes([i % 128] * 4) for i, a in enumerate(answers))


def test_a_stream_s_requests_in_flight_are_bounded_by_their_bytes_too(echo_server, monkeypatch):
    """Found by the gRPC read hunt: the in-flight cap counted requests, so one stream could hold 256 of
    max_message_bytes each, and their answers, behind one slow request (32 GiB with the defaults). With a budget
    of one byte, each request is read only once the one before it is answered: none is batched with another, and
    none is lost."""
    from nereid.protocol import grpc_service

    monkeypatch.setattr(grpc_service, "STREAM_BYTES_IN_FLIGHT", 1)
    count = 24
    requests = [infer_request("echo", "input", "INT8", [4], bytes([i] * 4), request_id=str(i)) for i in range(count)]
    with raw_channel(echo_server) as channel:
        answers = [service_pb2.ModelStreamInferResponse.FromString(answer)
                   for answer in channel.stream_stream(MODEL_STREAM_INFER)(iter(requests), timeout=60)]
    assert [a.infer_response.id for a in answers] == [str(i) for i in range(count)]
    assert all(a.infer_response.raw_output_contents[0] == bytes([i] * 4) for i, a in enumerate(answers))
    stats = echo_server.client.get_inference_statistics("echo").model_stats[0]
    assert stats.execution_count == stats.inference_count == count  # one at a time: never two in one batch


def test_made_up_model_names_are_not_found_without_rescanning_the_repository(echo_server):
    """Every unknown name listed the whole repository on the event loop."""
    repository = echo_server.server.repository
    late = repository.root / "late"
    late.mkdir()
    (late / "model_inference.textproto").write_text(textproto_single("INT8"))
    (late / "main.py").write_text("print()\n")
    for name in ("nope", "../../etc", "a\0b", "x" * 300, ".cache"):
        expect_grpc_error("NOT_FOUND", lambda: echo_server.client.get_model_metadata(name), "unknown model")
        assert echo_server.client.is_model_ready(name) is False
    # No lookup above scanned the repository: the folder added meanwhile is not known yet...
    assert "late" not in [entry.name for entry in repository.entries()]
    echo_server.client.load_model("late")  # ...and is found as soon as it is asked for by name
    assert echo_server.client.is_model_ready("late")


def test_client_triggered_warnings_are_rate_limited(caplog):
    """One warning per garbage message let a client fill the disk as fast as it could send."""
    import logging

    from nereid.log_limit import RateLimitedLog

    limited = RateLimitedLog(logging.getLogger("nereid.test_limit"), burst=10, window_s=0.3)
    with caplog.at_level(logging.WARNING, logger="nereid.test_limit"):
        written = [limited.warning("garbage %d", i) for i in range(25)]
        assert written.count(True) == 10
        time.sleep(0.35)
        assert limited.warning("garbage %d", 25)
    lines = [r.getMessage() for r in caplog.records if r.name == "nereid.test_limit"]
    assert lines[:10] == [f"garbage {i}" for i in range(10)]
    assert lines[10] == "garbage 25 (15 similar message(s) suppressed before this one)"


def test_runtime_errors_show_paths_relative_to_the_repository(repo, serve):
    """A model's traceback named the server's absolute paths to every client."""
    repo.python("crash", main="raise RuntimeError('boom')\n", textproto=textproto_single("INT8"))
    server = serve(repo.write_config())
    message = expect_grpc_error("INTERNAL", lambda: server.client.infer("crash", [int8_input([1] * 4)]),
                                "boom")
    assert str(repo.models_dir.resolve()) not in message and str(server.server.scratch_dir) not in message
    import nereid.backends

    assert str(Path(nereid.backends.__file__).resolve().parent) not in message  # where nereid is installed
