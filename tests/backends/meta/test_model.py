"""backends/meta/model.py over real gRPC: fan-out, the deadline rule, error mapping, depends_on, batching with direct
traffic.

The sub-models are real python-backend models (a child process per batch)
that append a line to a counter file in their folder each time they run, so
a test can prove which of them ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import shutil
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from support import (COUNT_THE_RUN, ModelRepo, echo_main, expect_grpc_error, fail_thread_starts, scrape,
                     unreadable_chunked_infer, wait_until)

SHIPPED = Path(__file__).resolve().parents[3] / "ml-backends"

# An echo of one FP32 tensor that sleeps SLEEP_S first and counts its runs in calls.txt (its starts in
# started.txt).
COUNTING_MAIN = echo_main('import time\nwith open("started.txt", "a") as started:\n    started.write("1\\n")\n'
                          'time.sleep({sleep_s})\n' + COUNT_THE_RUN)

FAILING_MAIN = '''
import sys
sys.stderr.write("boom: the sub-model broke\\n")
sys.exit(3)
'''


def add_counting(repo: ModelRepo, name: str, sleep_s: float = 0.0) -> Path:
    return repo.python(name, main=COUNTING_MAIN.format(sleep_s=sleep_s))


def add_meta(repo: ModelRepo, name: str, model_py: str, depends_on: list[str], tensors: str | None = None) -> Path:
    """A meta model folder; by default its wire tensors are one FP32 [4] input ``input`` and output ``output``."""
    folder = repo.models_dir / name
    folder.mkdir()
    tensors = tensors or ("client_inputs: [{name: input, dtype: f32, shape: a, dims: {a: 4}}]\n"
                          "client_outputs: [{name: output, dtype: f32, shape: a, dims: {a: 4}}]\n")
    (folder / "manifest.yaml").write_text(f'format_version: "2.1"\nmeta: true\ndepends_on: {depends_on}\n{tensors}')
    (folder / "model.py").write_text(textwrap.dedent(model_py))
    return folder


def add_shipped(repo: ModelRepo, *names: str) -> None:
    """Copy shipped example folders into the test repository (their .cache/ left behind)."""
    for name in names:
        shutil.copytree(SHIPPED / name, repo.models_dir / name, ignore=shutil.ignore_patterns(".cache"))


def statistics(client: triton.InferenceServerClient, model: str):
    return client.get_inference_statistics(model, as_json=False).model_stats[0]


def calls(folder: Path, file: str = "calls.txt") -> int:
    """How many times the counting model in ``folder`` ran (``started.txt``: began to)."""
    path = folder / file
    return len(path.read_text().splitlines()) if path.exists() else 0


def infer(client: triton.InferenceServerClient, model: str, array: np.ndarray, **kwargs) -> np.ndarray:
    tensor = triton.InferInput("input", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor], **kwargs).as_numpy("output")


X = np.arange(4, dtype=np.float32)

FAN_OUT = '''
import asyncio
import nereid

async def orchestrate(inputs, ctx):
    (a,), (b,) = await asyncio.gather(ctx.infer("slow_a", inputs), ctx.infer("slow_b", inputs))
    return [type(a)("output", a.dtype, a.data + b.data)]

nereid.register_model(orchestrate=orchestrate)
'''


def test_fan_out_runs_sub_calls_concurrently(repo, serve) -> None:
    slow_s = 1.5  # (the overheads get 1.3 s: room for a loaded machine, the flaky-test hunt)
    add_counting(repo, "slow_a", slow_s)
    add_counting(repo, "slow_b", slow_s)
    add_meta(repo, "fan", FAN_OUT, ["slow_a", "slow_b"])
    server = serve(repo.write_config())
    infer(server.client, "fan", X)  # warm: the first fork of each warm parent
    started = time.monotonic()
    np.testing.assert_array_equal(infer(server.client, "fan", X), 2 * X)
    elapsed = time.monotonic() - started
    # One after the other would take 2 x 1.5 s; together they take one sleep plus the overheads.
    assert slow_s <= elapsed < 2 * slow_s - 0.2, elapsed


ONE_FAILS = {
    "async": '''
import asyncio
import numpy as np
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    wrong = [NamedTensor.from_array("input", np.zeros(3, np.float32))]
    (a,), _, _ = await asyncio.gather(ctx.infer("slow", inputs), ctx.infer("slow", inputs), ctx.infer("slow", wrong))
    return [a]

nereid.register_model(orchestrate=orchestrate)
''',
    # A plain def fanning out over threads of its own, which it does not wait for once one call fails.
    "threaded": '''
import concurrent.futures
import time
from pathlib import Path
import numpy as np
import nereid
from nereid.tensors import NamedTensor

POOL = concurrent.futures.ThreadPoolExecutor(2)
STARTED = Path(__file__).parent.parent / "slow" / "started.txt"  # (the counting model's starts)

def orchestrate(inputs, ctx):
    wrong = [NamedTensor.from_array("input", np.zeros(3, np.float32))]
    first, second = POOL.submit(ctx.infer, "slow", inputs), POOL.submit(ctx.infer, "slow", inputs)
    deadline = time.monotonic() + 30
    while not STARTED.exists() and time.monotonic() < deadline:  # both issued: one runs, one waits in the queue
        time.sleep(0.01)
    ctx.infer("slow", wrong)
    return [first.result()[0]]

nereid.register_model(orchestrate=orchestrate)
''',
}


@pytest.mark.parametrize("kind", ONE_FAILS)
def test_sub_calls_still_queued_when_their_orchestration_ends_are_dropped(repo, serve, kind) -> None:
    """Defect (found by a bug hunt): in the README's fan-out, one sub-call refused at once ended the request, and
    its siblings ran anyway for nobody: the one still queued in its model started after the client had its
    answer. Dropped now, as when the client goes away (the one already running cannot be stopped); for a plain def
    orchestration, the sub-calls of threads it started are dropped when it returns or raises."""
    slow = add_counting(repo, "slow", 1.0)
    add_meta(repo, "one_fails", ONE_FAILS[kind], ["slow"])
    client = serve(repo.write_config()).client
    with pytest.raises(InferenceServerException, match="sub-call to 'slow' failed"):
        infer(client, "one_fails", X)
    time.sleep(2.5)  # the first run's second, and what a second run would take
    assert calls(slow) == 1


# The deadline rule, for both kinds of orchestration: async def, and a plain def on a worker thread.
TWO_STEPS = {
    "async": '''
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (first,) = await ctx.infer("slow", inputs)
    (second,) = await ctx.infer("counted", [NamedTensor("input", first.dtype, first.data)])
    return [NamedTensor("output", second.dtype, second.data)]

nereid.register_model(orchestrate=orchestrate)
''',
    "thread": '''
import nereid
from nereid.tensors import NamedTensor

def orchestrate(inputs, ctx):
    (first,) = ctx.infer("slow", inputs)
    (second,) = ctx.infer("counted", [NamedTensor("input", first.dtype, first.data)])
    return [NamedTensor("output", second.dtype, second.data)]

nereid.register_model(orchestrate=orchestrate)
''',
}


@pytest.mark.parametrize("kind", sorted(TWO_STEPS))
def test_no_sub_call_starts_after_the_deadline(repo, serve, kind: str) -> None:
    slow = add_counting(repo, "slow", 0.6)
    counted = add_counting(repo, "counted")
    add_meta(repo, "two_steps", TWO_STEPS[kind], ["slow", "counted"])
    server = serve(repo.write_config())
    client = server.client

    np.testing.assert_array_equal(infer(client, "two_steps", X), X)  # no deadline: both run
    assert (calls(slow), calls(counted)) == (1, 1)

    # A 300 ms budget (Triton's timeout parameter, in µs) runs out during the first, 600 ms sub-call:
    # that call is not interrupted, and the second is never issued.
    expect_grpc_error("DEADLINE_EXCEEDED", lambda: infer(client, "two_steps", X, timeout=300_000),
                      "meta model 'two_steps'", "sub-call to 'counted'", "was not issued")
    assert calls(slow) == 2, "the running sub-call must finish"
    assert calls(counted) == 1, "the second sub-call must not run"
    counted_stats = statistics(client, "counted")
    assert counted_stats.inference_count == 1 and counted_stats.inference_stats.fail.count == 0
    assert statistics(client, "two_steps").inference_stats.fail.count == 1


ERRORS = '''
import asyncio
import numpy as np
import nereid
from nereid.errors import InvalidArgument, ModelFailure
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (x,) = inputs
    mode = int(x.data[0])
    if mode == 0:    # the failure is not caught: the client gets the sub-call's status
        return await ctx.infer("failing", inputs)
    if mode == 1:    # caught: the orchestration answers anyway
        try:
            await ctx.infer("failing", inputs)
        except ModelFailure:
            return [NamedTensor.from_array("output", np.full_like(x.data, -1))]
    if mode == 2:    # a wrong shape for the sub-model: INVALID_ARGUMENT, naming both models
        return await ctx.infer("echo", [NamedTensor.from_array("input", np.zeros((1, 3), np.float32))])
    if mode == 3:    # a model missing from depends_on
        return await ctx.infer("unlisted", inputs)
    if mode in (4, 5):  # two sub-calls in a TaskGroup (Python 3.11's fan-out), one or both refused
        wrong = [NamedTensor.from_array("input", np.zeros((1, 3), np.float32))]
        async with asyncio.TaskGroup() as group:
            group.create_task(ctx.infer("echo", wrong))
            group.create_task(ctx.infer("echo", wrong if mode == 5 else inputs))
    if mode == 8:    # a model missing from depends_on, called in a TaskGroup
        async with asyncio.TaskGroup() as group:
            group.create_task(ctx.infer("unlisted", inputs))
    if mode == 9:    # outputs the sub-model does not have: the orchestration's mistake, not the client's
        return await ctx.infer("echo", inputs, outputs=["outptu"])
    if mode == 10:   # an output asked for twice
        return await ctx.infer("echo", inputs, outputs=["output", "output"])
    if mode == 11:   # caught as the InvalidArgument it was to the orchestration
        try:
            return await ctx.infer("echo", inputs, outputs=["outptu"])
        except InvalidArgument:
            return [NamedTensor.from_array("output", np.full_like(x.data, -2))]
    if mode == 6:    # a group of an error of the orchestration's own beside a sub-call's: its fault
        raise ExceptionGroup("mixed", [ValueError("own"), ModelFailure("meta model 'errors': sub-call")])
    raise ValueError(f"no mode {mode}")

nereid.register_model(orchestrate=orchestrate)
'''


def test_sub_call_errors_keep_their_status_and_name_both_models(repo, serve) -> None:
    repo.python("failing", main=FAILING_MAIN)
    repo.python("echo")
    repo.python("unlisted")
    add_meta(repo, "errors", ERRORS, ["failing", "echo"])
    server = serve(repo.write_config())
    client = server.client

    def call(mode: int):
        return lambda: infer(client, "errors", np.array([mode, 0, 0, 0], np.float32))

    expect_grpc_error("INTERNAL", call(0), "meta model 'errors'", "sub-call to 'failing' failed", "boom")
    np.testing.assert_array_equal(call(1)(), np.full(4, -1, np.float32))
    expect_grpc_error("INVALID_ARGUMENT", call(2), "meta model 'errors'", "sub-call to 'echo'", "shape [1, 3]")
    # (Found by a README check: with the line of model.py that made the call, as the README says.)
    expect_grpc_error("INTERNAL", call(3), "meta model 'errors'", "ctx.infer('unlisted') refused",
                      "not in depends_on", "list every model it calls; called at model.py:21")
    assert statistics(client, "unlisted").inference_count == 0
    expect_grpc_error("INTERNAL", call(7), "meta model 'errors': orchestrate failed at model.py:",
                      "ValueError: no mode 7")
    # (The native hunt: a TaskGroup's group of sub-call errors was INTERNAL "ExceptionGroup: unhandled errors in a
    # TaskGroup", without the sub-model, the tensor or the status.)
    for mode in (4, 5):
        expect_grpc_error("INVALID_ARGUMENT", call(mode), "meta model 'errors'", "sub-call to 'echo'", "shape [1, 3]")
    expect_grpc_error("INTERNAL", call(6), "meta model 'errors': orchestrate failed", "ExceptionGroup: mixed")
    # (A call made in a task it started has no line of model.py on its stack: the task ran the coroutine.)
    expect_grpc_error("INTERNAL", call(8), "meta model 'errors': ctx.infer('unlisted') refused", "not in depends_on")
    # (Noticed by the stop 56 meta hunt: INVALID_ARGUMENT, the client's fault, for names the orchestration chose.)
    expect_grpc_error("INTERNAL", call(9), "meta model 'errors': ctx.infer('echo', ..., outputs=['outptu']) refused: "
                      "model 'echo': unknown requested output 'outptu' (outputs: 'output'); called at model.py:31")
    expect_grpc_error("INTERNAL", call(10), "ctx.infer('echo', ..., outputs=['output', 'output']) refused: model "
                      "'echo': output 'output' is requested more than once; called at model.py:33")
    np.testing.assert_array_equal(call(11)(), np.full(4, -2, np.float32))


READ_ONLY_OUTPUTS = """
import numpy as np
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (x,) = inputs
    (doubled,) = await ctx.infer("cxx_scale", [NamedTensor.from_array("input", np.tile(x.data, 2)[None, :])])
    (echoed,) = await ctx.infer("echo", inputs)
    refused = 0
    for array in (doubled.data, echoed.data):
        try:
            array += 1
        except ValueError:  # output array is read-only
            refused += 1
    flags = [doubled.data.flags.writeable, echoed.data.flags.writeable]
    return [NamedTensor.from_array("output", np.array([refused, *flags, doubled.data[0, 1]], np.float32))]

