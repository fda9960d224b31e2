"""Prometheus metrics at /metrics: request outcomes, histograms, queue depth, states, load time."""

from __future__ import annotations

import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import prometheus_client
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

import toy_backends
from support import ECHO_MAIN, scrape, until, wait_until
from nereid.backend import BackendClaim, RuntimeReport
from nereid.hookspecs import hookimpl



def test_metrics_describe_requests_batches_and_models(repo, serve) -> None:
    repo.python("echo")
    repo.python("busy", main=f"import time\ntime.sleep(3)\n{ECHO_MAIN}")
    repo.add("broken", "input_shape: [4\n", main_py="print()")
    server = serve(repo.write_config("- name: echo\n- name: busy\n- name: broken\n"))
    client = server.client
    good = triton.InferInput("input", [2, 4], "FP32")
    good.set_data_from_numpy(np.ones((2, 4), np.float32))
    for _ in range(3):
        client.infer("echo", [good])
    bad = triton.InferInput("input", [2, 5], "FP32")
    bad.set_data_from_numpy(np.ones((2, 5), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("echo", [bad])

    samples = scrape(server.server.metrics_port)
    model = (("model", "echo"),)
    assert samples[("nereid_request_success_total", model)] == 3
    assert samples[("nereid_request_failure_total", (("model", "echo"), ("reason", "invalid_argument")))] == 1
    # Successful requests only, as Triton's request and queue durations (the invalid one is a failure).
    assert samples[("nereid_request_duration_seconds_count", model)] == 3
    assert samples[("nereid_queue_duration_seconds_count", model)] == 3
    assert samples[("nereid_compute_duration_seconds_count", model)] == 3
    assert samples[("nereid_compute_duration_seconds_sum", model)] > 0
    assert samples[("nereid_batch_size_sum", model)] == 6  # three executions of two rows
    assert samples[("nereid_batch_size_bucket", (("le", "2.0"), ("model", "echo")))] == 3
    assert samples[("nereid_batcher_submitted_total", model)] == 3  # the invalid one never reached the queue
    assert samples[("nereid_batcher_completed_total", model)] == 3
    assert samples[("nereid_batch_size_count", model)] == 3  # batches; avg size = sum / count
    assert samples[("nereid_queue_depth", model)] == 0
    assert 0 < samples[("nereid_batch_utilization", model)] <= 1
    assert samples[("nereid_model_load_duration_seconds_count", model)] == 1
    assert samples[("nereid_models", (("state", "READY"),))] == 2
    assert samples[("nereid_models", (("state", "UNAVAILABLE"),))] == 1
    # Which model is down, and which is busy now (not on average since its load).
    assert samples[("nereid_model_state", (("model", "broken"), ("state", "UNAVAILABLE")))] == 1
    assert samples[("nereid_model_state", (("model", "broken"), ("state", "READY")))] == 0
    assert samples[("nereid_model_state", (("model", "echo"), ("state", "READY")))] == 1
    assert samples[("nereid_executions_running", model)] == 0
    assert samples[("process_resident_memory_bytes", ())] > 0 and samples[("process_open_fds", ())] > 0
    assert samples[("nereid_busy_seconds_total", model)] > 0
    # Found by a bug hunt: prometheus_client's name[] filter (a scrape config's params) found only the Counters.
    wanted = {"nereid_models", "nereid_request_success_total", "process_open_fds",
              "nereid_model_load_duration_seconds_count", "nereid_protocol_requests_total"}
    filtered = scrape(server.server.metrics_port, "?" + "&".join(f"name[]={name}" for name in sorted(wanted)))
    assert {name for name, _ in filtered} == wanted
    assert filtered[("nereid_request_success_total", model)] == 3
    call = threading.Thread(target=client.infer, args=("busy", [good]))
    call.start()
    busy = (("model", "busy"),)
    assert wait_until(lambda: scrape(server.server.metrics_port)[("nereid_executions_running", busy)] == 1)
    during = scrape(server.server.metrics_port)[("nereid_busy_seconds_total", busy)]
    time.sleep(0.3)  # (still running: it sleeps 3 s)
    assert scrape(server.server.metrics_port)[("nereid_busy_seconds_total", busy)] >= during + 0.2
    call.join()


def test_metrics_can_be_turned_off(repo, serve) -> None:
    repo.python("echo")
    server = serve(repo.write_config(metrics_addr=""))
    assert server.server.metrics_port is None


def test_scrapes_during_loads_and_unloads_never_fail(repo, serve) -> None:
    """Defect: collect() read ``entry.loaded`` twice, so an unload in between gave a 500."""
    repo.python("echo")
    repo.python_warm_start = False  # loads and unloads start and stop no process: more cycles per second
    server = serve(repo.write_config("- name: echo\n"))
    port = server.server.metrics_port
    failures: list[str] = []
    scrapes = 0
    stop = threading.Event()

    def scrape_forever() -> None:
        nonlocal scrapes
        while not stop.is_set():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            except Exception as err:  # an HTTP 500 is raised as HTTPError
                failures.append(repr(err))
            scrapes += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the window is a few bytecodes
    scrapers = [threading.Thread(target=scrape_forever) for _ in range(2)]
    try:
        for thread in scrapers:
            thread.start()
        for _ in range(60):
            server.client.unload_model("echo")
            server.client.load_model("echo")
    finally:
        stop.set()
        for thread in scrapers:
            thread.join(10)
        sys.setswitchinterval(previous)
    assert scrapes > 20
    assert failures == []


def test_a_models_counters_and_histograms_carry_when_their_figures_began(repo, serve) -> None:
    """Their ``_created`` series (as prometheus_client's own counters carry): an unload and load starts the figures
    again from 0, and a scraper must tell that from a counter that went back."""
    repo.python("echo")
    repo.python_warm_start = False
    server = serve(repo.write_config("- name: echo\n"))
    x = triton.InferInput("input", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    server.client.infer("echo", [x])
    model = (("model", "echo"),)
    series = ("nereid_request_success_created", "nereid_batcher_submitted_created", "nereid_busy_seconds_created",
              "nereid_request_duration_seconds_created", "nereid_batch_size_created")
    first = scrape(server.server.metrics_port)
    assert first[("nereid_request_success_total", model)] == 1
    began = {first[(name, model)] for name in series}
    assert len(began) == 1 and time.time() - 120 < began.pop() <= time.time()
    server.client.unload_model("echo")
    server.client.load_model("echo")
    again = scrape(server.server.metrics_port)
    assert again[("nereid_request_success_total", model)] == 0
    assert {again[(name, model)] for name in series} == {again[("nereid_request_success_created", model)]}
    assert again[("nereid_request_success_created", model)] > first[("nereid_request_success_created", model)]
    # The loads' histogram too (the README walkthrough: the one series without it); it counts every load of the
    # name, so it began with the first, before the second load's figures.
    loads_began = again[("nereid_model_load_duration_seconds_created", model)]
    assert time.time() - 120 < loads_began < again[("nereid_request_success_created", model)]
    prometheus_client.disable_created_metrics()  # (what PROMETHEUS_DISABLE_CREATED_SERIES does at import)
    try:
        assert not [name for name, _ in scrape(server.server.metrics_port) if name.endswith("_created")]
    finally:
        prometheus_client.enable_created_metrics()


def test_made_up_model_names_add_no_series(repo, serve) -> None:
    """Every request to an invented name made a permanent nereid_protocol_requests_total series of its own."""
    from nereid.metrics import UNKNOWN_MODEL

    repo.python("echo")
    repo.python("other")  # a folder, not loaded: its requests keep its name
    server = serve(repo.write_config("- name: echo\n"))
    tensor = triton.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    for index in range(30):
        with pytest.raises(InferenceServerException):
            server.client.infer(f"made-up-{index}-" + "x" * 200, [tensor])
    with pytest.raises(InferenceServerException):
        server.client.infer("other", [tensor])
    server.client.infer("echo", [tensor])
    base = f"http://127.0.0.1:{server.server.http_port}"
    body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}'
    for index in range(20):
        request = urllib.request.Request(f"{base}/v2/models/invented-{index}/infer", method="POST",
                                         data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 404

    requests = {labels: value for (name, labels), value in scrape(server.server.metrics_port).items()
                if name == "nereid_protocol_requests_total"}
    assert requests == {
        (("model", UNKNOWN_MODEL), ("outcome", "not_found"), ("protocol", "grpc")): 30,
        (("model", UNKNOWN_MODEL), ("outcome", "not_found"), ("protocol", "http")): 20,
        (("model", "other"), ("outcome", "unavailable"), ("protocol", "grpc")): 1,
        (("model", "echo"), ("outcome", "success"), ("protocol", "grpc")): 1,
    }


def test_a_runtime_report_that_raises_leaves_out_one_gauge_not_the_scrape(tmp_path, caplog) -> None:
    """A plugin's runtime_report() that raised failed every scrape of /metrics, for every model."""
    import asyncio

    import toy_backends
    from nereid.metrics import _RepositoryCollector
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings

    toy_backends.write_faulty(tmp_path / "ml-backends", "reporter", "report_fails")
    toy_backends.write_toy(tmp_path / "ml-backends", "plain")
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "scratch").mkdir()
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, toy_backends.FaultyToys()))
    repository = ModelRepository(load_settings(tmp_path / "nereid.yaml"), manager, tmp_path / "scratch")

    async def load():
        for name in ("reporter", "plain"):
            await repository.load(name)
    asyncio.run(load())
    collector = _RepositoryCollector(repository)
    for _ in range(2):
        families = {family.name: family for family in collector.collect()}
    assert {s.labels["model"] for s in families["nereid_request_success"].samples} == {"reporter", "plain"}
    assert not families["nereid_warm_parent_resident_bytes"].samples
    assert sum("runtime_report() failed (RuntimeError: no report today)" in r.getMessage()
               for r in caplog.records) == 1  # once per model, not once per scrape


