"""Mapping nereid's ``device`` setting to a PJRT client and device.

``cpu`` is jax's CPU client; ``cuda`` / ``cuda:<i>`` is the i-th local device of
jax's CUDA client (ordered by device id). A GPU that is not there is a load
error with the reason, so the model is UNAVAILABLE rather than silently on CPU.

jax starts every platform it has (``cpu``, and ``cuda`` where jax[cuda12] is
installed and an NVIDIA device node exists) the first time any backend is asked
for, whatever the platform asked for; a plugin that fails to start raises from
that first call only. :func:`started_backends` is that start, done once for the
process, keeping the error for the models that need the platform it cost.

jaxlib's kernels that run LAPACK on the host get LAPACK only when asked
(:func:`host_lapack_problem` asks, once per process, before a program is
compiled).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from nereid.backends.xla.cache import compilation_flags
from nereid.daemon_pool import make_room_for_threads
from nereid.errors import ConfigError
from nereid.model_hooks import code_lock
from nereid.settings import Device

log = logging.getLogger(__name__)

# jax registers NVIDIA GPUs as platform "cuda"; "gpu" is the generic alias.
_CUDA_PLATFORMS = ("cuda", "gpu")


@dataclass(frozen=True)
class PjrtTarget:
    """Where a model's programs compile and run: the PJRT client, one device, compile options."""

    client: Any
    device: Any
    compile_options: Any

    @property
    def platform(self) -> str:
        """The PJRT platform name (``cpu``, ``cuda``)."""
        return self.client.platform

    def describe(self) -> str:
        """``cuda:0 (NVIDIA H100)``-style text for logs."""
        return f"{self.platform}:{self.device.id} ({self.device.device_kind})"


# The first error jax raised while starting its backends in this process (None: none so far). jax raises it once,
# from whichever backend request came first (a cpu one too), then serves what did start and never mentions the
# platform that failed again: the models that wanted that platform need this text for their reason.
_start_error: str | None = None
# Concurrent loads: the one whose start fails records the error before another reads the backends.
_start_lock = threading.Lock()
_started = False  # jax's backends were asked for once, and answered (their thread pools run)
# compilation_flags() of XLA_FLAGS as XLA read it, when its first backend started (None: not started yet); and as
# they were the last time nereid looked before jax had started (a model.py may start it: see _note_flags).
_flags_at_start: str | None = None
_flags_before_start: str | None = None