nereid.register_model(orchestrate=orchestrate)
"""


def test_a_sub_call_s_outputs_are_read_only_whatever_the_backend_called(repo, serve) -> None:
    """Carried from stop 55: a cxx model's outputs reached the orchestration writable, a python model's read-only,
    so `y.data += b` worked or failed by the backend called."""
    add_shipped(repo, "cxx_scale")
    repo.python("echo")
    add_meta(repo, "reads", READ_ONLY_OUTPUTS, ["cxx_scale", "echo"])
    server = serve(repo.write_config('- name: cxx_scale\n  backend: cxx\n'
                                     '  runtime: {sources: ["$MODEL_FOLDER/scale.cpp"]}\n'
                                     '- name: echo\n- name: reads\n'))
    assert infer(server.client, "reads", X).tolist() == [2, 0, 0, 2 * X[1]]


UNDECODED = """
import nereid
from nereid.errors import InvalidArgument

async def orchestrate(inputs, ctx):
    # A label from bytes that are not UTF-8, decoded as Python decodes file names: a lone surrogate in the text.
    raise InvalidArgument("unknown label " + b"caf\\xe9".decode("utf-8", "surrogateescape"))

nereid.register_model(orchestrate=orchestrate)
"""


def test_an_error_text_holding_a_lone_surrogate_is_answered_once_over_grpc_and_in_a_stream(repo, serve) -> None:
    """Found by a bug hunt: gRPC could not encode such a status message ("Unexpected [UnicodeEncodeError] raised
    by servicer method"), so ModelInfer got no answer until the client's deadline, and a stream answered neither
    that request nor any later one."""
    import queue

    repo.python("echo")
    add_meta(repo, "undecoded", UNDECODED, ["echo"])
    server = serve(repo.write_config())
    client = server.client
    expect_grpc_error("INVALID_ARGUMENT", lambda: infer(client, "undecoded", X, client_timeout=10),
                      "unknown label caf\\udce9")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for model in ("undecoded", "echo"):
            tensor = triton.InferInput("input", [4], "FP32")
            tensor.set_data_from_numpy(X)
            client.async_stream_infer(model, [tensor], request_id=model)
        (_, error), (result, late) = answers.get(timeout=10), answers.get(timeout=10)
    finally:
        client.stop_stream()
    assert "unknown label caf\\udce9" in str(error) and late is None
    np.testing.assert_array_equal(result.as_numpy("output"), X)


RELAY = '''
import nereid

async def orchestrate(inputs, ctx):
    return await ctx.infer("{target}", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def index(client: triton.InferenceServerClient) -> dict[str, dict]:
    return {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}


def test_a_reload_whose_new_version_could_never_be_ready_keeps_the_running_one(repo, serve) -> None:
    """Reloading a serving meta model edited to call a model not deployed (or to close a cycle) swapped the
    new version in: UNAVAILABLE at once, and every meta model calling it with it (Triton keeps the old)."""
    repo.python("echo")
    relay = add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    add_meta(repo, "relay2", RELAY.format(target="relay"), ["relay"])
    server = serve(repo.write_config(server_extra="  strict_readiness: false\n"))
    client = server.client
    manifest = relay / "manifest.yaml"
    for depends_on, why in ((["echo", "not_deployed"], "its new version could not be READY: dependency "
                                                       "'not_deployed' is not a model of this server"),
                            (["echo", "relay2"], "forms a cycle 'relay' -> 'relay2' -> 'relay'")):
        manifest.write_text(manifest.read_text().replace("depends_on: ['echo']", f"depends_on: {depends_on}"))
        expect_grpc_error("INTERNAL", lambda: client.load_model("relay"), "failed to load model 'relay'",
                          "reload failed, the running version keeps serving: ", why)
        models = index(client)
        assert models["relay"]["state"] == models["relay2"]["state"] == "READY", models
        assert why in models["relay"]["reason"]
        np.testing.assert_array_equal(infer(client, "relay2", X), X)  # the running versions serve on
        manifest.write_text(manifest.read_text().replace(f"depends_on: {depends_on}", "depends_on: ['echo']"))
    # (Each refused version was loaded, then discarded: neither counts among the versions that served, nor, found
    # by the accounting hunt, among the loads of nereid_model_load_duration_seconds, which counted both.)
    assert server.server.repository.generation("relay") == 1 == loads_counted(server, "relay")
    client.load_model("relay")  # a reload that can be READY replaces it, as before
    assert index(client)["relay"] == {"name": "relay", "version": "1", "state": "READY"}
    assert server.server.repository.generation("relay") == 2 == loads_counted(server, "relay")


def loads_counted(server, model: str) -> int:
    """``nereid_model_load_duration_seconds_count`` of ``model`` in a scrape of ``server``'s /metrics."""
    return int(scrape(server.server.metrics_port)[("nereid_model_load_duration_seconds_count", (("model", model),))])


def test_in_dynamic_mode_a_load_refused_for_the_models_it_calls_is_tried_again_when_they_change(repo,
                                                                                                   serve) -> None:
    """Found by a bug hunt: a meta model's new version copied in before a model it calls was kept from serving
    (right), and never tried again once that model arrived; a meta model refused for a cycle kept that reason
    after the cycle was broken. Both stayed so until their own folder changed again."""
    repo.python("echo")
    relay = add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    add_meta(repo, "cycle_a", RELAY.format(target="cycle_b"), ["cycle_b"])
    cycle_b = add_meta(repo, "cycle_b", RELAY.format(target="cycle_a"), ["cycle_a"])
    server = serve(repo.write_config(server_extra="  strict_readiness: false\n  watch: true\n"
                                                  "  watch_settle_ms: 100\n"))
    client = server.client
    repository = server.server.repository
    models = index(client)
    assert models["relay"]["state"] == "READY"
    assert "depends_on forms a cycle" in models["cycle_a"]["reason"], models
    # Two models refused for one cycle do not retry each other in turn: their loads stay as they were.
    loads = (repository.generation("cycle_a"), repository.generation("cycle_b"))
    time.sleep(1)
    assert (repository.generation("cycle_a"), repository.generation("cycle_b")) == loads

    # A new version calling a model not there yet is kept from serving, then serves once that model is READY.
    manifest = relay / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("depends_on: ['echo']", "depends_on: ['echo', 'late']"))
    assert wait_until(lambda: "its new version could not be READY" in index(client)["relay"].get("reason", ""))
    running = repository.generation("relay")
    repo.python("late")
    assert wait_until(lambda: index(client)["relay"] == {"name": "relay", "version": "1", "state": "READY"}
                      and repository.generation("relay") > running), index(client)
    assert repository.ready_model("relay").depends_on == ("echo", "late")
    np.testing.assert_array_equal(infer(client, "relay", X), X)

    # The cycle broken by an edit of one of its models: the other loads too.
    (cycle_b / "manifest.yaml").write_text((cycle_b / "manifest.yaml").read_text().replace("['cycle_a']", "['echo']"))
    (cycle_b / "model.py").write_text(textwrap.dedent(RELAY.format(target="echo")))
    assert wait_until(lambda: {index(client)[n]["state"] for n in ("cycle_a", "cycle_b")} == {"READY"}), \
        index(client)
    np.testing.assert_array_equal(infer(client, "cycle_a", X), X)