GATE = threading.Event()


class GatedToy(toy_backends.ToyModel):
    """A toy whose every execution waits for ``GATE``: requests pile up in its queue."""

    def infer(self, inputs):
        GATE.wait(10)
        return super().infer(inputs)


class GatedBackend:
    """The ``gated`` backend: claims folders holding ``gated.txt``."""

    BACKEND_NAME = "gated"

    @hookimpl
    def nereid_claim_model(self, folder, declared):
        return BackendClaim(GatedToy) if (folder / "gated.txt").is_file() else None


def test_queue_depth_counts_the_requests_waiting_on_a_version_that_drains(tmp_path) -> None:
    """Defect: after a reload (or while a removed folder's model finished its requests) the gauge showed only
    the serving version's queue; the requests still waiting on the old version were invisible."""
    import asyncio
    import shutil

    from nereid.dtypes import DType
    from nereid.metrics import _RepositoryCollector
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings
    from nereid.tensors import NamedTensor

    folder = tmp_path / "ml-backends" / "g"
    folder.mkdir(parents=True)
    (folder / "gated.txt").write_text("")
    (folder / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n")
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "scratch").mkdir()
    repository = ModelRepository(load_settings(tmp_path / "nereid.yaml"),
                                 make_plugin_manager(load_entry_points=False, extra_plugins=(GatedBackend(),)),
                                 tmp_path / "scratch")
    collector = _RepositoryCollector(repository)
    GATE.clear()

    def gauge(name: str = "nereid_queue_depth") -> dict[str, float]:
        family = next(f for f in collector.collect() if f.name == name)
        return {sample.labels["model"]: sample.value for sample in family.samples
                if not sample.name.endswith("_created")}

    async def scenario() -> list[dict[str, float]]:
        x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
        await repository.load("g")
        old = repository.ready_model("g").scheduler
        requests = [asyncio.ensure_future(old.submit([x], 1, 0)) for _ in range(3)]  # one runs, two wait
        await until(lambda: old.queue_depth == 2)
        # Another signature: the old version keeps its queue (one that serves the same hands it over; see
        # ModelRepository._takes_over).
        (folder / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 16\n")
        await repository.reload("g")
        new = repository.ready_model("g").scheduler
        requests += [asyncio.ensure_future(new.submit([x], 1, 0)) for _ in range(2)]  # one runs, one waits
        await until(lambda: new.queue_depth == 1)
        seen = [gauge()]
        shutil.rmtree(folder)
        removal = repository.remove_in_background("g")  # the serving version drains too now
        await until(lambda: repository.entry("g").state.value == "UNLOADING")
        seen.append(gauge())
        # Its other figures stay until it is released, as they did while an unload kept it on its entry.
        assert gauge("nereid_batcher_submitted") == {"g": 5}  # (the statistics the two versions share)
        GATE.set()
        answers = await asyncio.gather(*requests)
        assert [answer[0].data.tolist() for answer in answers] == [[[1.0] * 4]] * 5  # each answered, once
        await removal
        await repository.unload_all()
        seen.append(gauge())
        return seen
    try:
        seen = asyncio.run(scenario())
    finally:
        GATE.set()
    assert seen == [{"g": 3}, {"g": 3}, {}]


# What the ``reporting`` backend's models return from runtime_report(), by the text of their reports.txt.
REPORTS = {
    "bytes_str": lambda: RuntimeReport("warm_start=on", warm_parent_resident_bytes="lots"),
    "bytes_bool": lambda: RuntimeReport(warm_parent_resident_bytes=True),
    "bytes_negative": lambda: RuntimeReport(warm_parent_resident_bytes=-1),
    "bytes_float": lambda: RuntimeReport(warm_parent_resident_bytes=1.5e9),
    "warm_str": lambda: RuntimeReport(warm_start="yes"),
    "warm_int": lambda: RuntimeReport(warm_start=1),
    "none": lambda: None,  # a forgotten return
    "str": lambda: "warm_start=on",
    "ok": lambda: RuntimeReport("warm_start=on", warm_parent_resident_bytes=3 * 2**20),
    "ok_numpy": lambda: RuntimeReport(warm_parent_resident_bytes=np.int64(2048)),  # as a library may count it
    "ok_cold": lambda: RuntimeReport("warm_start=off (a reason)", warm_start=False),
    # (Found by a bug hunt: an exit of the plugin's own failed every scrape, HTTP 500, every model's figures lost.)
    "exits": lambda: sys.exit(3),
    "interrupted": lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
}


class ReportingToy(toy_backends.ToyModel):
    """A toy whose ``runtime_report()`` returns what its folder's reports.txt names (a key of REPORTS)."""

    def runtime_report(self):
        return REPORTS[(self.context.folder / "reports.txt").read_text()]()


class ReportingBackend:
    """The ``reporting`` backend: claims folders holding ``reports.txt``."""

    BACKEND_NAME = "reporting"

    @hookimpl
    def nereid_claim_model(self, folder, declared):
        return BackendClaim(ReportingToy) if (folder / "reports.txt").is_file() else None


def reporting_models(tmp_path: Path, reports: dict[str, str]):
    """A repository of ``reporting`` toys (model name -> the REPORTS key it answers), not loaded yet, with its
    metrics served: (repository, metrics, port)."""
    from nereid.metrics import ServerMetrics
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings

    for name, report in reports.items():
        toy_backends.write_toy(tmp_path / "ml-backends", name)
        (tmp_path / "ml-backends" / name / "reports.txt").write_text(report)
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "scratch").mkdir()
    repository = ModelRepository(load_settings(tmp_path / "nereid.yaml"),
                                 make_plugin_manager(load_entry_points=False, extra_plugins=(ReportingBackend(),)),
                                 tmp_path / "scratch")
    metrics = ServerMetrics()
    metrics.collect_from(repository)
    return repository, metrics, metrics.serve("127.0.0.1:0")


