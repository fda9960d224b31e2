"""The nereid server: repository + data plane + gRPC, HTTP, health and metrics surfaces on one asyncio loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections import Counter
from dataclasses import replace

import grpc
import pluggy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nereid.dataplane import DataPlane
from nereid.descriptor_watch import DescriptorWatch
from nereid.files import warn_if_file_names_not_utf8
from nereid.leftovers import (asked_temporary_directory, make_scratch_folder, remove_scratch_folder,
                              remove_stale_scratch)
from nereid.listening import bind_problem, cannot_listen, with_port
from nereid.log_limit import say_suppressed_counts_now
from nereid.loop_watch import LoopWatch
from nereid.metrics import ServerMetrics
from nereid.model_entry import ModelState
from nereid.plugins import make_plugin_manager, plugin_code
from nereid.protocol.grpc_service import (MAX_SEND_MESSAGE_BYTES, SERVICE_NAME, InferenceServicer, generic_handler,
                                          status_message)
from nereid.protocol.http_listener import HttpListener
from nereid.protocol.http_service import HttpSurface
from nereid.repository import ModelRepository
from nereid.run_folders import warn_if_sockets_cannot_fit
from nereid.scheduler import REQUEST_STARTED
from nereid.processes import kill_children, release_early_stops, stop_new_children, stop_signals
from nereid.settings import Listeners, ServerSettings, Settings, repository_control_allowed
from nereid.tensors import InferRequest, InferResponse
from nereid.tls import server_credentials, ssl_context
from nereid.watch import RepositoryWatcher

log = logging.getLogger(__name__)

# At shutdown, how long past shutdown_grace_s gRPC's stop still waits before cancelling the calls left: the
# requests still running at the grace are answered then (UNAVAILABLE), and their answers need time to be sent.
ANSWER_AT_GRACE_S = 1.0
# How long after shutdown_grace_s uvicorn ends the HTTP requests still running: after the data plane has
# marked the grace as passed, so that they count as answered UNAVAILABLE rather than cancelled by a client.
HTTP_END_AFTER_GRACE_S = 0.2
# gRPC calls received but not yet taken by the server that gRPC's core holds rather than cancels (below).
MAX_PENDING_CALLS = 100_000


class HealthService(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health``: Check, and Watch streams that end at shutdown once they have said NOT_SERVING.

    grpc_health's own servicer keeps a Watch stream open for as long as its client
    does, and a graceful gRPC stop waits for every open call: one idle watcher
    (Envoy, gRPC client-side health checking, a load balancer) made every SIGTERM
    last the whole ``shutdown_grace_s``. Here :meth:`shut_down` publishes
    NOT_SERVING for good, and each Watch stream, once it has sent that, ends with
    UNAVAILABLE: what a health client sees of a server going away, and retries
    elsewhere. (Ending grpc_health's own Watch from outside would cancel it in
    the middle of a write: only the loop that writes may end it.)
    """

    def __init__(self) -> None:
        self._status: dict[str, int] = {}  # service name -> ServingStatus; unknown until first set
        self._changed = asyncio.Condition()  # notified on each change of _status or _closing
        self._closing = False

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, status_message(f"unknown service {request.service!r}"))
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: object, context: grpc.aio.ServicerContext) -> object:
        """Every service's status, as grpc_health answers it (health.proto's List, grpcio-health-checking 1.70 and
        later): left to the generated base class, each call raised NotImplementedError, logged by grpcio as an ERROR
        with its traceback, unbounded (the clients hunt)."""
        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=status) for service, status in self._status.items()})

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """Send the service's status now and on each change, as grpc_health does; end once shutting down."""
        def current() -> int:
            return self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

        sent: int | None = None
        while True:
            if current() != sent:
                sent = current()
                await context.write(health_pb2.HealthCheckResponse(status=sent))
                continue  # (the status may have changed again while it was written)
            if self._closing:  # and NOT_SERVING has been sent (shut_down set it before _closing)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "the server is shutting down (it has stopped serving; it closes this stream "
                                    "rather than have it wait out shutdown_grace_s)")
            async with self._changed:
                await self._changed.wait_for(lambda: self._closing or current() != sent)

    async def set(self, service: str, status: int) -> None:
        """Publish ``service``'s status to Check and to its Watch streams (ignored once shut down)."""
        async with self._changed:
            if not self._closing:
                self._status[service] = status
                self._changed.notify_all()

    async def shut_down(self) -> None:
        """NOT_SERVING for every service, for good; each Watch stream ends once it has sent that."""
        async with self._changed:
            for service in self._status:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._closing = True
            self._changed.notify_all()