WIDE_FAN_OUT = '''
import asyncio
import nereid

async def orchestrate(inputs, ctx):
    results = await asyncio.gather(*(ctx.infer("{target}", inputs) for _ in range(6)))
    return [type(results[0][0])("output", inputs[0].dtype, sum(r[0].data for r in results))]

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_fan_out_wider_than_a_sub_models_queue_waits_for_room_and_is_served(repo, serve) -> None:
    """Found by the pipelines hunt: a sub-call that found the sub-model's queue full was refused at once, so a
    fan-out wider than its queue_capacity failed every request, on an idle server, "retry later". A sub-call now
    waits for room, as a gRPC stream's request does (Triton's BLS and ensemble sub-requests queue); no failure
    is counted, for either model (before, a bug hunt had the refusal counted as the meta model's own queue_full)."""
    add_counting(repo, "worker", sleep_s=0.05)
    add_meta(repo, "relay", WIDE_FAN_OUT.format(target="worker"), ["worker"])
    server = serve(repo.write_config("- name: relay\n- name: worker\n  queue_capacity: 2\n"
                                     "  batching: {enabled: false}\n"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(infer, triton.InferenceServerClient(server.url), "relay", X) for _ in range(3)]
        answers = [call.result(60) for call in calls]
    assert all(np.array_equal(answer, X * 6) for answer in answers), answers
    samples = scrape(server.server.metrics_port)
    assert not [key for key in samples if key[0] == "nereid_request_failure_total" and samples[key]], samples



BLOCKING_RELAY = '''
import nereid