def test_a_runtime_report_of_the_wrong_kind_leaves_out_one_gauge_not_the_scrape(tmp_path, caplog) -> None:
    """Defect: a plugin's RuntimeReport(warm_parent_resident_bytes="lots") made every /metrics scrape answer
    HTTP 500 with a traceback logged each time (prometheus_client failed on it while encoding, after the
    collector's guard); a report that is not a RuntimeReport at all failed the same way."""
    import asyncio

    repository, metrics, port = reporting_models(tmp_path, {name: name for name in REPORTS})

    async def scrapes() -> dict[tuple[str, tuple], float]:
        try:
            for name in REPORTS:
                await repository.load(name)
            await asyncio.to_thread(scrape, port)  # raised HTTPError 500 before
            return await asyncio.to_thread(scrape, port)
        finally:
            await repository.unload_all()
    try:
        samples = asyncio.run(scrapes())
    finally:
        metrics.close()
    gauge = {dict(labels)["model"]: value for (metric, labels), value in samples.items()
             if metric == "nereid_warm_parent_resident_bytes"}
    assert gauge == {"ok": 3 * 2**20, "ok_numpy": 2048}
    warm = {dict(labels)["model"]: value for (metric, labels), value in samples.items()
            if metric == "nereid_warm_start"}
    assert warm == {"ok_cold": 0}  # (the reports that leave warm_start None have no series)
    assert {dict(labels)["model"] for (metric, labels) in samples if metric == "nereid_request_success_total"} \
        == set(REPORTS)  # every model's other figures are there
    warnings = [r.getMessage() for r in caplog.records if "runtime_report() failed" in r.getMessage()]
    assert sorted(warnings) == sorted(  # once per model, not once per scrape; no traceback
        f"model '{name}': runtime_report() failed ({why}); its warm start gauges are left out" for name, why in (
            ("bytes_str", "its warm_parent_resident_bytes is 'lots' (str), expected an int >= 0 or None"),
            ("bytes_bool", "its warm_parent_resident_bytes is True (bool), expected an int >= 0 or None"),
            ("bytes_negative", "its warm_parent_resident_bytes is -1 (int), expected an int >= 0 or None"),
            ("bytes_float", "its warm_parent_resident_bytes is 1500000000.0 (float), expected an int >= 0 or None"),
            ("warm_str", "its warm_start is 'yes' (str), expected a bool or None"),
            ("warm_int", "its warm_start is 1 (int), expected a bool or None"),
            ("none", "returned NoneType, expected a nereid RuntimeReport"),
            ("str", "returned str, expected a nereid RuntimeReport"),
            ("exits", "SystemExit: 3"), ("interrupted", "KeyboardInterrupt")))
    assert not [r for r in caplog.records if r.exc_info]