def say_not_starting(came: signal.Signals) -> None:
    """Say that the stop signal ``came`` before the server started, which therefore does not start."""
    log.info("signal received (%s) before the server started: not starting", came.name)


class NereidServer:
    """One running server. ``start`` binds and begins loading models; ``stop`` drains and exits."""

    def __init__(self, settings: Settings, manager: pluggy.PluginManager | None = None,
                 bind_addr: str | None = None, listeners: Listeners | None = None) -> None:
        """``listeners``: ``nereid serve``'s ``--bind``, ``--http-bind`` and ``--metrics-bind``, each replacing
        its nereid.yaml key; ``bind_addr`` alone stands for ``--bind``."""
        self.settings = settings
        listeners = listeners or Listeners(bind_addr)
        # Each with what an error about it names, as the operator wrote it.
        self.bind_addr, self.bind_origin = listeners.grpc(settings.server)
        self.http_addr, self.http_origin = listeners.http(settings.server)
        self.metrics_addr, self.metrics_origin = listeners.metrics(settings.server)
        self.manager = manager or make_plugin_manager()
        # The folder asked for, not tempfile's choice: one that dead servers' folders fill is passed over by
        # tempfile, and those folders would never be removed.
        remove_stale_scratch(asked_temporary_directory())
        self.scratch_dir = make_scratch_folder()
        warn_if_sockets_cannot_fit(self.scratch_dir)
        warn_if_file_names_not_utf8()
        self.metrics = ServerMetrics()
        # The server is the models' ModelCaller: a meta model's sub-calls go through the data plane.
        self.repository = ModelRepository(settings, self.manager, self.scratch_dir, events=self.metrics, models=self,
                                          on_state_change=self._readiness_may_have_changed)
        self.metrics.collect_from(self.repository)
        self.metrics_port: int | None = None
        self.repository_control = repository_control_allowed(replace(settings.server, http_addr=self.http_addr),
                                                             self.bind_addr)
        self.dataplane = DataPlane(self.repository, settings, repository_control=self.repository_control,
                                   on_repository_change=self.update_health)
        self.port: int | None = None
        self.http_port: int | None = None
        self._http: HttpListener | None = None
        self._grpc: grpc.aio.Server | None = None
        self._servicer: InferenceServicer | None = None
        self._health = HealthService()
        self._health_lock = asyncio.Lock()  # one update at a time: each publishes readiness as it is then
        self._published: int | None = None  # the status the health service has (None: not set yet)
        self._holders_said = ""  # what the last "server not ready" line named as holding readiness back
        self._health_updates: set[asyncio.Task] = set()  # scheduled updates, kept until done
        self._stopping: asyncio.Task | None = None  # the one stop, which a second call waits for
        self.watcher: RepositoryWatcher | None = None
        self._watching: asyncio.Task | None = None
        # The store could not be listed at start: listing it until it answers, then loading what it holds.
        self._loading_once_listed: asyncio.Task | None = None
        self._loop_watch: LoopWatch | None = None
        self._descriptor_watch = DescriptorWatch()  # (gRPC's core, silenced, says nothing of a refusing port)

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run a request from inside the server (a meta model's sub-call), exactly as a client's would run, but
        for a full queue: the sub-call waits for room, bounded by its deadline, as a gRPC stream's request does.
        Refused at once, a fan-out wider than a sub-model's queue_capacity failed every request, on an idle
        server, "retry later" (the pipelines hunt); Triton's BLS and ensemble sub-requests queue."""
        # Each sub-call its own "has the model's code run for it" (a context variable): the orchestration's task
        # carried the first hooked sub-call's True into every later one, which then took a full queue for a
        # refusal after a hook had run, and was refused at once (the review hunt). What ran stays known to it.
        token = REQUEST_STARTED.set(False)
        try:
            return await self.dataplane.infer(request, wait_for_room=True)
        finally:
            ran = REQUEST_STARTED.get()
            REQUEST_STARTED.reset(token)
            if ran:
                REQUEST_STARTED.set(True)

    async def start(self) -> int:
        """Bind the port and start serving; returns the bound port. Models load in :meth:`load_models`.

        A start that fails (an address in use: OSError) closes what it had opened and removes the scratch
        folder before raising: the process exits next, and nothing else would.
        """
        config = self.settings.server
        server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
            # gRPC refuses a larger request with RESOURCE_EXHAUSTED from its length prefix, before
            # buffering it ("received message larger than max (N vs. LIMIT)").
            ("grpc.max_receive_message_length", config.max_message_bytes),
            # Without this a second server on the same port starts silently and steals half the calls.
            ("grpc.so_reuseport", 0),
            # grpcio's asyncio server takes new calls one per turn of the loop; gRPC's core answers the calls past
            # its limit of those not yet taken (1,000 soft, 3,000 hard by default) CANCELLED, before nereid sees
            # them. A burst of clients is answered whole instead; its data is held either way (it has arrived),
            # and queue_capacity still bounds what waits for a model.
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ])
        try:
            return await self._start(server)
        except BaseException:
            await self._close_after_failed_start(server)
            raise

    async def _start(self, server: grpc.aio.Server) -> int:
        config = self.settings.server
        control = self.repository_control
        servicer = InferenceServicer(self.dataplane, functools.partial(self.metrics.count_request, "grpc"),
                                     count_refused=functools.partial(self.metrics.count_refused, "grpc"))
        server.add_generic_rpc_handlers((generic_handler(servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._check_grpc_address()  # before anything is opened
        if self.metrics_addr:
            self.metrics_port = self.metrics.serve(self.metrics_addr, origin=self.metrics_origin)
            log.info("metrics at http://%s/metrics", with_port(self.metrics_addr, self.metrics_port))
        if self.http_addr:
            surface = HttpSurface(self.dataplane, config.max_message_bytes,
                                  functools.partial(self.metrics.count_request, "http"),
                                  max_json_bytes=config.http_max_json_bytes)
            # uvicorn ends the requests still running a moment after the grace, once the data plane counts it
            # as passed (see stop): they are counted as answered UNAVAILABLE, not as cancelled by their client.
            self._http = HttpListener(surface, ssl_context(config.tls) if config.tls else None,
                                      config.shutdown_grace_s + HTTP_END_AFTER_GRACE_S,
                                      count_refused=functools.partial(self.metrics.count_refused, "http"))
            self.http_port = await self._http.start(self.http_addr, origin=self.http_origin)
            # (Said as the gRPC line says it: whether a client must speak TLS to it, as the security hunt asked.)
            log.info("KServe V2 REST on %s (%s)", with_port(self.http_addr, self.http_port), _transport(config))
        # Bound last and started at once: a gRPC server that is never started keeps its port open until the
        # process exits, stopped or not. Tried again first: the HTTP or metrics listener may have taken it.
        self._check_grpc_address()
        port = self._add_grpc_port(server)
        await server.start()
        self._grpc, self._servicer, self.port = server, servicer, port
        self._loop_watch = LoopWatch(asyncio.get_running_loop(), plugin_code=plugin_code(self.manager))
        self._loop_watch.start()
        self._descriptor_watch.start()
        await self.update_health()
        log.info("nereid listening on %s (%s, repository control %s)", with_port(self.bind_addr, port),
                 _transport(config), "on" if control else "off")
        return port

    def _check_grpc_address(self) -> None:
        """OSError naming :attr:`bind_addr`, where it came from and the system's reason, when gRPC could not bind it.

        Tried as gRPC would bind it: gRPC's own failure is a line of its core on
        stderr, then an error that gives no reason ("Failed to bind to address").
        """
        problem = bind_problem(self.bind_addr)
        if problem is not None:
            raise cannot_listen(self.bind_addr, self.bind_origin, problem)

    def _add_grpc_port(self, server: grpc.aio.Server) -> int:
        """Bind :attr:`bind_addr` on ``server``; an OSError naming the address and where it came from if not."""
        config = self.settings.server
        try:
            if config.tls is not None:
                port = server.add_secure_port(self.bind_addr, server_credentials(config.tls))
            else:
                port = server.add_insecure_port(self.bind_addr)
        except RuntimeError as err:  # grpc raises when the address cannot be bound (taken since it was tried)
            raise cannot_listen(self.bind_addr, self.bind_origin, str(err)) from None
        if port == 0:
            raise cannot_listen(self.bind_addr, self.bind_origin)
        return port

    async def _close_after_failed_start(self, server: grpc.aio.Server) -> None:
        """Close whatever a failed :meth:`start` had opened, and remove the scratch folder."""
        try:
            closing = [server.stop(None), *([self._http.stop()] if self._http is not None else [])]
            for outcome in await asyncio.gather(*closing, return_exceptions=True):
                if isinstance(outcome, Exception):  # (the start's own error is the one reported)
                    log.warning("closing after a failed start: %s", outcome)
            self._http = None
            self.metrics.close()
        finally:
            if self._loop_watch is not None:
                self._loop_watch.stop()
            self._descriptor_watch.stop()
            remove_scratch_folder(self.scratch_dir)

    async def load_models(self) -> None:
        """Load the start-up models concurrently; failures leave them UNAVAILABLE with a reason.

        With ``server.watch``, the repository is followed from here on (see :mod:`nereid.watch`).
        """
        if self.settings.server.watch and self.watcher is None:
            self.watcher = RepositoryWatcher(self.repository, self.settings, after_apply=self.update_health)
            await self.watcher.prime()  # before loading: a change made during the loads is seen
            # Folders found from here on are the watcher's to load; unlisted ones seen so far wait for a load.
            self.repository.watch_started()
            self._watching = asyncio.create_task(self.watcher.run())
            server = self.settings.server
            if server.ml_backends_url is None:
                log.info("dynamic repository: watching %s and %s (settle %g ms)", server.ml_backends_path,
                         self.settings.source, server.watch_settle_ms)
            else:  # (ml_backends_path is then the bucket's local cache folder: not what the operator named)
                log.info("dynamic repository: polling %s every %g s and watching %s (settle %g ms)",
                         server.ml_backends_url, server.watch_poll_s, self.settings.source, server.watch_settle_ms)
        starting = self.repository.startup_models()
        if not starting and not self.repository.entries() and not self.repository.waiting_for_listing():
            # (An empty volume mount or a path's typo served nothing, ready, unsaid; the CLI hunt.)
            log.warning("no model folders in %s: the server is ready and serves no model%s",
                        self.settings.server.ml_backends_url or self.settings.server.ml_backends_path,
                        " until one is copied in (server.watch)" if self.settings.server.watch else "")
        unlisted = sorted({entry.name for entry in self.repository.entries()} - set(starting))
        if unlisted:  # (their index entries say it too; a folder dropped in under a watch, then a restart)
            log.info("not listed in %s, so not loaded: %s (%s)", self.settings.config_name,
                     ", ".join(f"'{name}'" for name in unlisted),
                     "RepositoryModelLoad loads one" if self.repository_control
                     else "list one under models: to serve it; RepositoryModelLoad is off")
        if self.repository.waiting_for_listing() and self._loading_once_listed is None:
            # Not awaited here: a store down for an hour must not hold up load_models (nor a stop, which cancels it).
            self._loading_once_listed = asyncio.create_task(self._load_once_listed(),
                                                            name="nereid: listing the store until it answers")
        await asyncio.gather(*(self.repository.load(name) for name in starting))
        await self.update_health()

    async def _load_once_listed(self) -> None:
        """List the store that could not be listed at start until it answers, then load every folder it holds,
        as at start (ServerReady is false until then)."""
        found = await self.repository.list_until_answered()
        await asyncio.gather(*(self.repository.load(name) for name in found))
        await self.update_health()

    async def update_health(self) -> None:
        """Mirror readiness into grpc.health.v1 (what Kubernetes probes call); a status already published is not
        sent again, so Watch streams hear only changes."""
        async with self._health_lock:  # (a set awaits its watchers: an older update must not land last)
            status = self._health_status()
            if status == self._published:
                self._log_holders_settled(status)
                return
            for service in ("", SERVICE_NAME):
                await self._health.set(service, status)
            self._published = status
            self._log_readiness(status)

    def _log_readiness(self, status: int) -> None:
        """Say each change of the server's readiness, and what holds it back: an operator chasing a pod that is
        not ready had only the models' own lines to infer it from (the operator hunt)."""
        if status == health_pb2.HealthCheckResponse.SERVING:
            log.info("server ready (ServerReady, /v2/health/ready and the gRPC health service say so)")
        elif not (self.dataplane.shutting_down or self.dataplane.leaving):  # (the stop says so itself)
            self._say_not_ready("server not ready", self.repository.holding_readiness(), again=True)

    def _log_holders_settled(self, status: int) -> None:
        """Say again what holds readiness back once the loads it named have ended, still not READY: the line
        said as readiness turned named them LOADING, and stayed the last word after they ended UNAVAILABLE (the
        operator hunt). Only at such settled points, so a start of 500 models says it twice, not 500 times."""
        if status == health_pb2.HealthCheckResponse.SERVING or self.dataplane.shutting_down or self.dataplane.leaving:
            return
        held = self.repository.holding_readiness()
        if held and all(state == ModelState.UNAVAILABLE.value for _, state in held):
            self._say_not_ready("server still not ready", held, again=False)

    def _say_not_ready(self, opening: str, held: list[tuple[str, str]], again: bool) -> None:
        """Log ``opening``: the models ``held`` (name, state) holding readiness back; not ``again`` when this very
        list was the last one said."""
        named = [f"'{name}' {state}" for name, state in held]
        why = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
        said = f"model(s) not READY: {why}" if named else "the repository is not listed yet"
        if again or said != self._holders_said:
            self._holders_said = said
            log.info("%s: %s", opening, said)

    def _health_status(self) -> int:
        return (health_pb2.HealthCheckResponse.SERVING if self.dataplane.ready()
                else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _readiness_may_have_changed(self) -> None:
        """The repository changed a state (a load starting, a rescan forgetting a folder, ...): publish readiness.

        Called synchronously, on the loop, in the middle of repository operations; the health service's set is
        a coroutine, so the update runs as a task of its own, and only when the status would change.
        """
        if self._grpc is None or self._health_status() == self._published:
            return  # before start (start publishes), or nothing to say
        task = asyncio.get_running_loop().create_task(self.update_health())
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let accepted requests finish (bounded by the grace), unload models.

        A second call (an embedder's, during a signal's stop) waits for the first stop to end rather than run a
        second drain beside it.
        """
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(grace_s), name="nereid-stop")
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float | None) -> None:
        grace = self.settings.server.shutdown_grace_s if grace_s is None else grace_s
        grace_ends = time.monotonic() + grace
        self.dataplane.shutting_down = True
        self._log_work_left()
        # The folder is no longer followed: a change during the grace would start a load, or a drain of its
        # own, that the shutdown then waits for.
        if self.watcher is not None and self._watching is not None:
            self.watcher.stop()
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        # A client's load still running is abandoned now, its client answered: the drain below would wait for its
        # call, as long as the backend's load() takes.
        self.repository.abandon_loads()
        self.repository.release_without_turns()
        if self._loading_once_listed is not None:  # (its loads are abandoned, as start-up loads are)
            self._loading_once_listed.cancel()
            await asyncio.gather(self._loading_once_listed, return_exceptions=True)
        if self._grpc is not None:
            await self.update_health()  # NOT_SERVING (shutting down), before any listener closes
            # The graceful stop below waits for every open call, idle streams too: end those with nothing left to
            # answer, Watch streams once they have sent NOT_SERVING, so the stop waits only for requests.
            await self._health.shut_down()
            if self._servicer is not None:
                self._servicer.close_streams()
            # gRPC's stop would cancel every call still open at its deadline, so that a stream's requests got no
            # answer: nereid ends them itself at the grace, each with its answer, and gRPC's deadline comes later.
            stopping = asyncio.gather(self._grpc.stop(grace + ANSWER_AT_GRACE_S),
                                      *([self._http.stop(grace)] if self._http is not None else []))
            done, _ = await asyncio.wait([stopping], timeout=grace)
            if not done:
                self.dataplane.grace_passed = True
                # Before the running calls end: each frees a slot that would start a queued request.
                self.repository.stop_starting()
                assert self._servicer is not None  # (set with _grpc)
                ended = self._servicer.end_at_grace(cut_in_s=ANSWER_AT_GRACE_S)
                if ended:
                    # (Queued or running: "in flight" says both; a queued one's answer says it was not run.)
                    log.warning("%d gRPC inference request(s) still in flight after the %g s grace: answering "
                                "them UNAVAILABLE", ended, grace)
            await stopping
            if self._servicer is not None and (stuck := self._servicer.never_answered_after_grace()):
                # Said after the fact: the line above only asked them to end.
                log.warning("%d answer(s) never reached their clients: gRPC's stop cut their calls off, a model's "
                            "code not having ended when cancelled (a coroutine that swallows CancelledError), and in "
                            "a stream the answers after its request waiting behind it", stuck)
        # The listeners are closed once every client has its answer, but a run whose client went away holds its
        # slot until its program ends, at a stop as at an unload: it has what is left of the grace. Then what
        # still runs is ended rather than waited for.
        if not self.dataplane.grace_passed:
            await self.repository.wait_idle(max(0.0, grace_ends - time.monotonic()))
        # The grace is over: nothing starts from here on, and a version a reload replaced, which may drain within
        # its model's timeout_s, ends now too (its clients all gone, only the listeners' wait had not said so).
        self.repository.stop_starting()
        await self.repository.terminate_running()
        await self.repository.unload_all(grace_s=0)
        self.metrics.close()
        remove_scratch_folder(self.scratch_dir)
        if self._loop_watch is not None:
            self._loop_watch.stop()
        self._descriptor_watch.stop()
        say_suppressed_counts_now()  # (their windows' timers would never run: the loop closes)
        log.info("nereid stopped")

    def _log_work_left(self) -> None:
        """Say, as the drain starts, what each model still has to do: what the grace is for."""
        running: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        in_hooks: Counter[str] = Counter()
        counted_stats: set[int] = set()
        for name, loaded in self.repository.versions():  # (an old version still draining counts with its name's)
            if id(loaded.stats) not in counted_stats:  # (a reload's versions share one ModelStats: counted once)
                counted_stats.add(id(loaded.stats))
                running[name] += loaded.stats.running_executions
            queued[name] += loaded.scheduler.queue_depth
            in_hooks[name] += loaded.scheduler.requests_in_hooks
        busy = [f"model '{name}': {running[name]} execution(s) running, {queued[name]} request(s) queued"
                + (f", {in_hooks[name]} in its hooks" if in_hooks[name] else "")
                for name in sorted(running | queued | in_hooks) if running[name] or queued[name] or in_hooks[name]]
        if busy:
            log.info("draining: %s", "; ".join(busy))

    async def leave(self, signum: signal.Signals) -> None:
        """Before a drain, for ``shutdown_delay_s``: report not ready (ServerReady, /v2/health/ready, the gRPC
        health service) while serving every request as before, so that load balancers stop sending clients
        before the listeners close. Nothing with a delay of 0."""
        delay = self.settings.server.shutdown_delay_s
        if not delay:
            return
        log.info("signal received (%s): not ready from now, serving on for %g s (shutdown_delay_s) before the "
                 "drain", signum.name, delay)
        self.dataplane.leaving = True
        await self.update_health()
        await asyncio.sleep(delay)

    async def serve_until_signalled(self) -> None:
        """Start, load, and run until SIGTERM, SIGINT or SIGHUP, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        came: list[signal.Signals] = []
        # SIGHUP too: a closed terminal or an ssh session that drops must not cut accepted requests off.
        stopping_on = stop_signals()

        def request_stop(signum: signal.Signals) -> None:
            came.append(signum)
            stop_requested.set()

        # `nereid serve` records stop signals until here (see nereid.cli.serve_command): handed over right where
        # the loop's handlers go in, one that came meanwhile means not starting.
        came_early = release_early_stops()
        for signum in stopping_on:
            loop.add_signal_handler(signum, request_stop, signum)
        if came_early is not None:
            say_not_starting(came_early)
            remove_scratch_folder(self.scratch_dir)
            return
        await self.start()
        loader = asyncio.create_task(self.load_models())
        loader.add_done_callback(_log_failed_start_up_loads)
        await stop_requested.wait()
        await self.leave(came[0])
        log.info("signal received: draining (%s; grace %g s)", came[0].name, self.settings.server.shutdown_grace_s)
        # Loads still running are abandoned (their threads are daemons and never delay the exit).
        loader.cancel()
        await self.stop()
        # Every model is unloaded now. An abandoned load (at start-up or through RepositoryModelLoad)
        # may have started programs (a compiler, a warm process) that nothing will stop: this
        # process is the server, so whatever it still has as children goes with it.
        stop_new_children()  # (a compile still waiting for its slot must not start one after the kill)
        killed = kill_children()
        if killed:
            log.info("ended %d process(es) left by abandoned loads or calls", killed)
        # From here the process only exits: a stop signal repeated now (a supervisor's retries) must not
        # end it with 143 or 130 after a clean stop. Ignored from now on, and taken off asyncio's own list of the
        # signals it handles, whose close would otherwise put back the defaults (no public call lets one go
        # without that reset, which would leave a moment with the default in place).
        handled = getattr(loop, "_signal_handlers", {})
        for signum in stopping_on:
            signal.signal(signum, signal.SIG_IGN)
            handled.pop(signum, None)
        if not handled:  # what asyncio's removal of its last handler does: the loop's socket is closed next
            signal.set_wakeup_fd(-1)


def _log_failed_start_up_loads(loader: asyncio.Task) -> None:
    """Log what ended the loading of the start-up models, which is never a model's failure to load (that leaves
    it UNAVAILABLE with its reason): a bug. Raised in a task nothing awaits, it was said nowhere, its models left
    LOADING for good (the deploy hunt's unsearchable ml_backends_path)."""
    if not loader.cancelled() and loader.exception() is not None:
        log.error("loading the start-up models failed: %s", loader.exception(), exc_info=loader.exception())


def _transport(config: ServerSettings) -> str:
    """What a client of the gRPC and HTTP listeners must speak: ``mutual TLS``, ``TLS`` or ``plaintext``."""
    return "mutual TLS" if config.tls and config.tls.client_ca else "TLS" if config.tls else "plaintext"