def orchestrate(inputs, ctx):
    return ctx.infer("{target}", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_plain_def_orchestration_no_thread_could_start_for_is_unavailable_and_never_runs(repo, serve,
                                                                                          monkeypatch) -> None:
    """Found by the resource-limits hunt: a plain def orchestration whose thread could not start (ulimit -u) was
    answered INTERNAL as the orchestration's fault, and ran all the same once a thread came, its sub-calls too."""
    worker = add_counting(repo, "worker")
    add_meta(repo, "relay", BLOCKING_RELAY.format(target="worker"), ["worker"])
    server = serve(repo.write_config())
    refused = fail_thread_starts(monkeypatch, "nereid-meta-relay_")
    expect_grpc_error("UNAVAILABLE", lambda: infer(server.client, "relay", X),
                      "model 'relay': the server could not start a thread for this run (RuntimeError: can't start "
                      "new thread: a process or thread limit", "try again later")
    assert refused == ["nereid-meta-relay_0"]
    np.testing.assert_array_equal(infer(server.client, "relay", X), X)
    assert calls(worker) == 1  # (the refused one, queued, ran its sub-call ahead of this one)
    assert statistics(server.client, "relay").execution_count == 1
    samples = scrape(server.server.metrics_port)
    assert samples[("nereid_request_failure_total", (("model", "relay"), ("reason", "unavailable")))] == 1


def test_a_dependency_unlisted_by_an_edit_is_named_not_listed_in_its_callers_reasons(repo, serve) -> None:
    """Found by the hunt of live edits: once nereid.yaml no longer listed a model, its callers said it was "not
    ready (UNAVAILABLE: unloaded)", as though a client had unloaded it, where the model itself said "not listed"."""
    from support import wait_until

    repo.python("echo")
    add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    watched = "  watch: true\n  watch_settle_ms: 100\n  strict_readiness: false\n"
    server = serve(repo.write_config("- name: echo\n- name: relay\n", server_extra=watched))
    assert server.client.is_model_ready("relay")
    repo.write_config("- name: relay\n", server_extra=watched)
    assert wait_until(lambda: "UNAVAILABLE" in index(server.client)["echo"].get("state", ""), 20)
    assert wait_until(lambda: "not listed" in index(server.client)["relay"].get("reason", ""), 5), \
        index(server.client)["relay"]
    assert index(server.client)["relay"]["reason"].startswith("dependency 'echo' is not ready (UNAVAILABLE: not "
                                                               "listed in nereid.yaml")


def test_depends_on_readiness_cycles_and_bad_folders(repo, serve) -> None:
    repo.python("echo")
    add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    add_meta(repo, "relay2", RELAY.format(target="relay"), ["relay"])  # a meta model calling a meta model
    add_meta(repo, "cycle_a", RELAY.format(target="cycle_b"), ["cycle_b"])
    add_meta(repo, "cycle_b", RELAY.format(target="cycle_a"), ["cycle_a"])
    add_meta(repo, "with_program", RELAY.format(target="echo"), ["echo"])
    (repo.models_dir / "with_program" / "model.mlir").write_bytes(b"not a program")
    add_meta(repo, "without_model_py", RELAY.format(target="echo"), ["echo"])
    (repo.models_dir / "without_model_py" / "model.py").unlink()
    add_meta(repo, "orphan", RELAY.format(target="ghost"), ["ghost"])
    server = serve(repo.write_config(server_extra="  strict_readiness: false\n"))
    client = server.client

    assert client.is_model_ready("relay") and client.is_model_ready("relay2")
    np.testing.assert_array_equal(infer(client, "relay2", X), X)
    models = index(client)
    for name in ("cycle_a", "cycle_b"):
        assert models[name]["state"] == "UNAVAILABLE"
        assert "depends_on forms a cycle" in models[name]["reason"]
    assert "'cycle_a' -> 'cycle_b' -> 'cycle_a'" in models["cycle_a"]["reason"]
    assert "holds program or weights files (model.mlir)" in models["with_program"]["reason"]
    assert "has no model.py" in models["without_model_py"]["reason"]
    assert models["orphan"]["state"] == "UNAVAILABLE"
    assert "dependency 'ghost' is not a model of this server" in models["orphan"]["reason"]

    # Unloading a dependency: its callers (and theirs) are not ready, with the reason.
    client.unload_model("echo")
    assert not client.is_model_ready("relay") and not client.is_model_ready("relay2")
    models = index(client)
    assert models["relay"]["state"] == "UNAVAILABLE"
    assert "dependency 'echo' is not ready (UNAVAILABLE: unloaded)" in models["relay"]["reason"]
    assert "dependency 'relay' is not ready" in models["relay2"]["reason"]
    expect_grpc_error("UNAVAILABLE", lambda: infer(client, "relay2", X), "model 'relay2' is not ready",
                      "dependency 'relay'")
    # Found by a bug hunt: listed in ModelStatistics, it counted none of the requests it refused (its
    # nereid_protocol_requests_total did).
    assert statistics(client, "relay2").inference_stats.fail.count == 1
    # Loading a caller while a model it calls is unloaded: it is loaded, and waits. Defect: the load answered
    # INTERNAL "failed to load model", and the model turned READY later by itself.
    client.unload_model("relay")
    expect_grpc_error("UNAVAILABLE", lambda: client.load_model("relay"), "model 'relay' is loaded but not ready: "
                      "dependency 'echo' is not ready (UNAVAILABLE: unloaded); it becomes READY by itself once "
                      "every model it calls is READY")
    assert index(client)["relay"]["state"] == "UNAVAILABLE"
    # Loading it again makes them ready again.
    client.load_model("echo")
    assert client.is_model_ready("relay") and client.is_model_ready("relay2")
    np.testing.assert_array_equal(infer(client, "relay2", X), X)

    # unload_dependents, by Triton's rule: the models a meta model calls were loaded on their own
    # (nereid never loads one along with its caller), so they stay; over HTTP as well.
    assert "model_repository(unload_dependents)" in client.get_server_metadata().extensions
    client.unload_model("relay2", unload_dependents=True)
    assert not client.is_model_ready("relay2") and client.is_model_ready("relay") and client.is_model_ready("echo")
    http = triton_http.InferenceServerClient(f"127.0.0.1:{server.server.http_port}")
    http.unload_model("relay", unload_dependents=True)
    assert not client.is_model_ready("relay") and client.is_model_ready("echo")


MLP_RELAY = '''
import nereid

async def orchestrate(inputs, ctx):
    return await ctx.infer("mlp_bundle", inputs)

nereid.register_model(orchestrate=orchestrate)
'''

MLP_TENSORS = ("client_inputs: [{name: input, dtype: f32, shape: an, dims: {a: 16}}]\n"
               "client_outputs: [{name: output, dtype: f32, shape: an, dims: {a: 4}}]\n"
               "batching: {max_batch_size: 32}\n")


def test_sub_calls_batch_with_direct_traffic(repo, serve) -> None:
    add_shipped(repo, "mlp_bundle")
    add_meta(repo, "mlp_relay", MLP_RELAY, ["mlp_bundle"], tensors=MLP_TENSORS)
    # mlp_bundle waits up to 10 s for company, and runs as soon as 8 rows are queued.
    server = serve(repo.write_config("""
        - {name: mlp_bundle, batching: {max_queue_delay_ms: 10000, preferred_batch_sizes: [8]}}
        - {name: mlp_relay}
    """))
    rows = np.random.default_rng(3).normal(size=(8, 16)).astype(np.float32)

    def one(index: int) -> np.ndarray:
        client = triton.InferenceServerClient(server.url)
        try:
            tensor = triton.InferInput("input", [1, 16], "FP32")
            tensor.set_data_from_numpy(rows[index:index + 1])
            return client.infer("mlp_relay" if index % 2 else "mlp_bundle", [tensor]).as_numpy("output")
        finally:
            client.close()

    # 4 requests through the meta model and 4 direct ones, at once.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    direct = server.client
    tensor = triton.InferInput("input", [8, 16], "FP32")
    tensor.set_data_from_numpy(rows)
    expected = direct.infer("mlp_bundle", [tensor]).as_numpy("output")
    np.testing.assert_allclose(np.concatenate(results), expected, rtol=1e-5, atol=1e-6)

    # The 8 rows ran as one execution of 8 (then the check's own batch of 8): a batch of 8 from
    # 4 + 4 single-row requests holds both kinds.
    mlp = statistics(direct, "mlp_bundle")
    assert {b.batch_size: b.compute_infer.count for b in mlp.batch_stats} == {8: 2}
    assert mlp.inference_count == 16
    meta = statistics(direct, "mlp_relay")
    assert (meta.inference_count, meta.execution_count) == (4, 4)  # the meta model's own requests never batch

    # Under load: 64 requests from 16 clients at once through the meta model, each answered correctly.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: one(2 * (i % 4) + 1), range(64)))
    for i, result in enumerate(results):
        np.testing.assert_allclose(result, expected[2 * (i % 4) + 1:2 * (i % 4) + 2], rtol=1e-5, atol=1e-6)


ONCE = '''
import asyncio
from pathlib import Path
import nereid
import nereid.errors

async def orchestrate(inputs, ctx):
    with open(Path(__file__).parent / "runs.txt", "a") as runs:
        runs.write("run\\n")
    await asyncio.sleep(0.6)
    if inputs[0].data[0] == 0:
        raise nereid.errors.Unavailable("the orchestration gave up")
    return await ctx.infer("echo", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def test_an_orchestration_runs_once_and_its_failure_counts_across_reloads_and_unloads(repo, serve) -> None:
    repo.python("echo")
    folder = add_meta(repo, "once", ONCE, ["echo"])
    server = serve(repo.write_config())
    client = server.client
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Its Unavailable while a reload made a new version READY: the request is not run again there.
        running = pool.submit(infer, client, "once", np.zeros(4, np.float32))
        time.sleep(0.2)
        client.load_model("once")
        with pytest.raises(InferenceServerException, match="meta model .once.: the orchestration gave up"):
            running.result(timeout=30)
        assert (folder / "runs.txt").read_text() == "run\n"
        # Its sub-call failing because the dependency was unloaded meanwhile (the meta model then is not
        # READY either): still one answer, and one failure in its statistics.
        running = pool.submit(infer, client, "once", X + 1)
        time.sleep(0.2)
        client.unload_model("echo")
        with pytest.raises(InferenceServerException, match="sub-call to 'echo' failed"):
            running.result(timeout=30)
    assert (folder / "runs.txt").read_text() == "run\nrun\n"
    # Statistics carry across the reload (the first failure was the replaced version's): both count once.
    assert statistics(client, "once").inference_stats.fail.count == 2


THREE_STEPS = '''
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (x,) = inputs
    for _ in range(3):
        (x,) = await ctx.infer("step", [NamedTensor("input", x.dtype, x.data)])
    return [NamedTensor("output", x.dtype, x.data)]

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_client_that_goes_away_stops_its_orchestration_whether_it_queued_or_not(repo, serve) -> None:
    step = add_counting(repo, "step", 0.3)
    add_meta(repo, "three_steps", THREE_STEPS, ["step"])
    # queue_capacity 1: one orchestration at a time, so the second request waits in the queue first.
    server = serve(repo.write_config("- name: three_steps\n  queue_capacity: 1\n- name: step\n"))
    client = server.client
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(X)
    first = client.async_infer("three_steps", [tensor], lambda result, error: None)
    second = client.async_infer("three_steps", [tensor], lambda result, error: None)
    # (The review of the tests: fixed sleeps let both cancels land before either ran, on a slow machine.)
    assert wait_until(lambda: calls(step, "started.txt") == 1)
    first.cancel()  # started at once, in its caller's task; now inside its first step
    assert wait_until(lambda: calls(step, "started.txt") == 2)
    second.cancel()  # started by the batcher once the first stopped; now inside its first step
    time.sleep(1.5)  # what a forgotten orchestration would use to issue its other steps
    assert (calls(step, "started.txt"), calls(step)) == (2, 2), \
        "each cancelled orchestration may finish the step it was in, and issue no other"
    np.testing.assert_array_equal(infer(client, "three_steps", X), X)  # and the model serves on
    assert calls(step) == 5


SWALLOWS_ITS_CANCEL = '''
import asyncio
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (x,) = inputs
    try:
        (x,) = await ctx.infer("step", [NamedTensor("input", x.dtype, x.data)])
    except asyncio.CancelledError:  # its client went away: it carries on all the same
        for _ in range(3):
            try:
                await ctx.infer("step", [NamedTensor("input", x.dtype, x.data)])
            except asyncio.CancelledError:
                pass
    return [NamedTensor("output", x.dtype, x.data)]

nereid.register_model(orchestrate=orchestrate)
'''


def test_an_orchestration_that_catches_its_cancel_issues_no_further_sub_call_and_counts_as_cancelled(repo,
                                                                                                     serve) -> None:
    """Found by a bug hunt: an async orchestration that caught the CancelledError of its client's going away
    issued every later sub-call, and its request counted as a success. (A first fix read the task's
    ``cancelling()``, which a TaskGroup also leaves set on Python 3.11: test_model_load.py keeps that case.)"""
    step = add_counting(repo, "step", 0.3)
    add_meta(repo, "stubborn", SWALLOWS_ITS_CANCEL, ["step"])
    server = serve(repo.write_config("- name: stubborn\n- name: step\n"))
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(X)
    call = server.client.async_infer("stubborn", [tensor], lambda result, error: None)
    assert wait_until(lambda: calls(step, "started.txt") == 1)
    call.cancel()
    time.sleep(1.2)  # what its three further steps would take
    assert calls(step, "started.txt") == 1
    stats = statistics(server.client, "stubborn").inference_stats
    assert (stats.success.count, stats.fail.count) == (0, 1)
    np.testing.assert_array_equal(infer(server.client, "stubborn", X), X)  # a request of a client that stays runs


NEVER_ENDS = '''
import asyncio
import nereid

async def orchestrate(inputs, ctx):
    while True:  # deaf to its cancellation
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass

nereid.register_model(orchestrate=orchestrate)
'''


def test_an_unload_answers_the_request_of_an_orchestration_deaf_to_its_cancellation(repo, serve,
                                                                                      monkeypatch) -> None:
    """Found by the native hunt: an async orchestration that swallows every CancelledError, running in its
    caller's task, kept its client (no deadline) waiting for ever after its unload abandoned it."""
    from nereid.backends.meta import model

    monkeypatch.setattr(model, "ORCHESTRATION_END_WAIT_S", 0.2)
    add_meta(repo, "deaf", NEVER_ENDS, [])
    server = serve(repo.write_config("- name: deaf\n", server_extra="  shutdown_grace_s: 0.5\n"))
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(X)
    outcome: list = []
    server.client.async_infer("deaf", [tensor], lambda result, error: outcome.append(error))
    time.sleep(0.5)
    server.client.unload_model("deaf")
    assert wait_until(lambda: outcome, timeout_s=10), "never answered"
    assert outcome[0] is not None and outcome[0].status() == "StatusCode.UNAVAILABLE", outcome
    assert "unloaded while this request ran" in outcome[0].message()


def test_a_normal_start_logs_no_warning_for_a_meta_model_waiting_on_a_loading_dependency(repo, serve,
                                                                                          caplog) -> None:
    """Every normal start warned "'relay' is UNAVAILABLE: dependency 'echo' is not ready (LOADING)" before the
    meta model turned READY; a dependency that is only loading is said at INFO. One that failed still warns.
    Defects: a meta model calling a meta model that waited on a LOADING model warned all the same; and each
    level of a chain nested the whole reason of the next (past 4 KiB at a hundred levels)."""
    import threading

    import toy_backends
    from nereid.plugins import make_plugin_manager

    # 'echo' (a toy) loads once 'relay' has said it waits for it: the other order (a starved machine's) had
    # nothing to say (the flaky-test hunt).
    release = repo.root / "echo.release"
    (toy_backends.write_toy(repo.models_dir, "echo") / "gate.txt").write_text(str(release))
    add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    for upper, lower in (("relay2", "relay"), ("relay3", "relay2"), ("relay4", "relay3")):
        add_meta(repo, upper, RELAY.format(target=lower), [lower])
    add_meta(repo, "orphan", RELAY.format(target="ghost"), ["ghost"])
    caplog.set_level(logging.INFO, logger="nereid.repository")

    def release_once_relay_waits() -> None:
        wait_until(lambda: any("model 'relay' is waiting" in r.getMessage() for r in list(caplog.records)), 30)
        release.touch()
    threading.Thread(target=release_once_relay_waits, daemon=True).start()
    server = serve(repo.write_config(server_extra="  strict_readiness: false\n"),
                   manager=make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,)))
    assert wait_until(lambda: server.client.is_model_ready("relay") and server.client.is_model_ready("relay4"), 30)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [message for message in warned if "'relay" in message], warned
    # Nor "UNAVAILABLE" at INFO, which log alerts look for (the operator hunt): said as the wait it is.
    said = [r.getMessage() for r in caplog.records if "'relay'" in r.getMessage().split(":")[0]]
    assert not [line for line in said if "UNAVAILABLE" in line.split(":")[0]], said
    assert said[0].startswith("model 'relay' is waiting for the models it calls: dependency 'echo' is not ready "
                              "(LOADING)"), said
    assert any("model 'orphan' is UNAVAILABLE: dependency 'ghost'" in message for message in warned), warned
    server.client.unload_model("echo")
    reasons = {m.name: m.reason for m in server.client.get_model_repository_index().models}
    root = "dependency 'echo' is not ready (UNAVAILABLE: unloaded)"
    assert reasons["relay"] == root
    assert reasons["relay4"] == f"dependency 'relay3' is not ready (UNAVAILABLE: {root})"  # the root cause
    server.client.load_model("echo")
    assert server.client.is_model_ready("relay4")


