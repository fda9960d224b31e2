"""The states of models that call other models, kept in step with the models they call.

A loaded model whose backend calls other models (a meta model) is READY
exactly while every model it calls, and every model those call, is READY;
otherwise UNAVAILABLE with the reason. The walk of the graph is
:func:`~nereid.dependencies.callers_readiness`; this module applies its
verdicts to the repository's entries and says what changed in the log.
"""

from __future__ import annotations

import logging
from typing import Mapping

from nereid.dependencies import READY, Readiness, callers_readiness
from nereid.model_entry import ModelEntry, ModelState

# The repository's logger: operators follow a model's state changes in one place, whoever makes them.
log = logging.getLogger("nereid.repository")


class DependentStates:
    """Applies the dependency graph's verdicts to the entries of the models that call others."""

    def __init__(self) -> None:
        self._verdicts: dict[str, Readiness] = {}  # each model calling others, as the last walk of the graph found it

    @staticmethod
    def verdict(entries: Mapping[str, ModelEntry], name: str) -> Readiness:
        """Whether the loaded model ``name`` can serve now, judged by the models it calls (READY for a model
        that calls none)."""
        return _verdicts(entries).get(name, READY)

    @staticmethod
    def verdict_calling(entries: Mapping[str, ModelEntry], name: str, depends_on: tuple[str, ...]) -> Readiness:
        """Whether the model ``name`` could serve if its loaded version called ``depends_on``: a reload's new
        version, judged before it replaces the running one."""
        return _verdicts(entries, {name: depends_on}).get(name, READY)

    def refresh(self, entries: Mapping[str, ModelEntry], repeated: bool = False) -> None:
        """Make each model that calls others READY or UNAVAILABLE as the models it calls are now.

        Called after every state change. A model calling itself through
        ``depends_on`` (which a backend refuses at load when it can see the
        cycle) never becomes READY. One walk of the graph settles every chain of
        such models. Each change of state is logged, and so is waiting on
        another dependency, unless on one LOADING. ``repeated``: the change is a
        store failure that repeats the last one (see :func:`log_unavailable`).
        """
        verdicts = _verdicts(entries)
        for name, verdict in verdicts.items():
            entry = entries[name]
            if verdict.ready:
                if entry.state is not ModelState.READY:
                    entry.state, entry.reason = ModelState.READY, ""
                    log.info("model '%s' is READY (every model it calls is READY)", entry.name)
            elif (entry.state, entry.reason) != (ModelState.UNAVAILABLE, verdict.why):
                # Waiting on another dependency is logged too, unless on one LOADING (READY soon): waiting on
                # a model that was LOADING can turn into waiting on one that is missing or failed (or on the
                # same one, now failed), which must not go unsaid. (UNLOADING to unloaded is no news.)
                before = self._verdicts.get(name)
                if (entry.state is not ModelState.UNAVAILABLE
                        or (not verdict.loading
                            and (before is None or before.loading or before.blocker != verdict.blocker))):
                    log_unavailable(entry, verdict, repeated=repeated)
                entry.state, entry.reason = ModelState.UNAVAILABLE, verdict.why
        self._verdicts = verdicts


def log_unavailable(entry: ModelEntry, verdict: Readiness, detail: str = "", repeated: bool = False) -> None:
    """Log that a loaded model cannot serve because of the models it calls.

    At INFO while the root cause is a model only LOADING (the server is
    starting, or it is being reloaded: READY soon, so a normal start logs no
    warning, however long the chain of models calling it); at DEBUG when that
    cause is a store failure ``repeated`` (see ``ModelRepository.load``'s
    ``retrying``); at WARNING otherwise.
    """
    if verdict.loading:  # (worded as the wait it is: a line saying UNAVAILABLE at every clean start tripped log
        # alerts that look for the word; the operator hunt. Its reason in RepositoryIndex stays the state's.)
        log.info("model '%s' is waiting for the models it calls: %s%s", entry.name, verdict.why, detail)
        return
    level = logging.DEBUG if repeated else logging.WARNING
    log.log(level, "model '%s' is UNAVAILABLE: %s%s", entry.name, verdict.why, detail)


def _verdicts(entries: Mapping[str, ModelEntry],
              instead: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, Readiness]:
    """Whether each loaded model that calls other models can serve now (an UNLOADING one takes no requests
    whatever it calls: not judged); ``instead``: models judged as calling these rather than what they call."""
    callers = {entry.name: entry.loaded.depends_on for entry in entries.values()
               if entry.loaded is not None and entry.loaded.depends_on and entry.state is not ModelState.UNLOADING}
    for name, depends_on in (instead or {}).items():
        callers.pop(name, None)
        if depends_on:
            callers[name] = depends_on
    if not callers:
        return {}
    states = {entry.name: (entry.state.value, entry.reason) for entry in entries.values()}
    return callers_readiness(callers, states)
