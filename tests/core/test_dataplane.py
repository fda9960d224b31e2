"""The data plane on its own: every question and command the protocol surfaces forward, without a wire."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import toy_backends
from nereid.dataplane import CLIENT_DEADLINE_SLACK_NS, DataPlane, cancellation_reason, past_grace_message
from nereid.dtypes import DType
from nereid.errors import ConfigError, InvalidArgument, ModelFailure, NereidError, NotFound, PermissionDenied, Unavailable
from nereid.plugins import make_plugin_manager
from nereid.repository import ModelRepository
from nereid.settings import load_settings
from nereid.tensors import InferRequest, NamedTensor
from toy_backends import toy_dataplane


def request(name: str = "toy", **kwargs) -> InferRequest:
    return InferRequest(name, [NamedTensor("input", DType.FP32, np.ones((2, 4), np.float32))], **kwargs)


def test_infer_metadata_config_statistics_and_index(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        response = await plane.infer(request(id="r"))
        assert response.id == "r" and response.outputs[0].data.tolist() == [[2.0] * 4] * 2
        metadata = plane.model_metadata("toy")
        assert (metadata.platform, metadata.inputs[0].shape, metadata.versions) == ("toy_platform", (-1, 4), ("1",))
        config = plane.model_config("toy", "1")
        assert (config.backend, config.max_batch_size, config.instance_group.count) == ("toy", 8, 2)
        assert config.dynamic_batching is not None and config.inputs[0].shape == (4,)
        ((name, stats),) = plane.statistics("toy")
        assert name == "toy" and stats.inference_count == 2 and stats.success.count == 1
        index = {e.name: e.state for e in await plane.repository_index()}
        assert index == {"spare": "UNAVAILABLE", "toy": "READY"}
        assert [e.name for e in await plane.repository_index(ready_only=True)] == ["toy"]
        assert plane.ready() and plane.model_ready("toy") and not plane.model_ready("spare")
        await plane.unload("toy")
        assert plane.changes == ["changed", "changed"]
    asyncio.run(scenario())


def test_an_index_reason_naming_a_file_that_is_not_utf8_is_escaped(tmp_path):
    """Found by the review hunt: a reason naming a file (or the configuration file) whose name is not UTF-8 held a
    lone surrogate, which neither gRPC nor HTTP can encode: RepositoryIndex failed for every model (INTERNAL, 500)."""
    plane = toy_dataplane(tmp_path)

    async def scenario():
        plane.repository.entry("spare").reason = "cannot follow the symlink lnk\udce9"
        reasons = {e.name: e.reason for e in await plane.repository_index()}
        assert reasons["spare"] == "cannot follow the symlink lnk\\udce9"
        for reason in reasons.values():
            reason.encode("utf-8")  # (raises for a lone surrogate)
    asyncio.run(scenario())


def test_versions_are_read_as_triton_reads_them(tmp_path):
    """'+1' and '1abc' were NOT_FOUND and 'abc' or '-1' NOT_FOUND (not ready for ModelReady); Triton reads a
    version with std::stol, and answers INVALID_ARGUMENT on every call for one it cannot read."""
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        for version in ("1", "01", "+1", " 1", "1abc", "0" * 40 + "1"):
            assert plane.model_metadata("toy", version).name == "toy" and plane.model_ready("toy", version)
        for version in ("0", "2", "9223372036854775807"):
            with pytest.raises(NotFound, match=f"model 'toy' has no version '{version}'"):
                plane.model_config("toy", version)
            assert not plane.model_ready("toy", version)
        for version, problem in (("abc", "cannot read version 'abc' as a number"), ("-", "cannot read version '-'"),
                                 ("9223372036854775808", "cannot read version '9223372036854775808'"),
                                 ("9" * 5000, "cannot read version '999"), ("-1", "invalid version '-1'")):
            for call in (plane.model_metadata, plane.model_config, plane.statistics, plane.model_ready):
                with pytest.raises(InvalidArgument, match=f"^model 'toy': {problem}"):
                    call("toy", version)
            # Found by a bug hunt: every model's statistics (no name) took any version string.
            with pytest.raises(InvalidArgument, match=f"^statistics of every model: {problem}"):
                plane.statistics("", version)
        assert [name for name, _ in plane.statistics("", "1")] == ["toy"]
    asyncio.run(scenario())


def test_errors_carry_their_meaning(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        with pytest.raises(NotFound, match="model 'toy' has no version '2'"):
            plane.model_metadata("toy", "2")
        for call in (plane.model_metadata, plane.model_config):
            # An unknown model is named as such, whatever version was asked.
            with pytest.raises(NotFound, match="^unknown model 'nope'"):
                call("nope", "2")
        # Statistics of a model or version not there: INVALID_ARGUMENT, as Triton answers them (the Triton client
        # hunt: NOT_FOUND), with the same words.
        with pytest.raises(InvalidArgument, match="^unknown model 'nope'"):
            plane.statistics("nope", "2")
        with pytest.raises(InvalidArgument, match="^model 'toy' has no version '2'"):
            plane.statistics("toy", "2")
        with pytest.raises(NotFound, match="unknown model 'nope'"):
            await plane.infer(request("nope"))
        with pytest.raises(Unavailable, match="model 'spare' is not ready"):
            await plane.infer(request("spare"))
        # Found by a bug hunt: UNAVAILABLE (503) told a statistics poller to retry; Triton answers INVALID_ARG.
        with pytest.raises(InvalidArgument, match=r"^model 'spare' is not loaded \(UNAVAILABLE\); no statistics$"):
            plane.statistics("spare")
        with pytest.raises(InvalidArgument, match="unknown requested output 'z'"):
            await plane.infer(request(requested_outputs=["z"]))
        # Asked twice (with a classification one time, say): refused, as Triton refuses it; one answer was merged.
        with pytest.raises(InvalidArgument, match="^model 'toy': output 'output' is requested more than once$"):
            await plane.infer(request(requested_outputs=["output", "output"]))
        (tmp_path / "ml-backends" / "spare" / "fail.txt").write_text("no")
        with pytest.raises(ModelFailure, match="failed to load model 'spare'"):
            await plane.load("spare")
        await plane.unload("toy")
    asyncio.run(scenario())


def test_repository_control_off_refuses_load_and_unload(tmp_path):
    plane = toy_dataplane(tmp_path, control=False)

    async def scenario():
        with pytest.raises(PermissionDenied, match="RepositoryModelLoad is turned off"):
            await plane.load("toy")
        with pytest.raises(PermissionDenied, match="RepositoryModelUnload is turned off"):
            await plane.unload("toy")
    asyncio.run(scenario())


def test_load_overrides_are_refused_not_ignored_and_unload_dependents_is_accepted(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        # Defect: a parameter nereid did not know was let through, so files={"1/model.py": ...} (the "file:"
        # prefix forgotten) reloaded from disk and said OK. Triton refuses it: "unrecognized load parameter".
        with pytest.raises(InvalidArgument, match=r"model 'toy': unrecognized load parameter\(s\) '1/model.py', "
                                                  r"'some_future_key' \(Triton's are 'config' and 'file:<path>'"):
            await plane.load("toy", ["some_future_key", "1/model.py", "config"])
        with pytest.raises(InvalidArgument, match=r"model 'spare': load parameters 'config', 'file:1/model.onnx' "
                                                  r"are not supported"):
            await plane.load("spare", ["file:1/model.onnx", "config"])
        assert not plane.model_ready("spare")  # refused before anything was loaded
        await plane.unload("toy", unload_dependents=True)
        assert not plane.model_ready("toy")
    asyncio.run(scenario())


def test_a_request_whose_client_goes_away_is_counted_once_as_cancelled_or_as_its_deadline(tmp_path):
    """A cancel that came before the server's own deadline counted nowhere: success + fail fell short of
    the requests sent (gRPC clients cancel at their own deadline, which starts before the server's)."""
    plane = toy_dataplane(tmp_path)

    async def cancel_while_waiting(deadline_ns: int) -> None:
        task = asyncio.create_task(plane.infer(request(deadline_ns=deadline_ns)))
        await asyncio.sleep(0)  # it waits for its execution on a worker thread now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def scenario():
        await plane.load("toy")
        now = time.monotonic_ns()
        await cancel_while_waiting(0)  # no deadline: the client cancelled
        await cancel_while_waiting(now + 60_000_000_000)  # a minute left: still the client's cancel
        # The client's deadline ended it: within the slack of the server's, which is still ahead when the
        # request arrives (timed from now, not from before the two runs above: a loaded machine took 10 ms there).
        await cancel_while_waiting(time.monotonic_ns() + CLIENT_DEADLINE_SLACK_NS * 4 // 5)
        ((_, stats),) = plane.statistics("toy")
        assert stats.fail.count == 3 and stats.success.count == 0
        assert stats.failures_by_reason == {"cancelled": 2, "deadline_exceeded": 1}
        await plane.unload("toy")
    asyncio.run(scenario())


def test_queue_and_compute_count_the_successful_requests_as_triton_s_do(tmp_path):
    """Found by a bug hunt: requests whose client left while their execution ran were charged its compute
    time, and failed ones their queue time, so perf_analyzer (which divides those times by the success count)
    overstated both, and last_inference moved on requests that were only refused."""
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        await plane.infer(request())
        with pytest.raises(InvalidArgument):
            await plane.infer(request(requested_outputs=["z"]))
        ((_, stats),) = plane.statistics("toy")
        assert stats.last_inference_ms > 0
        first_inference_ms = stats.last_inference_ms
        task = asyncio.create_task(plane.infer(request()))
        await asyncio.sleep(0)  # its execution runs on a worker thread now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await plane.infer(request())
        ((_, stats),) = plane.statistics("toy")
        assert (stats.success.count, stats.fail.count) == (2, 2)
        assert stats.queue.count == stats.compute_input.count == stats.compute_infer.count == \
            stats.compute_output.count == 2
        assert sum(stats.request_seconds.counts) == sum(stats.queue_seconds.counts) == 2
        assert stats.compute_infer.ns > 0 and stats.last_inference_ms >= first_inference_ms
        await plane.unload("toy")
    asyncio.run(scenario())


def test_cancellation_reason():
    assert cancellation_reason(0, 10**12) == "cancelled"
    assert cancellation_reason(10**12, 10**12 - 2 * CLIENT_DEADLINE_SLACK_NS) == "cancelled"
    assert cancellation_reason(10**12, 10**12 - CLIENT_DEADLINE_SLACK_NS // 2) == "deadline_exceeded"
    assert cancellation_reason(10**12, 10**12 + 1) == "deadline_exceeded"


def test_loading_a_loaded_model_again_keeps_its_statistics_an_unload_resets_them(tmp_path):
    """An explicit load of a READY model reset every counter while a reload that followed the folder kept
    them: Prometheus saw the model's counters go back to 0."""
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        await plane.infer(request())
        await plane.load("toy")  # RepositoryModelLoad of a model already loaded
        await plane.infer(request())
        ((_, stats),) = plane.statistics("toy")
        assert (stats.success.count, stats.inference_count) == (2, 4)
        await plane.unload("toy")
        await plane.load("toy")
        ((_, stats),) = plane.statistics("toy")
        assert (stats.success.count, stats.inference_count) == (0, 0)
        await plane.unload("toy")
    asyncio.run(scenario())


def test_loading_a_loaded_model_whose_folder_is_gone_is_not_found_and_it_serves_on(tmp_path):
    """Found by a README check: the load was INTERNAL, "failed to load", saying the folder went "while it was
    being loaded" though it was gone before; the README's error table says NOT_FOUND."""
    import shutil

    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        shutil.rmtree(tmp_path / "ml-backends" / "toy")
        with pytest.raises(NotFound, match=r"^model 'toy': its folder 'toy' is gone from ml_backends_path, so it "
                                           r"cannot be loaded again; the version loaded before serves on \(nothing follows "
                                           r"the folder without server.watch\)$"):
            await plane.load("toy")
        assert (await plane.infer(request())).outputs[0].data.tolist() == [[2.0] * 4] * 2
        await plane.unload("toy")
    asyncio.run(scenario())


def test_loading_a_loaded_model_again_has_no_downtime_and_a_failure_leaves_it_serving(tmp_path):
    """RepositoryModelLoad of a loaded model unloaded it first: its requests failed UNAVAILABLE meanwhile (so
    did every meta model calling it), and a load that failed left it unloaded. Triton replaces it with no
    loss of availability, and keeps the old version when the new one fails."""
    plane = toy_dataplane(tmp_path)
    states: list[str] = []

    async def scenario():
        await plane.load("toy")
        plane.repository.on_state_change = lambda: states.append(plane.repository.entry("toy").state.value)
        await plane.load("toy")
        assert plane.model_ready("toy") and set(states) == {"READY"}  # never LOADING nor UNLOADING
        (tmp_path / "ml-backends" / "toy" / "fail.txt").write_text("weights are corrupt")
        with pytest.raises(ModelFailure, match="failed to load model 'toy': reload failed, the running "
                                               "version keeps serving: .*weights are corrupt"):
            await plane.load("toy")
        assert plane.model_ready("toy")
        response = await plane.infer(request())
        assert response.outputs[0].data.tolist() == [[2.0] * 4] * 2
        (tmp_path / "ml-backends" / "toy" / "fail.txt").unlink()
        await plane.load("toy")  # and loads again once fixed
        assert plane.repository.entry("toy").reason == ""
        await plane.unload("toy")
    asyncio.run(scenario())


def private_paths(repository) -> list[str]:
    """Client-sent names that start with a real private prefix of ``repository`` (each rewritten by its path
    scrubbing, as checked here): ml_backends_path as configured and resolved, nereid.yaml's folder, the
    scratch folder, and nereid's and nereid.backends' install folders."""
    import nereid
    import nereid.backends

    folders = [repository.root, repository.root.resolve(), Path(repository.settings.source).resolve().parent,
               repository.scratch_dir, Path(nereid.__file__).resolve().parent,
               Path(nereid.backends.__file__).resolve().parent]
    names = [f"{folder}{os.sep}x" for folder in folders]
    assert all(repository.public_text(name) != name for name in names)  # each is scrubbed from server text
    return names


def test_names_the_client_sent_are_echoed_as_sent_never_rewritten_by_the_path_scrubbing(tmp_path):
    # An input, output or load parameter name starting with one of the server's private folders came back
    # rewritten ("/opt/nereid/core/in" as "<nereid>/in", "file:<ml_backends_path>/x" as "file:x") while any
    # other path came back as sent: an oracle for which absolute paths are the server's.
    plane = toy_dataplane(tmp_path)
    public = plane.repository.public_text

    async def refusal(call) -> str:
        with pytest.raises(NereidError) as caught:
            await call
        return public(str(caught.value))  # as both protocols answer it

    async def scenario():
        await plane.load("toy")
        for name in private_paths(plane.repository):
            tensor = NamedTensor(name, DType.FP32, np.ones((2, 4), np.float32))
            assert (await refusal(plane.infer(InferRequest("toy", [tensor])))
                    == f"model 'toy': unexpected input '{name}' (expected inputs: 'input')")
            assert (await refusal(plane.infer(request(requested_outputs=[name])))
                    == f"model 'toy': unknown requested output '{name}' (outputs: 'output')")
            # (A name is quoted up to its first 64 characters.)
            refused = await refusal(plane.load("toy", [f"file:{name}"]))
            assert refused.startswith(f"model 'toy': load parameters '{f'file:{name}'[:64]}"), refused
            refused = await refusal(plane.load("toy", [name]))
            assert refused.startswith(f"model 'toy': unrecognized load parameter(s) '{name[:64]}"), refused
            with pytest.raises(InvalidArgument) as caught:
                plane.model_metadata("toy", name)
            assert public(str(caught.value)) == (f"model 'toy': cannot read version '{name}' as a number (a version "
                                                 "is an integer > 0)")
            plane.shutting_down = True
            with pytest.raises(Unavailable) as caught:
                plane.admit(name)
            assert public(str(caught.value)).startswith(f"model '{name}': the server is shutting down")
            assert public(past_grace_message(name)).startswith(f"model '{name}': the server is shutting down")
            plane.shutting_down = False
        await plane.unload("toy")
    asyncio.run(scenario())


def test_a_long_load_parameter_name_is_quoted_up_to_its_first_64_characters(tmp_path):
    # cap_message(name, 64) was used to quote it, which keeps none of a longer name (its note of how much
    # was cut takes 64 of the limit): "load parameters ' ... [36 more characters cut]'".
    plane = toy_dataplane(tmp_path)
    key = "file:" + "m" * 95

    async def scenario():
        with pytest.raises(InvalidArgument) as caught:
            await plane.load("toy", [key, "config"])
        assert str(caught.value).startswith(f"model 'toy': load parameters 'config', '{key[:64]}' (36 more "
                                            "characters cut) are not supported")
    asyncio.run(scenario())


async def settled(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Wait (on the loop, at most ``timeout_s``) until ``condition()`` holds; the caller asserts what it expects."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


def held_load(monkeypatch, name: str) -> tuple[threading.Event, threading.Event]:
    """Make the toy backend's load() of model ``name`` wait (at most 10 s) until the second event is set; the
    first is set once it has begun."""
    entered, release = threading.Event(), threading.Event()
    load = toy_backends.ToyModel.load

    def held(self) -> None:
        if self.context.name == name:
            entered.set()
            release.wait(10)
        load(self)

    monkeypatch.setattr(toy_backends.ToyModel, "load", held)
    return entered, release


async def load_begun(plane: DataPlane, name: str, entered: threading.Event) -> asyncio.Future:
    """A client's load of ``name`` (see :func:`held_load`), once its backend's load() has begun."""
    loading = asyncio.ensure_future(plane.load(name))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    return loading


def held_infer(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the toy backend's infer() wait (at most 10 s) until the second event is set; the first is set once
    one has begun."""
    running, release = threading.Event(), threading.Event()
    infer = toy_backends.ToyModel.infer

    def held(self, inputs):
        running.set()
        release.wait(10)
        return infer(self, inputs)

    monkeypatch.setattr(toy_backends.ToyModel, "infer", held)
    return running, release


def test_two_overlapping_loads_that_fail_each_answer_with_the_reason(tmp_path, monkeypatch):
    """Found by a bug hunt: of two RepositoryModelLoads of a failing model sent 0.1 s apart, the first answered
    "failed to load model 'spare': " with nothing after the colon: it read the entry after the second load had
    begun, LOADING with no reason yet."""
    plane = toy_dataplane(tmp_path)
    entered, release = threading.Event(), threading.Event()

    def failing(self) -> None:
        entered.set()
        release.wait(10)
        raise ConfigError(f"model '{self.context.name}': weights.bin is cut short")

    monkeypatch.setattr(toy_backends.ToyModel, "load", failing)

    async def scenario() -> None:
        first = await load_begun(plane, "spare", entered)
        second = asyncio.ensure_future(plane.load("spare"))
        await asyncio.sleep(0.1)  # (the second waits for the first to end)
        release.set()
        for load in (first, second):
            with pytest.raises(ModelFailure, match=r"^failed to load model 'spare': .*weights.bin is cut short"):
                await asyncio.wait_for(load, 5)
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_load_an_unload_gave_up_on_is_unavailable_not_a_model_fault(tmp_path, monkeypatch):
    """Defect: a RepositoryModelLoad given up because an unload came while its backend's load() ran answered
    INTERNAL ("failed to load model"), as a model fault; the unload asked for it."""
    plane = toy_dataplane(tmp_path)
    entered, release = held_load(monkeypatch, "spare")

    async def scenario() -> None:
        loading = await load_begun(plane, "spare", entered)
        await asyncio.wait_for(plane.unload("spare"), 5)
        with pytest.raises(Unavailable, match=r"^model 'spare': load abandoned after [\d.]+ s: an unload or "
                                              r"removal of it came while its backend's load\(\) was still running"):
            await asyncio.wait_for(loading, 5)
        release.set()
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_an_answer_its_protocol_cannot_encode_counts_as_a_failure_even_when_encoded_off_the_loop(tmp_path):
    """Review: a gRPC answer past one message was refused (INTERNAL) after the data plane had counted a success:
    the gRPC path encoded it (off the loop, when large) after infer() returned."""
    plane = toy_dataplane(tmp_path)

    async def too_large(response):
        await asyncio.sleep(0)  # as an encoding on a worker thread is awaited
        raise ModelFailure(f"model '{response.model_name}': its answer is past what one message carries")

    async def encoded(response):
        await asyncio.sleep(0)
        return b"wire"

    async def scenario():
        await plane.load("toy")
        with pytest.raises(ModelFailure, match="past what one message carries"):
            await plane.infer_encoded(request(), too_large)
        assert await plane.infer_encoded(request(), encoded) == b"wire"
        # An encoder that fails on its own (the pipeline hunt: an output it could not read, AttributeError) is the
        # caller's INTERNAL answer: counted as a failure too, where it was counted nowhere.
        with pytest.raises(AttributeError):
            await plane.infer_encoded(request(), lambda response: response.nothing_there)
        ((_, stats),) = plane.statistics("toy")
        assert (stats.success.count, stats.fail.count) == (1, 2)
        await plane.unload("toy")
    asyncio.run(scenario())


def test_a_load_or_unload_whose_caller_stops_waiting_runs_to_its_end(tmp_path, monkeypatch):
    """Found by a bug hunt: a gRPC RepositoryModelLoad whose client deadline passed (grpc.aio cancels the call's
    task) cancelled the load: the model stayed UNAVAILABLE "load abandoned (the server is stopping)" and
    ServerReady false until the next load or unload of it. An unload cancelled so kept the reason '' instead of
    "unloaded". Triton finishes what it accepted; only the caller's wait ends."""
    plane = toy_dataplane(tmp_path)
    entered, release = held_load(monkeypatch, "spare")

    async def scenario() -> None:
        await plane.load("toy")
        loading = await load_begun(plane, "spare", entered)
        loading.cancel()  # the client's deadline
        with pytest.raises(asyncio.CancelledError):
            await loading
        release.set()
        entry = plane.repository.entry("spare")
        await settled(lambda: entry.state.value != "LOADING")
        assert (entry.state.value, entry.reason) == ("READY", "")
        assert plane.ready()  # strict readiness: every model asked for is READY
        unloading = asyncio.ensure_future(plane.unload("spare"))
        await asyncio.sleep(0)  # in its drain
        unloading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unloading
        await settled(lambda: entry.state.value == "UNAVAILABLE" and entry.reason)
        assert (entry.state.value, entry.reason, entry.loaded) == ("UNAVAILABLE", "unloaded", None)
        assert plane.ready()
        await plane.repository.unload_all()
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_load_whose_caller_stops_waiting_for_its_turn_behind_an_unload_loads_after_it(tmp_path, monkeypatch):
    """Found by a bug hunt: a load cancelled while it waited behind an unload draining a request left the model
    "unloaded" but counted by ServerReady, which stayed false until a second unload."""
    plane = toy_dataplane(tmp_path)
    running, release = held_infer(monkeypatch)

    async def scenario() -> None:
        await plane.load("toy")
        answer = asyncio.ensure_future(plane.infer(request()))
        while not running.is_set():
            await asyncio.sleep(0.01)
        unloading = asyncio.ensure_future(plane.unload("toy"))
        loading = asyncio.ensure_future(plane.load("toy"))
        await asyncio.sleep(0.05)  # the unload drains; the load waits for its turn
        loading.cancel()  # the client's deadline
        await asyncio.gather(loading, return_exceptions=True)
        release.set()
        await answer
        await unloading
        entry = plane.repository.entry("toy")
        await settled(lambda: entry.state.value == "READY")
        assert (entry.state.value, entry.reason) == ("READY", "") and plane.ready()
        await plane.repository.unload_all()
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_stop_abandons_a_load_whose_caller_stopped_waiting(tmp_path, monkeypatch):
    """The load a client no longer waits for runs on, but a server stop does not wait for it: a backend's load()
    may take minutes, or never return."""
    plane = toy_dataplane(tmp_path)
    entered, release = held_load(monkeypatch, "spare")

    async def scenario() -> None:
        loading = await load_begun(plane, "spare", entered)
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        started = time.monotonic()
        await asyncio.wait_for(plane.repository.unload_all(), 5)
        assert time.monotonic() - started < 2
        entry = plane.repository.entry("spare")
        assert (entry.state.value, entry.reason) == ("UNAVAILABLE", "load abandoned (the server is stopping)")
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_stop_answers_a_client_still_waiting_for_its_load_at_once(tmp_path, monkeypatch):
    """Found by a bug hunt: SIGTERM during a RepositoryModelLoad waited for the load (a 6 s compile) inside the
    drain, which waits for every call, then told the client the model had loaded, on a server stopping; the
    README says a stop abandons a load still running."""
    plane = toy_dataplane(tmp_path)
    entered, release = held_load(monkeypatch, "spare")

    async def scenario() -> None:
        loading = await load_begun(plane, "spare", entered)
        plane.repository.abandon_loads()  # as the server's stop begins
        with pytest.raises(Unavailable) as refused:
            await asyncio.wait_for(loading, 2)  # (the backend's load() still waits, for up to 10 s)
        assert str(refused.value) == ("model 'spare': load abandoned (the server is stopping); load it again once "
                                      "the server serves")
        entry = plane.repository.entry("spare")
        assert (entry.state.value, entry.reason) == ("UNAVAILABLE", "load abandoned (the server is stopping)")
        await asyncio.wait_for(plane.repository.unload_all(), 5)
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def listed_plane(root: Path, watch: bool) -> DataPlane:
    """A data plane over ``root/ml-backends`` whose nereid.yaml lists the toy model ``m`` (its folder there, not
    loaded yet), with or without dynamic mode (no watcher runs: only its settings matter here)."""
    toy_backends.write_toy(root / "ml-backends", "m")
    (root / "nereid.yaml").write_text(f'server:\n  ml_backends_path: "ml-backends"\n  watch: {str(watch).lower()}\n'
                                      "models:\n  - name: m\n")
    settings = load_settings(root / "nereid.yaml")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,))
    (root / "scratch").mkdir()
    return DataPlane(ModelRepository(settings, manager, root / "scratch"), settings)


@pytest.mark.parametrize("watch", [False, True])
def test_loading_a_listed_model_whose_folder_is_missing_is_not_found_and_leaves_its_drain_shown(tmp_path,
                                                                                                monkeypatch, watch):
    """Found by a bug hunt: it was INTERNAL "failed to load model 'm': waiting for its folder" (a server fault),
    where the README says NOT_FOUND as for a name that never had a folder; and the load turned the UNLOADING of
    the old version, still finishing its requests, into UNAVAILABLE."""
    import shutil
    plane = listed_plane(tmp_path, watch)
    repository = plane.repository
    running, release = held_infer(monkeypatch)
    then = ("it loads once its folder lands (server.watch)" if watch
            else "put its folder back, then load it again")
    missing = (rf"^model 'm': its folder 'm' is missing from ml_backends_path, so it cannot be loaded; nereid.yaml "
               rf"lists it: {re.escape(then)}$")

    async def scenario() -> None:
        await plane.load("m")
        answer = asyncio.ensure_future(plane.infer(request("m")))
        while not running.is_set():
            await asyncio.sleep(0.01)
        shutil.rmtree(tmp_path / "ml-backends" / "m")
        removal = repository.remove_in_background("m")
        while repository.entry("m").state.value != "UNLOADING":
            await asyncio.sleep(0.01)
        with pytest.raises(NotFound, match=missing):
            await plane.load("m")
        entry = repository.entry("m")
        assert (entry.state.value, entry.reason) == ("UNLOADING", "")  # its old version still runs a request
        release.set()
        assert (await answer).outputs[0].data.tolist() == [[2.0] * 4] * 2
        await removal
        await repository.unload_all()
        assert entry.state.value == "UNAVAILABLE" and "waiting for its folder 'm'" in entry.reason
        with pytest.raises(NotFound, match=missing):  # not draining any more: the same answer
            await plane.load("m")
        assert "waiting for its folder 'm'" in entry.reason
    try:
        asyncio.run(scenario())
    finally:
        release.set()


@pytest.mark.parametrize("watch", [False, True])
def test_a_listed_models_folder_removed_while_its_load_waits_for_an_unload_is_not_found(tmp_path, monkeypatch,
                                                                                         watch):
    """Noticed at an earlier stop: the folder was there when the client's load was checked, then removed while
    the load waited for an unload still draining; the load answered INTERNAL "failed to load model 'm': waiting
    for its folder", a server fault, where the same load a moment later is NOT_FOUND (the look again after the
    unload lost that the load was a client's)."""
    import shutil
    plane = listed_plane(tmp_path, watch)
    running, release = held_infer(monkeypatch)

    async def scenario() -> None:
        await plane.load("m")
        answer = asyncio.ensure_future(plane.infer(request("m")))
        while not running.is_set():
            await asyncio.sleep(0.01)
        unloading = asyncio.ensure_future(plane.unload("m"))
        await settled(lambda: plane.repository.entry("m").state.value == "UNLOADING")
        loading = asyncio.ensure_future(plane.load("m"))
        await asyncio.sleep(0.1)  # the load has found the folder and waits for the unload
        assert not loading.done()
        shutil.rmtree(tmp_path / "ml-backends" / "m")
        release.set()
        await answer
        await unloading
        with pytest.raises(NotFound, match=r"^model 'm': its folder 'm' is missing from ml_backends_path"):
            await asyncio.wait_for(loading, 5)
        await plane.repository.unload_all()
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_repository_index_calls_share_listings_never_one_begun_before_they_asked(tmp_path, monkeypatch):
    """Found by the storage hunt: 24 RepositoryIndex calls while a store hung each ran its own 30 s listing, 16 at
    a time on the I/O threads, and loads and the watcher's listings waited behind them."""
    plane = toy_dataplane(tmp_path)
    scans = []
    scan = plane.repository._scan

    def slow_scan(*args, **kwargs):
        scans.append(threading.get_ident())
        time.sleep(0.3)  # (a slow store)
        return scan(*args, **kwargs)

    monkeypatch.setattr(plane.repository, "_scan", slow_scan)

    async def scenario() -> None:
        # The first lists at once; the seven arriving while it runs share the next one: two listings, not eight.
        indexes = await asyncio.gather(*(plane.repository_index() for _ in range(8)))
        assert len(scans) == 2 and all([e.name for e in index] == ["spare", "toy"] for index in indexes)
        # A caller never gets a listing begun before it asked (the hunt of this fix: a folder made meanwhile was
        # missing from a joined listing that had begun earlier).
        first = asyncio.ensure_future(plane.repository_index())
        await asyncio.sleep(0.1)  # (inside its listing)
        toy_backends.write_toy(tmp_path / "ml-backends", "late")
        second = await plane.repository_index()
        assert "late" in [e.name for e in second] and len(scans) == 4
        await first
        await plane.load("spare")  # (a load lists on its own, whatever index listing runs)
        await plane.unload("spare")
    asyncio.run(scenario())


def test_the_classes_of_a_large_output_are_made_off_the_event_loop(tmp_path, monkeypatch):
    """The complexity hunt: each class is a string formatted in Python, on the loop: the top million of a large
    FP64 output held it 9 s, every client of both protocols with it. A large one is classified on a worker thread,
    a small one where it was (a thread hand-off would cost it more than the work)."""
    import nereid.dataplane as dataplane

    threads: list[int] = []
    classify = dataplane.classify
    monkeypatch.setattr(dataplane, "classify",
                        lambda *args: (threads.append(threading.get_ident()), classify(*args))[1])
    monkeypatch.setattr(dataplane, "CLASSIFY_ON_LOOP_ELEMENTS", 16)  # (the toy takes 8 rows of 4 at most)
    plane = toy_dataplane(tmp_path)

    async def scenario() -> list:
        await plane.load("toy")
        answers = []
        for rows in (2, 8):
            data = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            asked = InferRequest("toy", [NamedTensor("input", DType.FP32, data)], classifications={"output": 2})
            answers.append((await plane.infer(asked)).outputs[0])
        return answers

    small, large = asyncio.run(scenario())
    loop_thread = threading.get_ident()  # (asyncio.run's loop ran on this thread)
    assert threads[0] == loop_thread and threads[1] != loop_thread, threads
    assert small.data.tolist() == [[b"4.000000:3", b"3.000000:2"], [b"8.000000:3", b"7.000000:2"]]
    assert large.data.shape == (8, 2) and large.data[7].tolist() == [b"32.000000:3", b"31.000000:2"]