def test_a_waiting_meta_model_counts_each_refusal_as_what_its_client_was_told(repo, serve) -> None:
    """Found by the accounting hunt: a meta model loaded but waiting for a model it calls counted an unreadable
    chunked body (answered 400) as "unavailable", and a wrong version (404) not at all; and over HTTP a version
    that is no number was counted nowhere, where gRPC counted it."""
    repo.python("echo")
    add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    server = serve(repo.write_config())
    server.client.unload_model("echo")
    assert not server.client.is_model_ready("relay")
    answer = unreadable_chunked_infer(server.server.http_port, "relay")
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(X)
    expect_grpc_error("NOT_FOUND", lambda: server.client.infer("relay", [tensor], model_version="7"), "version '7'")
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{server.server.http_port}/v2/models/relay/versions/abc/infer", b'{"inputs": []}'),
            timeout=10)
    assert refused.value.code == 400
    failures = {dict(labels)["reason"]: value for (name, labels), value in scrape(server.server.metrics_port).items()
                if name == "nereid_request_failure_total" and dict(labels)["model"] == "relay"}
    assert failures == {"invalid_argument": 2, "not_found": 1}, failures


STRAY_NEXT = '''
import nereid

def orchestrate(inputs, ctx):  # a plain def: it runs on a worker thread
    if inputs[0].data[0] == 0:
        next(iter(()))
    return ctx.infer("echo", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_blocking_orchestration_raising_stop_iteration_is_answered(repo, serve) -> None:
    # No asyncio future can carry a StopIteration: the request waited until its deadline, or for ever.
    repo.python("echo")
    add_meta(repo, "stray", STRAY_NEXT, ["echo"])
    client = serve(repo.write_config()).client
    with pytest.raises(InferenceServerException, match="StopIteration raised"):
        infer(client, "stray", np.zeros(4, np.float32), client_timeout=20)
    np.testing.assert_array_equal(infer(client, "stray", X + 1), X + 1)  # and it serves on


NOT_EXCEPTIONS = '''
import asyncio, sys
import nereid