def test_a_runtime_report_whose_thread_cannot_start_leaves_out_its_gauges_not_the_scrape(tmp_path, caplog,
                                                                                          capfd) -> None:
    """Defect (the limits hunt): with the process at its thread limit, a runtime report's thread failed to start
    ("can't start new thread") and took the whole scrape with it: its connection closed unanswered and wsgiref
    printed a raw traceback on stderr. The model's warm start gauges are left out, said once; the next scrape
    asks again."""
    import asyncio

    repository, metrics, port = reporting_models(tmp_path, {"ok": "ok", "plain": "ok_cold"})

    class NoReportThreads(threading.Thread):
        """Threads as ever, but a runtime report's cannot start (as at RLIMIT_NPROC)."""

        def start(self) -> None:
            if self.name.startswith("nereid-runtime-report-"):
                raise RuntimeError("can't start new thread")
            super().start()

    async def scrapes() -> tuple[dict, dict]:
        try:
            for name in ("ok", "plain"):
                await repository.load(name)
            real = threading.Thread
            threading.Thread = NoReportThreads
            try:
                await asyncio.to_thread(scrape, port)  # the connection closed unanswered before
                without = await asyncio.to_thread(scrape, port)
            finally:
                threading.Thread = real
            return without, await asyncio.to_thread(scrape, port)
        finally:
            await repository.unload_all()
    try:
        without, again = asyncio.run(scrapes())
    finally:
        metrics.close()

    def gauges(samples: dict) -> dict:
        return {(metric, dict(labels)["model"]): value for (metric, labels), value in samples.items()
                if metric in ("nereid_warm_parent_resident_bytes", "nereid_warm_start")}
    assert gauges(without) == {}
    assert {dict(labels)["model"] for (metric, labels) in without if metric == "nereid_request_success_total"} \
        == {"ok", "plain"}  # every model's other figures are there
    assert gauges(again) == {("nereid_warm_parent_resident_bytes", "ok"): 3 * 2**20,
                             ("nereid_warm_start", "plain"): 0}  # asked again once threads start
    warnings = [r.getMessage() for r in caplog.records if "could not be asked" in r.getMessage()]
    assert sorted(warnings) == [  # once per model, not once per scrape
        f"model '{name}': its runtime_report() could not be asked (a thread cannot start: can't start new thread); "
        "its warm start gauges are left out" for name in ("ok", "plain")]
    assert not [r for r in caplog.records if r.exc_info]
    assert "Traceback" not in capfd.readouterr().err


