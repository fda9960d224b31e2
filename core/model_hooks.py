"""``nereid.register_model``: how a bundle's ``model.py`` attaches pre/post-processing (and a meta model's
its orchestration).

A bundle may hold a ``model.py`` that calls::

    import nereid

    def to_classes(outputs):          # list[NamedTensor] -> list[NamedTensor]
        ...

    nereid.register_model(postprocess=to_classes)

nereid runs the file once when it loads the bundle (:func:`load_model_hooks`)
and keeps what it registered. The registration is collected through a context
variable that is set only while that one file runs, so nothing leaks from one
bundle to another, and loads on different threads never see each other's.
Hooks run on worker threads, and hooks of different requests overlap: keep
them free of shared mutable state, or guard it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import contextvars
import gc
import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from nereid import python_source
from nereid.errors import ConfigError

if TYPE_CHECKING:
    from nereid.tensors import NamedTensor

log = logging.getLogger(__name__)

Hook = Callable[["list[NamedTensor]"], "list[NamedTensor]"]

# Whether any model.py has run in this process, and the garbage collection scheduled after a version's retirement
# (with its loop): see collect_released_code_soon.
_code_loaded = False
_collection: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
# Held while a load imports, for the first time, what model code imports (a model.py's leading imports; jax, for a
# bundle): two loads importing one library's circular modules for the first time at once fail both (Python's
# per-module import locks raise ImportError, "partially initialized module"): a meta model's model.py importing jax
# beside a bundle's first load left both UNAVAILABLE at every start (the hunt of this session's changes). Only the
# imports: model.py itself then runs beside other loads (held for whole runs, 24 meta models whose model.py read a
# table for 2.5 s started in 50 s, not 6). Re-entrant. Taken through code_lock().
CODE_LOCK = threading.RLock()
# How long a load waits for others' first imports before it goes on without the lock: an import that never returns
# (a module reading a network share at import) must not hold every later load for good.
CODE_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def code_lock(model: str) -> Iterator[None]:
    """:data:`CODE_LOCK`, held for ``model``'s first imports; after :data:`CODE_LOCK_WAIT_S` without it, a WARNING
    and the load goes on without it."""
    held = CODE_LOCK.acquire(timeout=CODE_LOCK_WAIT_S)
    if not held:
        log.warning("model '%s': other loads' first imports of libraries have held the import lock for over %g s; "
                    "importing this one's beside them", model, CODE_LOCK_WAIT_S)
    try:
        yield
    finally:
        if held:
            CODE_LOCK.release()


def leading_imports(source: bytes) -> list[str]:
    """The modules a model.py imports at its top, before any other statement (its docstring aside): what its run
    imports first, whatever it does next; [] for source that does not parse (its run says why)."""
    try:
        tree = python_source.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for index, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                names.append(node.module)
        elif not (index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break  # (what follows may change what an import finds: sys.path, an environment variable)
    return names


def import_first(model: str, names: list[str]) -> None:
    """Import the modules ``names`` not imported yet, under :data:`CODE_LOCK`; one that fails is left to the code
    that imports it next, which says why, with its line."""
    pending = [name for name in names if name not in sys.modules]
    if not pending:
        return
    with code_lock(model):
        for name in pending:
            try:
                importlib.import_module(name)
            except Exception:
                pass


# How long after a retirement the collection runs: the retirements of one reload burst share it.
COLLECT_AFTER_RETIREMENT_S = 0.2
# The event loop's share of time the collections may take at most: the next starts no sooner than this many
# times the last one's duration after it ended.
COLLECT_SPACING = 10
# When the last collection ended (time.monotonic()) and how long it took.
_last_collection: tuple[float, float] = (0.0, 0.0)

# Set only while one model.py runs: the list its register_model call appends to.
_registrations: contextvars.ContextVar[Optional[list["ModelHooks"]]] = contextvars.ContextVar(
    "nereid_model_registrations", default=None)


def identity(tensors: list[NamedTensor]) -> list[NamedTensor]:
    """The hook used when model.py registers none: returns its argument."""
    return tensors


@dataclass(frozen=True)
class ModelHooks:
    """What one ``model.py`` registered (omitted hooks are :func:`identity`)."""

    preprocess: Hook = identity
    postprocess: Hook = identity
    # A meta model's orchestration (``fn(inputs, ctx) -> outputs``, async or not); None for a bundle.
    orchestrate: Callable[..., Any] | None = None


def register_model(name: str | None = None, *, preprocess: Hook | None = None,
                   postprocess: Hook | None = None, orchestrate: Callable[..., Any] | None = None) -> None:
    """Attach pre/post-processing hooks to the bundle whose ``model.py`` is running.

    Each hook takes and returns a ``list[NamedTensor]``; an omitted hook is the
    identity. ``preprocess`` receives the client's inputs (validated against
    ``client_inputs``) and returns the executable inputs; ``postprocess``
    receives the request's rows of the executable outputs and returns the
    ``client_outputs``. ``name`` is informational and ignored: the bundle's
    directory name is the model name. Call it exactly once, from ``model.py``.

    A meta model (``meta: true`` in manifest.yaml) registers ``orchestrate``
    instead: ``[async] def fn(inputs, ctx) -> list[NamedTensor]``, which calls
    other models with ``ctx.infer`` (see nereid.backends.meta).
    """
    collected = _registrations.get()
    if collected is None:
        raise RuntimeError("nereid.register_model() attaches hooks to a bundle: call it from the bundle's "
                           "model.py, which nereid runs when it loads the bundle")
    for label, hook in (("preprocess", preprocess), ("postprocess", postprocess)):
        if hook is not None and not callable(hook):
            raise TypeError(f"register_model: {label} must be a callable taking and returning a list of "
                            f"NamedTensor, got {hook!r}")
    if orchestrate is not None and not callable(orchestrate):
        raise TypeError(f"register_model: orchestrate must be a function fn(inputs, ctx) returning a list of "
                        f"NamedTensor, got {orchestrate!r}")
    if orchestrate is not None and (preprocess is not None or postprocess is not None):
        raise TypeError("register_model: orchestrate (a meta model) takes no preprocess or postprocess: "
                        "do that work inside the orchestration")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"register_model: name must be a string, got {name!r}")
    # (``name`` is checked and dropped: the folder names the model.)
    collected.append(ModelHooks(preprocess or identity, postprocess or identity, orchestrate))


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Runs a ``model.py`` from its source, never reading or writing ``__pycache__``.

    The model folder is not the server's to change (it may be read-only, a
    bucket's mirror that must match the bucket, or watched), and a cached copy
    could be stale: a file replaced within a second by one of the same size
    passes the cache's mtime and size check.
    """

    _source: bytes | None = None

    def source(self) -> bytes:
        """The file's bytes, read once: what its leading imports are read from is what runs."""
        if self._source is None:
            self._source = self.get_data(self.path)
        return self._source

    def get_code(self, fullname: str) -> Any:
        return self.source_to_code(self.source(), self.path)