def _jax_started() -> bool:
    """Whether jax has started its backends in this process (by nereid, or by a model.py's code), read from jax's
    private record of them without starting anything."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(vars(bridge).get("_backends")) if bridge is not None else False


def _note_flags() -> None:
    """Keep the flags as they are now, while jax has not started: the last look before a model's code may start it
    is what XLA read then (the review hunt: a model.py started jax, then the flags file was edited, and the flags
    of nereid's own first start were taken for XLA's)."""
    global _flags_before_start
    if not _jax_started():
        _flags_before_start = compilation_flags(os.environ)


def flags_in_force() -> str:
    """:func:`~nereid.backends.xla.cache.compilation_flags` of XLA_FLAGS as XLA read them, once, as its first
    backend started in this process (as they are now, before): what every program this process compiles is
    compiled with. A flags file edited while the server runs (a ConfigMap's), or a model.py setting XLA_FLAGS,
    changes nothing XLA compiles, and keyed by the flags read again at each load, a reload cached programs of
    the old flags under the new ones, for every server sharing the folder (the XLA read hunt)."""
    with _start_lock:
        if _flags_at_start is not None:
            return _flags_at_start
        return _flags_before_start if _jax_started() and _flags_before_start is not None else compilation_flags(
            os.environ)


def client_threads() -> int:
    """About how many threads jax's CPU client starts with itself (measured with jaxlib 0.10: 7 and 3 per CPU it
    may run on, its pools' sizes), and a margin: the room asked for before it starts (see make_room_for_threads)."""
    return 11 + 3 * len(os.sched_getaffinity(0))


def started_backends() -> tuple[dict[str, Any], str | None]:
    """jax's backends by platform, started if they were not, and the error of their start in this process.

    When a plugin fails to start (CUDA's, with a driver that does not match),
    jax has already kept the backends it started before it (``cpu`` is
    registered first), and asking again returns those: a cpu model loads
    whatever the CUDA plugin does. RuntimeError when even that fails (nothing
    started, as with ``JAX_PLATFORMS=cuda`` and a failing CUDA plugin).
    """
    from jax.extend import backend as jax_backend

    global _start_error, _started, _flags_at_start
    with _start_lock:
        _check_xla_flags()
        if not _started:
            # Its pools abort the process when a thread cannot start: refused here, at a process limit, instead.
            make_room_for_threads(client_threads())
            _note_flags()
        try:
            backends = jax_backend.backends()
            if not _started:
                _started, _flags_at_start = True, _flags_before_start
            return backends, _start_error
        except RuntimeError as err:
            if _start_error is None:
                _start_error = str(err)
        except AssertionError:
            # jax's own assert that some backend started: JAX_PLATFORMS=cuda where it sees no NVIDIA GPU (no
            # driver, none visible in the container) skips cuda and asserts, which said "AssertionError" alone.
            if _start_error is None:
                _start_error = _no_backend_reason()
        try:
            return jax_backend.backends(), _start_error
        except AssertionError:
            raise RuntimeError(_start_error) from None


def _no_backend_reason() -> str:
    """Why jax started no backend at all, in words."""
    listed = _jax_platforms()
    if not listed:
        return "jax started no backend"
    return (f"jax started none of the platforms JAX_PLATFORMS={listed!r} lists (cuda is skipped where jax sees no "
            "NVIDIA GPU: no driver, or none visible to this container); add cpu to it (JAX_PLATFORMS=cuda,cpu) or "
            "unset it")


# XLA_FLAGS as a child process found XLA to take it (None: not tried yet), and what refused it.
_flags_checked: tuple[str, str | None] | None = None
# How long the child that starts jax's backends with the server's XLA_FLAGS may take (it imports jax).
FLAGS_CHECK_TIMEOUT_S = 300


# What the xla backend's loads import of jax and jaxlib, imported together under CODE_LOCK first (see import_jax);
# the first two are needed, the others are imported where this jaxlib has them.
_JAX_MODULES = ("jax", "jax.extend.backend")
_JAX_MODULES_IF_ANY = ("jax.sharding", "jax._src.core", "jaxlib.xla_client", "jaxlib.mlir.ir",
                       "jaxlib.mlir.dialects.stablehlo", "jaxlib.mlir._mlir_libs._jax_mlir_ext")


# Whether import_jax has imported them all once.
_jax_imported = False


def import_jax(model: str) -> None:
    """Import what a bundle's load uses of jax and jaxlib, while no other load imports what model code imports
    (see :data:`nereid.model_hooks.CODE_LOCK`); ImportError when jax cannot be imported.

    jax's modules import each other in a circle: a bundle's load importing
    them for the first time while a meta model's model.py imported jax failed
    both models (``cannot import name 'AbstractValue' from partially
    initialized module 'jax._src.core'``) at every start of a server that had
    both. Imported once, later imports find them done.
    """
    global _jax_imported
    if _jax_imported:
        return  # (later loads take no lock)
    with code_lock(model):
        before = set(sys.modules)
        try:
            for name in _JAX_MODULES:
                importlib.import_module(name)
        except BaseException:
            _forget_modules_of(("jax", "jaxlib"), set(sys.modules) - before)
            raise
        for name in _JAX_MODULES_IF_ANY:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    _jax_imported = True


def _forget_modules_of(packages: tuple[str, ...], names: set[str]) -> None:
    """Remove from ``sys.modules`` those of ``names`` in ``packages``: what an import that failed part-way left
    there, initialised in part.

    A failed import of jax (``libjax_common.so: failed to map segment`` under
    ``ulimit -v``) left its submodules imported: the next load's import met
    them and failed with ``AttributeError: partially initialized module 'jax'
    has no attribute 'version'``, where it should say again why jax cannot be
    imported (and, jax installed meanwhile, import it).
    """
    for name in names:
        if name.partition(".")[0] in packages:
            sys.modules.pop(name, None)


def check_xla_flags(model: str) -> None:
    """The XLA_FLAGS check of :func:`started_backends`, for a load about to run model code in the server process
    that may start jax itself (a meta model's or a bundle's model.py): ConfigError naming ``model`` and XLA_FLAGS
    when XLA would end the process on them (see :func:`_check_xla_flags`)."""
    problem = xla_flags_problem()
    if problem is not None:
        raise ConfigError(f"model '{model}': {problem}")


def xla_flags_problem() -> str | None:
    """Why XLA refuses this process's XLA_FLAGS (it would end a process that starts its backends), found in a
    child process as a load finds it; None when it does not, or XLA_FLAGS is not set."""
    with _start_lock:
        _note_flags()  # (asked before a model's code runs, which may start jax)
        try:
            _check_xla_flags()
        except RuntimeError as err:
            return str(err)
    return None


def jax_missing(model: str, err: ImportError) -> ConfigError:
    """The reason of a load that needs jax where it cannot be imported."""
    return ConfigError(f"model '{model}': the xla backend needs jax, which cannot be imported ({err}); "
                       "pip install jax (jax[cuda12] for GPUs)")


def _check_xla_flags() -> None:
    """RuntimeError naming XLA_FLAGS when XLA aborts on it, found in a child process first.

    XLA reads XLA_FLAGS as its first backend starts, and a flag it does not
    know (a typo, one a newer jaxlib dropped) or a value that is no file of
    flags ends the process (its LOG(FATAL)): the server went down at its first
    bundle's load, every other model with it, saying nothing of its own, and
    ``nereid check`` with it. A child with the server's environment starts
    jax's backends once, when XLA_FLAGS is set; if XLA ends it (its fatal
    line), every bundle is refused with that line, and the server never starts
    them. A child killed by another hand decides nothing: the next load tries
    again (see :func:`child_verdict`).
    """
    global _flags_checked
    flags = os.environ.get("XLA_FLAGS", "")
    if not flags.strip():
        return
    if _flags_checked is None or _flags_checked[0] != flags:
        refusal = _xla_refusal(flags)
        if refusal is _UNDECIDED:
            return  # (the child was ended by something else: tried again at the next load)
        _flags_checked = flags, refusal
    refusal = _flags_checked[1]
    if refusal is not None:
        raise RuntimeError(refusal)


def _xla_refusal(flags: str) -> str | None:
    """What XLA said as it aborted on ``flags`` in a child process; None when it started its backends (or could not
    be asked); :data:`_UNDECIDED` when the child was killed before it could tell."""
    import subprocess
    import sys

    # (No GPU memory taken for good: jax takes most of each GPU's at its start, which the child hands back.)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        child = subprocess.run([sys.executable, "-c", "from jax.extend import backend; backend.backends()"],
                               env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=FLAGS_CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("XLA_FLAGS could not be checked in a child process (%s); the server starts jax's backends "
                    "with it as it is", err)
        return None
    return child_verdict(flags, child.returncode, child.stderr)


def child_verdict(flags: str, returncode: int, stderr: bytes) -> str | None:
    """What the child that started jax's backends with XLA_FLAGS ``flags`` tells of them, by its exit status and
    standard error: XLA's refusal, None (no refusal), or :data:`_UNDECIDED` (killed by another hand)."""
    if returncode == 0:
        return None
    # XLA's fatal line (glog's "F1205 08:17:37.048898 10067 file.cc:234] ..."), which ends the process (exit status
    # 1, or an abort); a Python error there is raised in this process too, and told as any start error is.
    fatal = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if _FATAL_LINE.match(line)]
    if fatal:
        return (f"XLA ends any process that starts it with XLA_FLAGS={flags!r} (a child process that tried died: "
                f"{fatal[-1][:400]}); correct or unset XLA_FLAGS in the server's environment")
    if returncode < 0:
        # Killed by another hand (an out-of-memory killer, a signal to the group): no verdict on the flags, which
        # were refused for the server's life when such a kill was taken for XLA's (the hunt of this session's
        # changes).
        log.warning("the child process checking XLA_FLAGS=%r was killed by signal %d before it could tell; "
                    "checked again at the next load", flags, -returncode)
        return _UNDECIDED
    return None