REPORT_RELEASE = threading.Event()
report_calls: list[str] = []


class HangingReportToy(toy_backends.ToyModel):
    """A toy whose ``runtime_report()`` does not return until ``REPORT_RELEASE`` is set (a plugin's call hung
    on a lock or a dead process)."""

    def runtime_report(self):
        report_calls.append(self.context.name)
        REPORT_RELEASE.wait(60)
        return RuntimeReport(warm_parent_resident_bytes=4096)


class HangingReportBackend:
    """The ``hanging_report`` backend: claims every folder, those holding ``hangs.txt`` with a hanging report."""

    BACKEND_NAME = "hanging_report"

    @hookimpl
    def nereid_claim_model(self, folder, declared):
        return BackendClaim(HangingReportToy if (folder / "hangs.txt").is_file() else toy_backends.ToyModel)


def test_a_runtime_report_that_hangs_holds_a_scrape_for_a_bounded_time(tmp_path, caplog) -> None:
    """Defect: a plugin's runtime_report() that hung held every /metrics scrape for ever (each on a thread of
    its own), so a scraper lost every model's figures, not only that model's gauge."""
    import asyncio

    from nereid.metrics import RUNTIME_REPORT_WAIT_S, ServerMetrics
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings

    toy_backends.write_toy(tmp_path / "ml-backends", "plain")
    for name in ("stuck", "stuck_too"):
        toy_backends.write_toy(tmp_path / "ml-backends", name)
        (tmp_path / "ml-backends" / name / "hangs.txt").write_text("")
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "scratch").mkdir()
    repository = ModelRepository(load_settings(tmp_path / "nereid.yaml"),
                                 make_plugin_manager(load_entry_points=False, extra_plugins=(HangingReportBackend(),)),
                                 tmp_path / "scratch")
    metrics = ServerMetrics()
    metrics.collect_from(repository)
    port = metrics.serve("127.0.0.1:0")
    REPORT_RELEASE.clear()
    report_calls.clear()

    async def scrapes() -> tuple[list[float], dict, dict]:
        try:
            for name in ("plain", "stuck", "stuck_too"):
                await repository.load(name)
            took = []

            async def timed_scrape() -> dict:
                started = time.monotonic()
                samples = await asyncio.to_thread(scrape, port)  # hung for ever before
                took.append(time.monotonic() - started)
                return samples
            # Overlapping scrapes wait on the same calls (the review found each starting its own), and so does a
            # later one.
            await asyncio.gather(timed_scrape(), timed_scrape(), timed_scrape())
            samples = await timed_scrape()
            REPORT_RELEASE.set()
            await asyncio.sleep(0.2)
            return took, samples, await asyncio.to_thread(scrape, port)
        finally:
            REPORT_RELEASE.set()
            await repository.unload_all()
    try:
        took, hung, released = asyncio.run(scrapes())
    finally:
        metrics.close()
    # Both hung calls are waited for together, and a second scrape waits on the same calls, not new ones.
    assert all(seconds < RUNTIME_REPORT_WAIT_S + 1.5 for seconds in took), took
    # A scrape after the one that waited does not wait for the hung calls again (the plugin hunt: each took 1 s).
    assert took[3] < RUNTIME_REPORT_WAIT_S / 2, took
    assert sorted(report_calls) == ["stuck", "stuck_too"]  # the third scrape took the calls' late answers
    assert {dict(labels)["model"] for (metric, labels) in hung if metric == "nereid_request_success_total"} \
        == {"plain", "stuck", "stuck_too"}
    assert not [labels for (metric, labels) in hung if metric == "nereid_warm_parent_resident_bytes"]
    assert {dict(labels)["model"]: value for (metric, labels), value in released.items()
            if metric == "nereid_warm_parent_resident_bytes"} == {"stuck": 4096, "stuck_too": 4096}
    warnings = [r.getMessage() for r in caplog.records if "has not returned" in r.getMessage()]
    assert sorted(warnings) == [  # once per model, not once per scrape
        f"model '{name}': runtime_report() has not returned within {RUNTIME_REPORT_WAIT_S:g} s; its warm start "
        "gauges are left out until it does" for name in ("stuck", "stuck_too")]