def load_model_hooks(path: Path, model: str, meta: bool = False) -> ModelHooks:
    """Run a bundle's ``model.py`` and return what it registered.

    Raises ConfigError naming the file when it fails to run or does not call
    ``register_model`` exactly once, or when a bundle's registers
    ``orchestrate``, which only a meta model (``meta``) has.
    """
    path = Path(path)
    # A name per file and model: two models' loads never share a module object, nor its entry in sys.modules, not
    # even of one file (two models served from one symlinked folder, loading at once: one's removal of its entry
    # took the other's as it ran, whose dataclass then failed; the meta read hunt); one model's loads take turns,
    # and keep its name (a name per load left a logging.Logger, and a FileHandler's descriptor, per reload of a
    # model.py that makes one for __name__; the review hunt). (fsencode: a name not UTF-8 too.)
    digest = hashlib.sha256(os.fsencode(path.resolve()) + b"\0" + model.encode("utf-8", "surrogateescape"))
    module_name = f"nereid_bundle_{digest.hexdigest()[:12]}"
    loader = _SourceOnlyLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise ConfigError(f"model '{model}': cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    collected: list[ModelHooks] = []
    token = _registrations.set(collected)
    # Present in sys.modules only while it runs (dataclasses and typing look the
    # module up there); removed afterwards so nothing outlives the load.
    sys.modules[module_name] = module
    try:
        import_first(model, leading_imports(loader.source()))
        spec.loader.exec_module(module)
    except SystemExit as err:
        # Not the server's exit: a model.py that calls sys.exit() while loading is a model that fails to load.
        raise ConfigError(f"model '{model}': {path}{_line_of(err, path)} called sys.exit({err.code!r}) while "
                          "loading; a model.py must register its hooks and return") from None
    except BaseException as err:  # a KeyboardInterrupt of its own too: it blamed the backend, naming no line
        # (A stop signal is no model's failure all the same: the server takes it on its loop, and nereid check,
        # which has recorded it, stops when it sees this failure.)
        raise ConfigError(f"model '{model}': {path}{_line_of(err, path)} failed: {type(err).__name__}: {err}") \
            from err
    finally:
        _registrations.reset(token)
        sys.modules.pop(module_name, None)
    if len(collected) != 1:
        problem = "did not call nereid.register_model(...)" if not collected else \
            f"called nereid.register_model {len(collected)} times (once per bundle)"
        raise ConfigError(f"model '{model}': {path} {problem}")
    if collected[0].orchestrate is not None and not meta:
        raise ConfigError(f"model '{model}': {path} registers orchestrate, which only a meta model has: add "
                          "meta: true (and depends_on) to its manifest.yaml, or register preprocess / postprocess")
    global _code_loaded
    _code_loaded = True
    return collected[0]


def collect_released_code_soon() -> None:
    """After a version is retired: one garbage collection a moment later, when any model.py has run in this
    process (one for a burst of retirements; call it on the event loop).

    A module's functions refer to its namespace and the namespace to them, a
    cycle only the collector frees, and an idle server runs none: a meta model
    whose model.py held a 100 MB table, reloaded 20 times, kept up to 8 old
    copies (1.1 GB) until traffic came (the meta hunt). Emptying the module
    instead would break a thread its model.py started that outlives it. A full
    collection takes about 20 ms with jax loaded, 60 ms among 300 models: the
    collections of a long burst (every model reloading after a ``git pull``) are
    spaced to take at most a tenth of the loop's time (they took 4 of its 17 s).
    """
    global _collection
    if not _code_loaded:
        return
    loop = asyncio.get_running_loop()
    if _collection is not None and _collection[0] is loop and not _collection[1].cancelled():
        return  # (one is due: this retirement's module is collected with it)
    delay = collection_delay(time.monotonic(), *_last_collection)
    _collection = (loop, loop.call_later(delay, _collect))


def collection_delay(now: float, last_end: float, last_duration: float) -> float:
    """How long from ``now`` the collection after a retirement waits: :data:`COLLECT_AFTER_RETIREMENT_S`, or
    longer while the last one (ended at ``last_end``, after ``last_duration`` s) is too recent."""
    return max(COLLECT_AFTER_RETIREMENT_S, last_end + COLLECT_SPACING * last_duration - now)


def _collect() -> None:
    global _collection, _last_collection
    _collection = None
    started = time.monotonic()
    gc.collect()
    ended = time.monotonic()
    _last_collection = (ended, ended - started)


def _line_of(err: BaseException, path: Path) -> str:
    """``:<line>`` of the innermost frame inside ``path``, for the error message."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename) == path]
    if isinstance(err, SyntaxError) and err.lineno:
        return f":{err.lineno}"
    return f":{frames[-1].lineno}" if frames else ""