_UNDECIDED = "undecided"  # (what _xla_refusal says when the child could not tell)


_FATAL_LINE = re.compile(r"F\d{4} \d\d:\d\d:\d\d")


def _jax_platforms() -> str:
    """jax's platform list (``JAX_PLATFORMS``, or jax's jax_platforms config); empty when unset."""
    import jax

    return str(getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")).strip()


def _left_out_by_jax_platforms(platform: str) -> str | None:
    """Why ``platform`` did not start when JAX_PLATFORMS leaves it out; None when it is unset or lists it."""
    listed = _jax_platforms()
    if not listed:
        return None
    names = {name.strip() for name in listed.split(",")}
    if "gpu" in names:  # jax's alias for cuda, rocm and oneapi
        names.add("cuda")
    if platform in names:
        return None
    return (f"JAX_PLATFORMS={listed!r} in the server's environment leaves it out (jax starts only the platforms "
            f"listed there); add {platform} to it or unset it")


def resolve_device(device: Device, model: str, origin: str) -> PjrtTarget:
    """The PJRT client and device for ``device``; ConfigError naming the setting when unavailable."""
    import numpy as np

    try:
        import_jax(model)
        from jax.extend import backend as jax_backend
    except ImportError as err:
        raise jax_missing(model, err) from None

    where = f"model '{model}': device {device} ({origin})"
    try:
        backends, start_error = started_backends()
    except RuntimeError as err:
        # Nothing started at all: the error names the platform that stopped jax's start (maybe not this one).
        raise ConfigError(f"{where}: jax could not start any backend: {err}") from None
    if device.kind == "cpu":
        client = backends.get("cpu")
        if client is None:
            why = _left_out_by_jax_platforms("cpu") or start_error or f"jax started only {sorted(backends)}"
            raise ConfigError(f"{where}: jax has no cpu backend here: {why}")
        chosen = client.local_devices()[0]
    else:
        client, failures = None, []
        for platform in _CUDA_PLATFORMS:
            try:
                client = jax_backend.get_backend(platform)
                break
            except RuntimeError as err:
                failures.append(str(err))
        if client is None:
            if (left_out := _left_out_by_jax_platforms("cuda")) is not None:
                raise ConfigError(f"{where}: jax has no CUDA GPU backend here: {left_out}, or set device: cpu")
            if start_error is not None:
                # The CUDA plugin (or one started before it, which stopped jax's start) failed: its own words
                # ("Unable to initialize backend 'cuda': ..."), not the alias lookup's "Unknown backend".
                raise ConfigError(f"{where}: jax has no CUDA GPU backend here: {start_error}")
            # failures[0] is the "cuda" lookup: it carries the error of a CUDA plugin that failed quietly.
            raise ConfigError(f"{where}: jax has no CUDA GPU backend here ({failures[0]}); install jax with CUDA "
                              "support (pip install 'jax[cuda12]') on a machine with an NVIDIA GPU, or set "
                              "device: cpu")
        devices = sorted(client.local_devices(), key=lambda d: d.id)
        if device.index >= len(devices):
            seen = ", ".join(f"cuda:{i} ({d.device_kind})" for i, d in enumerate(devices))
            raise ConfigError(f"{where}: jax sees {len(devices)} GPU(s){': ' + seen if seen else ''}")
        chosen = devices[device.index]
    options = jax_backend.get_compile_options(num_replicas=1, num_partitions=1,
                                              device_assignment=np.array([[chosen.id]]), backend=client)
    return PjrtTarget(client, chosen, options)


# -- host LAPACK ------------------------------------------------------------------------------------
#
# jaxlib's kernels that call LAPACK on the host (every CPU linear-algebra custom call, lapack_spotrf_ffi and the
# like; on a GPU, the hybrid eig and pivoted-QR kernels cu_hybrid_*) are registered with XLA when jax is imported,
# but their LAPACK function pointers stay null until jaxlib is asked to fill them in from scipy
# (scipy.linalg.cython_lapack). jax asks only while it lowers a linear-algebra op; the server lowers nothing, so
# without asking itself the first such call jumps to a null pointer and the whole server dies with SIGSEGV.


@dataclass(frozen=True)
class _HostLapack:
    """One platform's jaxlib kernels that need LAPACK: their description, custom-call names and initialiser."""

    what: str
    targets: re.Pattern[bytes]
    initialize: Callable[[], None]


def _import_scipy_linalg_first() -> None:
    """Import scipy.linalg, whole, before jaxlib imports its submodules ``cython_blas`` and ``cython_lapack``.

    jaxlib's initialisers import those submodules directly, taking a submodule's import lock and then needing
    what scipy.linalg's own import holds: beside a model's ``import scipy.linalg`` on another thread (a meta
    model's orchestration importing it at its first request) one of the two failed with ``_DeadlockError:
    deadlock detected by _ModuleLock('scipy.linalg.cython_blas')`` (the thread-safety hunt). Importing the
    package first waits for the other thread's import to end instead. Without scipy, the initialiser says why.
    """
    with contextlib.suppress(ImportError):
        importlib.import_module("scipy.linalg")


def _initialize_cpu_lapack() -> None:
    _import_scipy_linalg_first()
    from jaxlib import lapack

    # prepare_lapack_call ("Initializes the LAPACK library and returns the LAPACK target name") is jaxlib's
    # public way in; the target name it returns is not needed. _lapack.initialize is what it calls.
    prepare = getattr(lapack, "prepare_lapack_call", None)
    if prepare is not None:
        import numpy as np

        prepare("potrf_ffi", np.float32)
    else:
        lapack._lapack.initialize()


def _initialize_gpu_hybrid_kernels() -> None:
    _import_scipy_linalg_first()
    from jaxlib import gpu_solver

    gpu_solver.initialize_hybrid_kernels()  # a no-op without jax's CUDA plugin


_HOST_LAPACK = {
    # The target names are held verbatim in MLIR text ("...") and bytecode (NUL-terminated) alike. A name must end
    # there; what comes before it is not checked, as in bytecode the first string follows a length byte that may
    # be any letter: a string that merely ends with such a name (a location) is taken for a call, never a call
    # missed.
    "cpu": _HostLapack("jaxlib's CPU linear algebra (LAPACK) kernels",
                       re.compile(rb"lapack_[a-z0-9]+(?:_ffi)?(?![\w.])"), _initialize_cpu_lapack),
    "cuda": _HostLapack("jaxlib's GPU kernels that run LAPACK on the host (eig, pivoted QR)",
                        re.compile(rb"cu_hybrid_[a-z0-9_]+(?![\w.])"), _initialize_gpu_hybrid_kernels),
}
# Per platform, once initialised: None, or why the kernels could not be initialised.
_host_lapack_errors: dict[str, str | None] = {}
_host_lapack_lock = threading.Lock()


def host_lapack_problem(platform: str, program: bytes, model: str) -> str | None:
    """Why ``program`` cannot run on ``platform`` here; None when it can, as far as host LAPACK goes.

    Before that, initialises (once per process, whatever the program) the
    kernels through which ``platform``'s programs call LAPACK on the host. When
    that fails, it is a warning for the process and a reason for each program
    that calls them: run, it would crash the server. The first initialisation
    imports all of scipy.linalg: a first import of a library, made under
    :data:`nereid.model_hooks.CODE_LOCK` (for ``model``), as every load's are.
    """
    key = "cuda" if platform in _CUDA_PLATFORMS else platform
    kernels = _HOST_LAPACK.get(key)
    if kernels is None:
        return None
    with _host_lapack_lock:
        if key not in _host_lapack_errors:
            with code_lock(model):
                _host_lapack_errors[key] = _initialise(kernels, key)
        error = _host_lapack_errors[key]
    if error is None:
        return None
    calls = sorted({name.decode() for name in kernels.targets.findall(program)})
    if not calls:
        return None
    return f"the program calls {kernels.what} ({', '.join(calls)}), which could not be initialised here: {error}"


def _initialise(kernels: _HostLapack, platform: str) -> str | None:
    """Initialise ``kernels``: None, or why they could not be (also logged as a warning)."""
    try:
        kernels.initialize()
        return None
    except ImportError as err:  # jaxlib without the module, or no scipy to take LAPACK from
        error = (f"{type(err).__name__}: {err} (jaxlib takes LAPACK from scipy.linalg.cython_lapack: "
                 "pip install scipy)")
    except Exception as err:  # another jaxlib, which initialises them otherwise
        import jaxlib

        error = f"{type(err).__name__}: {err} (jaxlib {jaxlib.__version__})"
    log.warning("%s could not be initialised: %s; %s programs that call them will not load", kernels.what, error,
                platform)
    return error