def test_a_model_name_the_repository_forgets_keeps_no_series(tmp_path) -> None:
    """Defect: every name a watch-mode server ever served kept 19 series in /metrics (load duration, its remove
    event, its protocol requests) after its folder was deleted: versioned names (model-<sha>) grew each scrape
    by 1.5 KB per name, for ever. Renames left the old name's; requests for it still counted under it."""
    import asyncio
    import shutil

    from prometheus_client import generate_latest

    from nereid.metrics import UNKNOWN_MODEL, ServerMetrics
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings

    root = tmp_path / "ml-backends"
    root.mkdir()
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "scratch").mkdir()
    metrics = ServerMetrics()
    repository = ModelRepository(load_settings(tmp_path / "nereid.yaml"),
                                 make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,)),
                                 tmp_path / "scratch", events=metrics)
    metrics.collect_from(repository)

    def series(model: str | None = None) -> list[str]:
        """The registry's series (lines of the real exposition), those naming ``model`` when given."""
        lines = [line for line in generate_latest(metrics.registry).decode().splitlines()
                 if line and not line.startswith("#")]
        return [line for line in lines if f'model="{model}"' in line] if model is not None else lines

    def value(metric: str, **labels: str) -> float | None:
        want = "{" + ",".join(f'{key}="{text}"' for key, text in sorted(labels.items())) + "}"
        return next((float(line.rsplit(" ", 1)[1]) for line in series() if line.startswith(metric + want)), None)

    async def serve_once(name: str) -> None:
        """Drop ``name`` in, load and reload it, answer requests over both protocols, delete it."""
        toy_backends.write_toy(root, name)
        await repository.load(name)
        await repository.reload(name)
        metrics.count_request("grpc", name, "success")
        metrics.count_request("http", name, "invalid_argument")
        assert value("nereid_model_load_duration_seconds_count", model=name) == 2
        shutil.rmtree(root / name)
        await repository.remove(name)

    async def scenario() -> None:
        before = len(series())
        await serve_once("ver-000000")
        after_one = len(series())
        assert series("ver-000000") == []
        assert after_one == before + 2  # only nereid_repository_events_total{model="/unknown",event="remove"}
        for index in range(1, 4):
            await serve_once(f"ver-{index:06d}")
        assert len(series()) == after_one  # nothing per name gone
        assert value("nereid_repository_events_total", event="remove", model=UNKNOWN_MODEL) == 4
        metrics.count_request("grpc", "ver-000000", "success")  # a late answer: not under the forgotten name
        assert series("ver-000000") == []
        assert value("nereid_protocol_requests_total", model=UNKNOWN_MODEL, outcome="success", protocol="grpc") == 1

        # A name that comes back counts again from zero.
        toy_backends.write_toy(root, "ver-000000")
        await repository.load("ver-000000")
        metrics.count_request("grpc", "ver-000000", "success")
        assert value("nereid_protocol_requests_total", model="ver-000000", outcome="success", protocol="grpc") == 1
        assert value("nereid_model_load_duration_seconds_count", model="ver-000000") == 1

        # A rename in place: the old name keeps nothing; the new one has the event.
        (root / "ver-000000").rename(root / "renamed")
        await repository.rename("ver-000000", "renamed")
        assert series("ver-000000") == []
        assert value("nereid_repository_events_total", event="rename", model="renamed") == 1
        # Its load, and its requests, moved with it (nereid_model_version{model="renamed"} is 1).
        assert value("nereid_model_load_duration_seconds_count", model="renamed") == 1
        assert value("nereid_protocol_requests_total", model="renamed", outcome="success", protocol="grpc") == 1
        # A request in flight under the old name when the model moved counts under its new name, as the model's
        # statistics do (it counted success under /unknown: the dynamic-mode hunt); one that came after the
        # rename is NOT_FOUND, counted as any unknown name, never under the new one.
        unknown_before = value("nereid_protocol_requests_total", model=UNKNOWN_MODEL, outcome="success",
                               protocol="grpc")
        metrics.count_request("grpc", "ver-000000", "success")
        metrics.count_request("grpc", "ver-000000", "not_found")
        assert value("nereid_protocol_requests_total", model="renamed", outcome="success", protocol="grpc") == 2
        assert value("nereid_protocol_requests_total", model=UNKNOWN_MODEL, outcome="success",
                     protocol="grpc") == unknown_before
        assert value("nereid_protocol_requests_total", model=UNKNOWN_MODEL, outcome="not_found", protocol="grpc") == 1
        assert series("ver-000000") == []

        # A folder that failed to load, forgotten by a rescan before the watcher's removal.
        toy_backends.write_toy(root, "broken")
        (root / "broken" / "fail.txt").write_text("no")
        await repository.load("broken")
        metrics.count_request("grpc", "broken", "unavailable")
        shutil.rmtree(root / "broken")
        repository.rescan()
        await repository.remove("broken")
        assert series("broken") == []

        # An unloaded model is still in RepositoryIndex: it keeps its series, and its requests count under it.
        await repository.unload("renamed")
        metrics.count_request("grpc", "renamed", "unavailable")
        assert value("nereid_protocol_requests_total", model="renamed", outcome="unavailable", protocol="grpc") == 1
        assert value("nereid_repository_events_total", event="rename", model="renamed") == 1
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_rename_moves_the_names_series_to_the_new_name() -> None:
    """Defect: after a rename in place, nereid_model_version{model=<new>} was 1 but the new name had no
    nereid_model_load_duration_seconds sample: the old name's series were dropped, not moved."""
    from prometheus_client import generate_latest

    from nereid.metrics import ServerMetrics

    metrics = ServerMetrics()  # (no repository: every name counts as known)
    metrics.model_loaded("before", 0.2)
    metrics.model_loaded("before", 3.0)  # a reload
    metrics.repository_event("before", "reload")
    for _ in range(2):
        metrics.count_request("grpc", "before", "success")
    metrics.count_request("http", "after", "unavailable")  # the new folder was seen first: asked for, not READY
    metrics.count_request("http", "before", "unavailable")
    metrics.model_loaded("after", 0.05)  # (a load under the new name meanwhile: both are kept)
    metrics.model_renamed("before", "after")

    lines = [line for line in generate_latest(metrics.registry).decode().splitlines() if not line.startswith("#")]
    assert [line for line in lines if 'model="before"' in line] == []
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if 'model="after"' in line}
    load = "nereid_model_load_duration_seconds"
    assert samples[f'{load}_count{{model="after"}}'] == 3
    assert samples[f'{load}_sum{{model="after"}}'] == pytest.approx(3.25)
    assert samples[f'{load}_bucket{{le="0.1",model="after"}}'] == 1
    assert samples[f'{load}_bucket{{le="0.5",model="after"}}'] == 2
    assert samples[f'{load}_bucket{{le="5.0",model="after"}}'] == 3
    requests = "nereid_protocol_requests_total"
    assert samples[f'{requests}{{model="after",outcome="success",protocol="grpc"}}'] == 2
    assert samples[f'{requests}{{model="after",outcome="unavailable",protocol="http"}}'] == 2  # added together
    assert samples['nereid_repository_events_total{event="reload",model="after"}'] == 1
    metrics.count_request("grpc", "after", "success")  # the moved series go on counting
    assert f'{requests}{{model="after",outcome="success",protocol="grpc"}} 3.0' in generate_latest(
        metrics.registry).decode()

    metrics.model_forgotten("after")  # and go with the new name, when that is forgotten
    assert 'model="after"' not in generate_latest(metrics.registry).decode()


def test_requests_refused_before_any_model_are_counted_by_protocol_and_reason(repo, serve) -> None:
    """A request the HTTP parser (or protobuf) cannot read, or whose head is too large, reaches no model: nothing
    in /metrics counted it, so a flood of them showed only as log lines."""
    repo.python("echo")
    server = serve(repo.write_config("- name: echo\n"))
    for request in (b"GARBAGE\r\n\r\n", b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70_000 + b"\r\n\r\n",
                    b"GARBAGE\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as connection:
            try:
                connection.sendall(request)
                connection.settimeout(10)
                while connection.recv(65536):
                    pass
            except OSError:  # (431: closed while the head was still being sent)
                pass
    # And a gRPC message protobuf cannot parse (tag 0 is never valid).
    with grpc.insecure_channel(f"127.0.0.1:{server.server.port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            infer(b"\x00\x00", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = {labels: value for (name, labels), value in scrape(server.server.metrics_port).items()
               if name == "nereid_protocol_refused_total"}
    assert refused == {(("protocol", "http"), ("reason", "unparsable")): 2,
                       (("protocol", "http"), ("reason", "head_too_large")): 1,
                       (("protocol", "grpc"), ("reason", "unparsable")): 1}