class Fatal(BaseException):
    pass

async def helper(how):
    await asyncio.sleep(0)
    if how == 1:
        sys.exit(0)
    raise KeyboardInterrupt("from a helper")

async def orchestrate(inputs, ctx):
    how = int(inputs[0].data[0])
    if how in (1, 2):
        await asyncio.gather(helper(how))
    if how == 3:
        raise GeneratorExit("from the orchestration")
    if how == 4:
        raise Fatal("of the author's own")
    return await ctx.infer("echo", inputs)

nereid.register_model(orchestrate=orchestrate)
'''

NOT_EXCEPTIONS_ON_A_THREAD = '''
import nereid

def orchestrate(inputs, ctx):  # a plain def: it runs on a worker thread
    if inputs[0].data[0] == 5:
        raise GeneratorExit("from a thread")
    return ctx.infer("echo", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


@pytest.mark.parametrize("how, model, said", [
    (1, "exits", "a task its orchestration started raised SystemExit: 0"),
    (2, "exits", "a task its orchestration started raised KeyboardInterrupt: from a helper"),
    (3, "exits", "orchestrate failed at model.py:19: GeneratorExit: from the orchestration"),
    (4, "exits", "orchestrate failed at model.py:21: Fatal: of the author's own"),
    # It read "orchestrate failed: GeneratorExit": thrown into the awaiting coroutines, a GeneratorExit closes each
    # inner one with a bare GeneratorExit() first, so its message and line were lost on the way from the thread.
    (5, "exits_on_a_thread", "orchestrate failed at model.py:6: RuntimeError: GeneratorExit raised: from a thread"),
], ids=["sys.exit in a gathered task", "KeyboardInterrupt in a gathered task", "GeneratorExit", "a BaseException",
        "GeneratorExit on a thread"])
def test_what_is_no_exception_fails_the_request_and_never_the_server(repo, serve, how, model, said) -> None:
    """Defects (found by a bug hunt): a sys.exit() or KeyboardInterrupt in a task the orchestration started (the
    README's own fan-out with asyncio.gather) escaped the event loop and ended `nereid serve` without a word; a
    GeneratorExit, or a BaseException of the author's, left the request unanswered and uncounted."""
    repo.python("echo")
    add_meta(repo, "exits", NOT_EXCEPTIONS, ["echo"])
    add_meta(repo, "exits_on_a_thread", NOT_EXCEPTIONS_ON_A_THREAD, ["echo"])
    client = serve(repo.write_config()).client
    with pytest.raises(InferenceServerException) as caught:
        infer(client, model, np.full(4, how, np.float32), client_timeout=20)
    assert caught.value.status() == "StatusCode.INTERNAL" and f"meta model '{model}': {said}" in str(caught.value)
    assert statistics(client, model).inference_stats.fail.count == 1
    np.testing.assert_array_equal(infer(client, model, X + 10), X + 10)  # it serves on, and so does the server


ASYNC_CALLABLE = '''
import nereid

class Relay:
    async def __call__(self, inputs, ctx):
        return await ctx.infer("echo", inputs)

nereid.register_model(orchestrate=Relay())
'''


def test_an_object_with_an_async_call_orchestrates_on_the_event_loop(repo, serve) -> None:
    """Defect (found by a bug hunt): only an async def counted as async, so an object whose __call__ is one ran on a
    worker thread, where its coroutine never ran: every request failed ('got coroutine')."""
    repo.python("echo")
    add_meta(repo, "relay_object", ASYNC_CALLABLE, ["echo"])
    server = serve(repo.write_config())
    np.testing.assert_array_equal(infer(server.client, "relay_object", X + 3), X + 3)
    assert server.server.repository.entry("relay_object").loaded.backend.runtime_report().summary == (
        "depends_on=echo orchestrate=async")


HOLD_THEN_STEP = '''
import time
from pathlib import Path

import nereid

def orchestrate(inputs, ctx):  # a plain def: it runs on a worker thread
    with open(Path(__file__).parent / "started.txt", "a") as started:
        started.write("1\\n")
    time.sleep(float(inputs[0].data[0]))  # holds the thread for input[0] seconds
    return ctx.infer("step", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_plain_def_orchestration_whose_client_left_drops_its_sub_call_and_a_waiting_one_never_starts(
        repo, serve) -> None:
    """Defects: the sub-call a thread waited on ran though its client had gone; and a request waiting for a
    thread still busy with an abandoned orchestration started long past its deadline."""
    step = add_counting(repo, "step", 1.0)
    meta = add_meta(repo, "hold", HOLD_THEN_STEP, ["step"])
    # queue_capacity 1: one orchestration thread.
    client = serve(repo.write_config("- name: hold\n  queue_capacity: 1\n- name: step\n")).client

    def send(model: str, array: np.ndarray):
        tensor = triton.InferInput("input", [4], "FP32")
        tensor.set_data_from_numpy(array.astype(np.float32))
        return client.async_infer(model, [tensor], lambda result, error: None)

    # (Each step waited for, not slept over: the flaky-test hunt.)
    send("step", X)  # holds step for 1 s
    assert wait_until(lambda: calls(step, "started.txt") == 1)
    leaving = send("hold", np.zeros(4))  # its sub-call queues behind it
    assert wait_until(lambda: calls(meta, "started.txt") == 1)
    time.sleep(0.15)  # (its sub-call issued)
    leaving.cancel()
    assert wait_until(lambda: calls(step) == 1)  # the running one ended
    time.sleep(0.5)  # what the queued one, had it been kept, needed to start
    assert calls(step, "started.txt") == 1, "the queued sub-call of a request whose client left was run"
    holding = send("hold", np.array([0.8, 0, 0, 0]))  # keeps the only thread 0.8 s
    assert wait_until(lambda: calls(meta, "started.txt") == 2)
    holding.cancel()  # the model's slot is free again; its thread is not
    expect_grpc_error("DEADLINE_EXCEEDED", lambda: infer(client, "hold", np.zeros(4, np.float32), client_timeout=0.2))
    time.sleep(0.9)
    assert len((meta / "started.txt").read_text().splitlines()) == 2, "an orchestration started past its deadline"
    np.testing.assert_array_equal(infer(client, "hold", np.zeros(4, np.float32)), np.zeros(4))  # it serves on


def test_a_request_waiting_for_a_busy_orchestration_thread_is_answered_at_its_deadline(repo, serve) -> None:
    """Found by the meta read hunt: a request whose deadline passed while every orchestration thread was busy was
    answered only once one freed, seconds late (never, behind an orchestration that hung), where a request in the
    scheduler's queue is answered at its deadline."""
    add_counting(repo, "step")
    meta = add_meta(repo, "hold", HOLD_THEN_STEP, ["step"])
    server = serve(repo.write_config("- name: hold\n  queue_capacity: 1\n- name: step\n"))  # one thread
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(np.array([3, 0, 0, 0], np.float32))
    holding = server.client.async_infer("hold", [tensor], lambda result, error: None)  # the only thread, 3 s
    assert wait_until(lambda: (meta / "started.txt").is_file())
    holding.cancel()  # its slot in the scheduler is free once its client has gone: the thread is not
    http = triton_http.InferenceServerClient(f"127.0.0.1:{server.server.http_port}")
    waiting = triton_http.InferInput("input", [4], "FP32")
    waiting.set_data_from_numpy(np.zeros(4, np.float32))
    began = time.monotonic()
    with pytest.raises(InferenceServerException) as late:
        http.infer("hold", [waiting], timeout=300_000)  # (microseconds: 0.3 s)
    assert time.monotonic() - began < 2.0, "answered once the thread freed, not at its deadline"
    assert "for a thread to start its orchestration, which did not run" in late.value.message(), late.value
    assert len((meta / "started.txt").read_text().splitlines()) == 1


def test_a_sub_call_whose_run_could_not_start_leaves_the_meta_model_s_own_run_counted(repo, serve) -> None:
    """The review hunt of 2aabc24: a sub-model's run that a server limit kept from starting (RunNotStarted) kept its
    kind through the sub-call, so the meta model's own scheduler counted its orchestration, which ran, as no
    execution."""
    from nereid.backends.subprocess.runner import run_not_started

    repo.python("echo")
    add_meta(repo, "relay", RELAY.format(target="echo"), ["echo"])
    server = serve(repo.write_config())
    backend = server.server.repository.ready_model("echo").backend

    def at_a_limit(inputs):
        raise run_not_started("echo", errno.EAGAIN, "Resource temporarily unavailable")

    backend.infer = at_a_limit
    expect_grpc_error("UNAVAILABLE", lambda: infer(server.client, "relay", X),
                      "meta model 'relay': sub-call to 'echo' failed: model 'echo': the server could not start a run")
    samples = scrape(server.server.metrics_port)  # (failed executions count there, as batches)
    assert samples[("nereid_batch_size_count", (("model", "relay"),))] == 1  # its orchestration ran
    assert samples.get(("nereid_batch_size_count", (("model", "echo"),)), 0) == 0  # the sub-model's run did not


LATE_SUB_CALL = '''
import asyncio

import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    loop = asyncio.get_running_loop()
    # A sub-call a loop callback asks for after the orchestration has returned (fire and forget, done late).
    loop.call_later(0.2, lambda: loop.create_task(ctx.infer("step", inputs)).add_done_callback(
        lambda task: task.exception()))
    return [NamedTensor.from_array("output", inputs[0].data)]

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_sub_call_asked_for_after_the_orchestration_ended_is_not_issued(repo, serve) -> None:
    """Found by the meta read hunt: a sub-call an async orchestration's loop callback asked for after it returned
    ran after its request was answered (the end takes only the tasks made before it), where the blocking ctx
    refuses one."""
    step = add_counting(repo, "step")
    add_meta(repo, "late", LATE_SUB_CALL, ["step"])
    client = serve(repo.write_config()).client
    np.testing.assert_array_equal(infer(client, "late", X), X)
    time.sleep(0.6)
    assert calls(step) == 0, "a sub-call was issued after the orchestration had ended"


def test_a_fault_met_through_a_meta_model_is_logged_once_where_it_happened(repo, serve, caplog) -> None:
    """Defect: a sub-model's fault was logged twice, once for the sub-model and again for the meta model that
    called it; an orchestration's own exception was too (its traceback, then the scheduler's line). One fault
    is one ERROR line now, and the client's answer is unchanged."""
    repo.python("failing", main=FAILING_MAIN)
    repo.python("echo")
    add_meta(repo, "errors", ERRORS, ["failing", "echo"])
    add_meta(repo, "outer", RELAY.format(target="errors"), ["errors"])  # a fault two meta models away
    client = serve(repo.write_config()).client
    caplog.set_level(logging.ERROR)

    def errors_logged(model: str, mode: int) -> list[logging.LogRecord]:
        caplog.clear()
        expect_grpc_error("INTERNAL", lambda: infer(client, model, np.array([mode, 0, 0, 0], np.float32)),
                          f"meta model '{model}'")
        return [r for r in caplog.records if r.levelno >= logging.ERROR]

    for model in ("errors", "outer"):
        (line,) = errors_logged(model, 0)  # the sub-model's fault: its own line only
        assert line.getMessage() == "model 'failing' exited with code 3; output tail: boom: the sub-model broke"
        (line,) = errors_logged(model, 7)  # the orchestration's exception: one line, with its traceback
        assert line.getMessage().startswith("meta model 'errors': orchestrate failed at model.py:"), line.getMessage()
        assert line.getMessage().endswith("ValueError: no mode 7") and line.exc_info[0] is ValueError
    (line,) = errors_logged("errors", 3)  # the meta model's own refusal is still logged, once
    assert "ctx.infer('unlisted') refused" in line.getMessage()


def test_a_meta_model_s_faults_share_one_log_budget(repo, serve, caplog) -> None:
    """Defect: an orchestration's exceptions were limited by a log of the meta model's own, its other faults by its
    scheduler's: two budgets, so 20 lines in 10 s where the README says at most 10 per model."""
    repo.python("failing", main=FAILING_MAIN)
    repo.python("echo")
    add_meta(repo, "errors", ERRORS, ["failing", "echo"])
    client = serve(repo.write_config()).client
    caplog.set_level(logging.ERROR)
    for _ in range(12):
        for mode in (3, 7):  # a refused sub-call (the scheduler's line), the orchestration raising
            expect_grpc_error("INTERNAL", lambda: infer(client, "errors", np.array([mode, 0, 0, 0], np.float32)),
                              "meta model 'errors'")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("meta model 'errors'")]
    assert len(lines) == 10, lines


