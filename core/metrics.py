"""Prometheus metrics at ``/metrics`` on ``server.metrics_addr``, with prometheus_client.

Each server has its own registry (several servers can share a process, as in
the tests). Two kinds of figures:

* read at scrape time: a model's request and batch figures are not observed
  a second time; a collector reads each model's :class:`~nereid.stats.ModelStats`
  snapshot, and the repository's states, when scraped;
* counted as they happen, for what no model statistic holds: requests by
  protocol and outcome and refusals by protocol and reason (told by the gRPC
  and HTTP surfaces), loads and dynamic-repository events (told by the
  repository, as its :class:`~nereid.repository.RepositoryEvents`).

The HTTP endpoint serving them is :mod:`nereid.metrics_endpoint`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, PlatformCollector, ProcessCollector
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from nereid.backend import ReportsRuntime, RuntimeReport, runtime_report_problem
from nereid.daemon_pool import ThreadStartFailed
from nereid.errors import NotFound, describe_exception, plugin_failures
from nereid.log_limit import OnceLog
from nereid.metrics_endpoint import IDLE_TIMEOUT_S, MetricsEndpoint
from nereid.model_entry import LoadedVersion, ModelState
from nereid.repository import ModelRepository
from nereid.stats import Histogram as StatsHistogram

log = logging.getLogger(__name__)
_report_failures = OnceLog(log)  # one line per model, not one per scrape

# The model label of requests for names the repository does not know. No model folder can be named so
# (a folder name has no "/"), and one label for all of them keeps the series bounded by the folders:
# a client inventing names must not add a series (and memory, and scrape time) per name.
UNKNOWN_MODEL = "/unknown"
MAX_RENAMES_KEPT = 256  # names renamed away remembered for the requests still in flight under them
# nereid_model_load_duration_seconds's buckets (upper bounds, seconds).
LOAD_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# (metric name, help, ModelStats attribute)
_HISTOGRAMS = (
    ("nereid_request_duration_seconds", "Time from the decoded request to its answer, of successful requests.",
     "request_seconds"),
    ("nereid_queue_duration_seconds", "Time a successful request waited in the queue.", "queue_seconds"),
    ("nereid_compute_duration_seconds", "Time of one execution (batch assembly, inference, split).",
     "compute_seconds"),
    ("nereid_batch_size", "Rows per execution.", "batch_rows"),
    ("nereid_batch_cost", "Summed request cost per execution.", "batch_cost"),
)
# How long one scrape waits for the models' runtime_report() calls, all of them together. A plugin's call that
# hung held the scrape for ever, and with it every model's figures (a scraper gives up, so they were all lost).
RUNTIME_REPORT_WAIT_S = 1.0


class ServerMetrics:
    """All metrics of one server."""

    def __init__(self) -> None:
        # auto_describe: collectors without describe() (this module's, ProcessCollector) are collected once at
        # registration for their names; without it, a scrape's name[] filter found none of their series.
        self.registry = CollectorRegistry(auto_describe=True)
        # The server process's own: memory, CPU, open descriptors (against its limit), start time; Python's version.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        # Load durations by model, exported by _LoadDurations. Kept here, not in a prometheus_client Histogram:
        # a rename moves them to the new name (model_renamed), which a Histogram's children cannot be.
        self._load_seconds: dict[str, StatsHistogram] = {}
        self.repository_events = Counter(
            "nereid_repository_events", "Repository events by model (dynamic mode, and reloads asked for by "
            "RepositoryModelLoad): reload, reload_failed, rename, remove.",
            ["model", "event"], registry=self.registry)
        self.protocol_requests = Counter(
            "nereid_protocol_requests", "Inference requests answered, by model, protocol (grpc, http) and outcome.",
            ["model", "protocol", "outcome"], registry=self.registry)
        self.protocol_refused = Counter(
            "nereid_protocol_refused", "Requests (and HTTP connections) refused before any model saw them, by "
            "protocol and reason.", ["protocol", "reason"], registry=self.registry)
        # Children by model, then (protocol, outcome): only models the repository knows (or UNKNOWN_MODEL), and
        # what a forgotten model had is dropped with it (model_forgotten), so this stays as small as the series.
        self._request_counters: dict[str, dict[tuple[str, str], Any]] = {}
        self._events: dict[str, set[str]] = {}  # the events counted under each model, to remove them by name
        # Names renamed away (old -> new), the latest MAX_RENAMES_KEPT: a request in flight under the old name
        # when its model moved is answered by the moved model, and counts under its new name.
        self._renamed: dict[str, str] = {}
        # Held from "does the repository know this name" to the series made for it, and while a forgotten name's
        # series are removed: a series is never made for a name just after its series were dropped.
        self._names_lock = threading.Lock()
        self._repository: ModelRepository | None = None
        self.registry.register(_LoadDurations(self))  # (collected as it registers: after what it reads is set)
        self.endpoint = MetricsEndpoint(self.registry)  # /metrics over HTTP, once served

    def collect_from(self, repository: ModelRepository) -> None:
        """Report every model of ``repository``, read from it at each scrape (no per-request metric work).

        Requests are then counted by model only for names ``repository`` knows (see :data:`UNKNOWN_MODEL`).
        """
        self._repository = repository
        self.registry.register(_RepositoryCollector(repository))

    def count_request(self, protocol: str, model: str, outcome: str) -> None:
        """Count one inference request answered over ``protocol`` (``success`` or the error's reason).

        A name the repository does not know (never had a folder, or forgotten since) is counted as
        :data:`UNKNOWN_MODEL`: a model's series last as long as the repository knows its name.
        """
        counters = self._request_counters.get(model)
        counter = counters.get((protocol, outcome)) if counters is not None else None
        if counter is None:  # labels() costs more than the increment: look each child up once
            counter = self._request_counter(protocol, model, outcome)
        counter.inc()

    def count_refused(self, protocol: str, reason: str) -> None:
        """Count one request refused before any model saw it: one gRPC cannot parse, an HTTP request or
        connection the listener refused (see ``HttpListener``)."""
        self.protocol_refused.labels(protocol, reason).inc()

    def _request_counter(self, protocol: str, model: str, outcome: str) -> Any:
        with self._names_lock:
            if not self._knows(model):
                # One answered under a name renamed since it came (in flight when its model moved) counts under the
                # model's new name, as its statistics do (it counted as /unknown: the dynamic-mode hunt); a request
                # that came after the rename is NOT_FOUND, and counts as any unknown name.
                moved = self._renamed.get(model)
                model = moved if moved is not None and outcome != NotFound.reason and self._knows(moved) \
                    else UNKNOWN_MODEL
            counters = self._request_counters.setdefault(model, {})
            counter = counters.get((protocol, outcome))
            if counter is None:
                counter = counters[(protocol, outcome)] = self.protocol_requests.labels(model, protocol, outcome)
            return counter

    def _knows(self, model: str) -> bool:
        """Whether the repository has a folder (or nereid.yaml entry) named ``model``; True without one."""
        # A dict lookup: entry() or ready_model() may look for the folder, and give a name the repository has
        # just forgotten (a removal counted here) an entry again from a store's listing seconds old.
        return self._repository is None or self._repository.knows(model)

    def model_loaded(self, model: str, seconds: float) -> None:
        """Record one model load."""
        with self._names_lock:
            loads = self._load_seconds.get(model)
            if loads is None:
                loads = self._load_seconds[model] = StatsHistogram(LOAD_BUCKETS)
            loads.observe(seconds)

    def load_durations(self) -> list[tuple[str, list[tuple[str, int]], float, float]]:
        """``(model, cumulative buckets, sum, created)`` of every model's loads, by name (what /metrics shows)."""
        with self._names_lock:
            return [(name, loads.cumulative(), loads.sum, loads.created)
                    for name, loads in sorted(self._load_seconds.items())]

    def repository_event(self, model: str, event: str) -> None:
        """Count one reload, failed reload, rename or removal.

        One for a name the repository does not know (a removal that forgot it) is counted as
        :data:`UNKNOWN_MODEL`: removals stay counted, without a series per name that is gone.
        """
        with self._names_lock:
            if not self._knows(model):
                model = UNKNOWN_MODEL
            self._events.setdefault(model, set()).add(event)
            self.repository_events.labels(model, event).inc()

    def model_forgotten(self, model: str) -> None:
        """The repository no longer knows ``model`` (its entry is gone): drop every series under its name.

        A server fed versioned names (``model-<sha>``) must not keep series for every name it served, nor a
        scrape grow with them. A name that comes back counts from zero. An unloaded model keeps its series:
        its name is still in RepositoryIndex, and its requests still count under it.
        """
        with self._names_lock:
            # (Not the names renamed away from: each is forgotten right after its rename, and is what is looked up.)
            self._renamed = {old: new for old, new in self._renamed.items() if new != model}
            for protocol, outcome in self._request_counters.pop(model, {}):
                _remove_series(self.protocol_requests, model, protocol, outcome)
            for event in self._events.pop(model, ()):
                _remove_series(self.repository_events, model, event)
            self._load_seconds.pop(model, None)

    def model_renamed(self, old: str, new: str) -> None:
        """The repository's model ``old`` moved in place to the name ``new`` (its folder renamed): every series
        under ``old`` (its loads, requests, events) moves to ``new``, added to any ``new`` has already.

        ``nereid_model_version`` and the request statistics follow the moved model: without this its loads were
        dropped with the old name, and the new name had a version but no load. Called once ``new`` is known and
        ``old`` is not. A request answered under ``old`` from then on counts under ``new`` when it was in flight
        (any outcome but NOT_FOUND), as :data:`UNKNOWN_MODEL` otherwise: never under ``old`` again.
        """
        if old == new:
            return
        with self._names_lock:
            self._renamed = {name: (new if moved == old else moved) for name, moved in self._renamed.items()
                             if name != new}  # (a chain of renames leads to the last name; new is known now)
            self._renamed[old] = new
            while len(self._renamed) > MAX_RENAMES_KEPT:
                del self._renamed[next(iter(self._renamed))]
            loads = self._load_seconds.pop(old, None)
            if loads is not None:
                kept = self._load_seconds.get(new)
                if kept is None:
                    self._load_seconds[new] = loads
                else:  # (the same buckets: both made from LOAD_BUCKETS)
                    kept.counts = [mine + theirs for mine, theirs in zip(kept.counts, loads.counts)]
                    kept.sum += loads.sum
            requests = _totals(self.protocol_requests, old, "protocol", "outcome")
            new_counters = self._request_counters.setdefault(new, {})
            for protocol, outcome in self._request_counters.pop(old, {}):
                counter = new_counters.get((protocol, outcome))
                if counter is None:
                    counter = new_counters[(protocol, outcome)] = self.protocol_requests.labels(new, protocol, outcome)
                counter.inc(requests.get((protocol, outcome), 0.0))
                _remove_series(self.protocol_requests, old, protocol, outcome)
            events = _totals(self.repository_events, old, "event")
            for event in self._events.pop(old, ()):
                self._events.setdefault(new, set()).add(event)
                self.repository_events.labels(new, event).inc(events.get((event,), 0.0))
                _remove_series(self.repository_events, old, event)

    def serve(self, addr: str, idle_timeout_s: float = IDLE_TIMEOUT_S, origin: str = "server.metrics_addr") -> int:
        """Serve these metrics on ``host:port`` (see :meth:`MetricsEndpoint.serve`); returns the bound port."""
        return self.endpoint.serve(addr, idle_timeout_s, origin)

    def close(self) -> None:
        """Stop serving them."""
        self.endpoint.close()


def _created_series_on() -> bool:
    """Whether series carry ``_created``, as prometheus_client's own counters do: not where
    PROMETHEUS_DISABLE_CREATED_SERIES (or its disable_created_metrics()) turned them off, a choice it keeps in a
    module global (read here alone; on if the name goes away)."""
    return getattr(prometheus_metrics, "_use_created", True)


def _add_histogram(family: HistogramMetricFamily, model: str, buckets: list[tuple[str, int]], total: float,
                   created: float | None) -> None:
    """One model's histogram in ``family``, with its ``_created`` sample when ``created`` is given
    (HistogramMetricFamily.add_metric takes no created= as the counters' does)."""
    family.add_metric([model], buckets, total)
    if created is not None:
        family.samples.append(Sample(f"{family.name}_created", {"model": model}, created))


def _remove_series(metric: Counter, *labels: str) -> None:
    """Remove one label set of ``metric``; one that was never made is no error."""
    with contextlib.suppress(KeyError):  # (older prometheus_client releases raise KeyError for it)
        metric.remove(*labels)


def _totals(counter: Counter, model: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The value of each series of ``counter`` under ``model``, by the values of its other ``labels``.

    Read through collect() (the public way): a rename is rare, and a child's value has no public getter.
    """
    return {tuple(sample.labels[label] for label in labels): sample.value
            for family in counter.collect() for sample in family.samples
            if sample.name.endswith("_total") and sample.labels.get("model") == model}


class _LoadDurations(Collector):
    """``nereid_model_load_duration_seconds``, from a :class:`ServerMetrics`' load durations at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily("nereid_model_load_duration_seconds", "Time to load a model.",
                                       labels=["model"])
        for name, buckets, total, since in self._metrics.load_durations():  # (_created: the README walkthrough)
            _add_histogram(family, name, buckets, total, since if _created_series_on() else None)
        yield family


class _RepositoryCollector(Collector):
    """Every per-model figure, read from the repository at scrape time."""

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository
        self._runtime_reports = _RuntimeReports()

    def collect(self) -> Iterator[Metric]:
        success = CounterMetricFamily("nereid_request_success", "Requests answered with outputs.", labels=["model"])
        failure = CounterMetricFamily("nereid_request_failure", "Requests answered with an error, by reason.",
                                      labels=["model", "reason"])
        submitted = CounterMetricFamily("nereid_batcher_submitted", "Requests admitted to the model's queue.",
                                        labels=["model"])
        completed = CounterMetricFamily("nereid_batcher_completed", "Requests whose execution succeeded.",
                                        labels=["model"])
        histograms = {attr: HistogramMetricFamily(name, text, labels=["model"]) for name, text, attr in _HISTOGRAMS}
        depth = GaugeMetricFamily("nereid_queue_depth", "Requests waiting in the model's queue, those of its old "
                                  "versions still finishing their requests (after a reload or removal) included.",
                                  labels=["model"])
        utilization = GaugeMetricFamily("nereid_batch_utilization",
                                        "Busy / (busy + idle) of the model's executions since it loaded.",
                                        labels=["model"])
        # Now, not on average: a saturated or wedged model looked idle in the two above (queue empty, its one
        # instance busy; utilization creeping up from a long idle past).
        running = GaugeMetricFamily("nereid_executions_running", "Executions of the model running now.",
                                    labels=["model"])
        busy = CounterMetricFamily("nereid_busy_seconds", "Seconds the model had at least one execution running "
                                   "(rate(): its utilization now).", labels=["model"])
        warm_parent = GaugeMetricFamily("nereid_warm_parent_resident_bytes",
                                        "Resident memory of the model's warm parent process (python backend).",
                                        labels=["model"])
        # An alert's series: a python model gone cold (its warm parents dying as they start) still answers, each
        # run a fresh interpreter's start slower, and said so only in its log.
        warm_start = GaugeMetricFamily("nereid_warm_start", "1 while the model's runs start warm (forked from its "
                                       "warm parent), 0 while each starts a fresh process (python backend).",
                                       labels=["model"])
        generation = GaugeMetricFamily("nereid_model_version", "Versions of the model loaded so far (every load "
                                       "and reload that became READY adds one).", labels=["model"])
        states = GaugeMetricFamily("nereid_models", "Model folders by state.", labels=["state"])
        model_state = GaugeMetricFamily("nereid_model_state", "1 for the model's state, 0 for the others: which "
                                        "model is UNAVAILABLE, LOADING or UNLOADING.", labels=["model", "state"])
        counts = {state.value: 0 for state in ModelState}
        for entry in self._repository.entries():
            counts[entry.state.value] += 1
            for state in ModelState:
                model_state.add_metric([entry.name, state.value], 1 if entry.state is state else 0)
            if entry.generation:
                generation.add_metric([entry.name], entry.generation)
        # Every version's queue counts, old versions still finishing their requests (after a reload, a removal)
        # included: what waits there is still to be answered. The other figures are the serving version's, or,
        # for a removed folder's model finishing its requests, that version's until it is released (a reload's
        # old version shares the serving one's statistics).
        versions: dict[str, LoadedVersion] = {}
        waiting: dict[str, int] = {}
        for name, loaded in self._repository.versions():
            versions.setdefault(name, loaded)
            waiting[name] = waiting.get(name, 0) + loaded.scheduler.queue_depth
        reports = self._runtime_reports.ask({name: loaded.backend for name, loaded in versions.items()})
        for name, loaded in sorted(versions.items()):
            stats = loaded.stats.snapshot()
            created = stats.created if _created_series_on() else None
            success.add_metric([name], stats.success.count, created=created)
            submitted.add_metric([name], stats.batcher.total_submitted, created=created)
            completed.add_metric([name], stats.batcher.total_completed, created=created)
            for reason, count in sorted(stats.failures_by_reason.items()):
                failure.add_metric([name, reason], count, created=created)
            for attr, family in histograms.items():
                histogram: StatsHistogram = getattr(stats, attr)
                _add_histogram(family, name, histogram.cumulative(), histogram.sum, created)
            utilization.add_metric([name], stats.batcher.utilization)
            running.add_metric([name], stats.running_executions)
            busy.add_metric([name], stats.batcher.busy_time_s, created=created)
            report = _usable_report(name, reports[name]) if name in reports else None
            if report is not None and report.warm_parent_resident_bytes is not None:
                warm_parent.add_metric([name], int(report.warm_parent_resident_bytes))
            if report is not None and report.warm_start is not None:
                warm_start.add_metric([name], 1 if report.warm_start else 0)
        for name, count in sorted(waiting.items()):
            depth.add_metric([name], count)
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (success, failure, submitted, completed, *histograms.values(), depth, utilization, running, busy,
                    warm_parent, warm_start, generation, states, model_state)


def _usable_report(name: str, report: Future) -> RuntimeReport | None:
    """Model ``name``'s runtime_report(), for its warm start gauges; None (logged once per model) when the call
    failed, returned what cannot be used, or has not returned yet."""
    if not report.done():
        _report_failures.warning(f"{name} hangs", "model '%s': runtime_report() has not returned within %g s; its warm "
                                 "start gauges are left out until it does", name, RUNTIME_REPORT_WAIT_S)
        return None
    try:
        value = report.result()
        # Judged here, not left to the exposition: a value prometheus_client cannot encode failed the whole
        # scrape (HTTP 500, every model's figures lost) after the collector had ended.
        problem = runtime_report_problem(value)
    except ThreadStartFailed as err:  # the server's condition, not the plugin's fault: said so
        _report_failures.warning(f"{name} no thread", "model '%s': its runtime_report() could not be asked (a thread "
                                 "cannot start: %s); its warm start gauges are left out", name,
                                 str(err.cause) or type(err.cause).__name__)
        return None
    except plugin_failures() as err:  # a plugin's fault (a sys.exit() too) must not fail the scrape
        problem = describe_exception(err)
    if problem:
        _report_failures.warning(name, "model '%s': runtime_report() failed (%s); its warm start gauges are left "
                                 "out", name, problem)
        return None
    return value


class _RuntimeReports:
    """Models' ``runtime_report()`` calls, each on a thread of its own, waited for a bounded time.

    A call that has not returned by the end of a scrape's wait is not asked again: later scrapes take the same
    call's answer once it comes, so a hung plugin holds one thread, not one more per scrape; and they do not wait
    for it again (every later scrape took the full second while it hung; the plugin hunt).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[object, Future]] = {}  # model name -> (backend asked, its call)

    def ask(self, backends: dict[str, object]) -> dict[str, Future]:
        """The calls of the backends (by model name) that report how they run, done or not after the wait."""
        calls: dict[str, Future] = {}
        started: list[Future] = []  # asked by this scrape: the only calls it waits for
        with self._lock:
            for gone in self._pending.keys() - backends.keys():  # (unloaded while its call hung)
                del self._pending[gone]
            for name, backend in backends.items():
                if not isinstance(backend, ReportsRuntime):
                    continue
                pending = self._pending.get(name)
                # A new version's backend (a reload) is asked even while the old one's call hangs.
                if pending is None or pending[0] is not backend:
                    # Recorded before the wait: a scrape overlapping this one waits on the same call.
                    pending = self._pending[name] = (backend, _call_on_thread(name, backend))
                    started.append(pending[1])
                calls[name] = pending[1]
        wait_for_futures(started, timeout=RUNTIME_REPORT_WAIT_S)
        with self._lock:
            for name, call in calls.items():
                if call.done() and self._pending.get(name, (None, None))[1] is call:
                    del self._pending[name]  # answered: the next scrape asks again
        return calls


def _call_on_thread(name: str, backend: ReportsRuntime) -> Future:
    """``backend.runtime_report()`` started on a daemon thread (one that hangs must not hold the server's exit);
    its call fails with :class:`~nereid.daemon_pool.ThreadStartFailed` when the thread cannot start."""
    call: Future = Future()

    def run() -> None:
        try:
            call.set_result(backend.runtime_report())
        except BaseException as err:  # noqa: B036 - handed to the scrape, which judges it as a plugin's fault
            call.set_exception(err)
    try:
        threading.Thread(target=run, name=f"nereid-runtime-report-{name}", daemon=True).start()
    except RuntimeError as err:
        # "can't start new thread" (RLIMIT_NPROC, memory): it failed the whole scrape, whose connection then closed
        # unanswered, a raw traceback on stderr. The model's gauges are left out; the next scrape asks again.
        call.set_exception(ThreadStartFailed(err))
    return call