def test_a_sub_call_task_cancelled_before_it_starts_is_not_reported_as_never_awaited() -> None:
    """Found by a bug hunt: a client leaving in the loop turn in which asyncio.gather() made an orchestration's
    sub-call tasks got "RuntimeWarning: coroutine 'MetaContext.infer' was never awaited" logged, telling the
    operator the model's author forgot an await."""
    import gc
    import warnings

    from nereid.backends.meta.model import _ORCHESTRATING, _Orchestration, contain_orchestration_tasks

    async def sub_call() -> None:
        await asyncio.sleep(0)

    async def orchestrate() -> None:
        contain_orchestration_tasks(asyncio.get_running_loop())
        token = _ORCHESTRATING.set(_Orchestration("relay"))
        try:
            task = asyncio.ensure_future(sub_call())
        finally:
            _ORCHESTRATING.reset(token)
        task.cancel()  # before its first step
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(orchestrate())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


ORDERED = '''
import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    row = inputs[0].data.reshape(1, 16)
    ab = [NamedTensor.from_array("a", row), NamedTensor.from_array("b", row)]
    prod, total = await ctx.infer("multi_sumprod", ab, outputs=["prod", "sum"])
    assert (prod.name, total.name) == ("prod", "sum"), (prod.name, total.name)
    (only,) = await ctx.infer("multi_sumprod", ab, outputs=["sum"])
    return [NamedTensor.from_array("output", (prod.data - total.data + only.data).reshape(16))]

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_sub_call_s_outputs_come_in_the_order_asked_for(repo, serve) -> None:
    """Found by a bug hunt: ctx.infer(..., outputs=["prod", "sum"]) returned them in the model's declared order
    (sum, prod), so unpacking them by position, as the README's examples do, silently swapped the two."""
    add_shipped(repo, "multi_sumprod")
    add_meta(repo, "ordered", ORDERED, ["multi_sumprod"],
             tensors="client_inputs: [{name: input, dtype: f32, shape: a, dims: {a: 16}}]\n"
                     "client_outputs: [{name: output, dtype: f32, shape: a, dims: {a: 16}}]\n")
    server = serve(repo.write_config())
    x = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(infer(server.client, "ordered", x), x * x)  # x*x - 2x + 2x


# An orchestration holding a large local that answers (input 0) or fails: it raises (1), its sub-call to 'leaf'
# fails (2: leaf raises, INTERNAL) or is refused (3: a wrong shape, INVALID_ARGUMENT). ASYNC is replaced by
# "async " or "", AWAIT by "await " or "". Each large local is kept, weakly, in the test's module nereid_test_kept.
LARGE_LOCAL_FAILS = '''
import weakref
import numpy as np
import nereid
import nereid_test_kept
from nereid.tensors import NamedTensor

ASYNCdef orchestrate(inputs, ctx):
    large = np.ones(1 << 20, np.float32)
    nereid_test_kept.refs.append(weakref.ref(large))
    how = int(inputs[0].data[0])
    if how == 0:
        return [NamedTensor.from_array("output", inputs[0].data + large[:4] - 1)]
    if how == 1:
        raise ValueError("failing with a large local")
    if how == 2:
        return AWAITctx.infer("leaf", inputs)
    return AWAITctx.infer("leaf", [NamedTensor.from_array("input", large[:3])])

nereid.register_model(orchestrate=orchestrate)
'''

LEAF_FAILS = '''
import nereid

async def orchestrate(inputs, ctx):
    raise RuntimeError("the leaf broke")

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_failed_orchestration_s_frames_are_freed_once_it_is_answered_without_a_collection(repo, serve,
                                                                                           monkeypatch) -> None:
    """Found by the meta hunt: an orchestration that failed (its own exception, or a sub-call's error it let out)
    kept its frame, with every input and intermediate, until a garbage collection: the error's traceback held the
    frames that had run it, whose locals held the error back (the orchestration's task, the plain def's futures),
    a cycle reference counting cannot free. 8 failing requests each holding a 100 MB local took the server from
    730 to 1,207 MiB."""
    import sys
    import types
    import weakref

    from support import reference_counting_only

    kept = types.ModuleType("nereid_test_kept")
    kept.refs: list[weakref.ref] = []
    monkeypatch.setitem(sys.modules, "nereid_test_kept", kept)
    add_meta(repo, "leaf", LEAF_FAILS, [])
    add_meta(repo, "fails_async", LARGE_LOCAL_FAILS.replace("ASYNC", "async ").replace("AWAIT", "await "), ["leaf"])
    add_meta(repo, "fails_plain", LARGE_LOCAL_FAILS.replace("ASYNC", "").replace("AWAIT", ""), ["leaf"])
    server = serve(repo.write_config())
    kept_alive = []
    with reference_counting_only():
        for model in ("fails_async", "fails_plain"):
            for how, status, said in ((1, "INTERNAL", "ValueError: failing with a large local"),
                                      (2, "INTERNAL", "sub-call to 'leaf' failed"),
                                      (3, "INVALID_ARGUMENT", "sub-call to 'leaf' failed")):
                expect_grpc_error(status, lambda: infer(server.client, model, np.full(4, how, np.float32)),
                                  f"meta model '{model}'", said)
                ref = kept.refs[-1]
                # (Answered as its frames are let go: waited for, with a generous bound.)
                if not wait_until(lambda: ref() is None, 5):
                    kept_alive.append((model, how))
        np.testing.assert_array_equal(infer(server.client, "fails_async", np.zeros(4, np.float32)), 0)
    assert len(kept.refs) == 7 and kept_alive == []


GLOBAL_HELD = '''
import weakref
import numpy as np
import nereid
import nereid_test_kept

TABLE = np.ones(1 << 20, np.float32)  # (a vocabulary, a lookup table: what a model.py keeps at its top level)
nereid_test_kept.refs.append(weakref.ref(TABLE))

async def orchestrate(inputs, ctx):
    return [nereid.tensors.NamedTensor.from_array("output", inputs[0].data + TABLE[:4] - 1)]

nereid.register_model(orchestrate=orchestrate)
'''


def test_a_retired_versions_model_py_globals_are_freed_without_waiting_for_traffic(repo, serve, monkeypatch) -> None:
    """Found by the meta hunt: a module's functions and its namespace refer to each other, so a reloaded meta
    model's old model.py (its globals: a 100 MB table) stayed until a garbage collection, which an idle server never
    ran: 20 reloads kept up to 8 old copies (1.1 GB). The server collects once after retiring a version."""
    import sys
    import types
    import weakref

    from support import reference_counting_only

    kept = types.ModuleType("nereid_test_kept")
    kept.refs: list[weakref.ref] = []
    monkeypatch.setitem(sys.modules, "nereid_test_kept", kept)
    add_meta(repo, "tabled", GLOBAL_HELD, [])
    server = serve(repo.write_config())
    with reference_counting_only():
        for _ in range(3):
            server.client.load_model("tabled")  # a reload: the old version is retired in the background
        assert len(kept.refs) == 4
        assert wait_until(lambda: [ref() is None for ref in kept.refs] == [True, True, True, False], 10), \
            [ref() is None for ref in kept.refs]
        np.testing.assert_array_equal(infer(server.client, "tabled", np.zeros(4, np.float32)), 0)

