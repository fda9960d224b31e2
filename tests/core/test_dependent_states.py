"""A model that calls others follows their states: READY exactly while they are, each change logged once."""

from __future__ import annotations

import logging
from pathlib import Path

from nereid.dependent_states import DependentStates
from nereid.model_entry import LoadedVersion, ModelEntry, ModelState
from nereid.settings import ModelSettings


def entry(name: str, state: ModelState, reason: str = "", calls: tuple[str, ...] = ()) -> ModelEntry:
    """An entry in ``state``; one with ``calls`` holds a loaded version that calls those models (only what the
    verdicts read of a version is filled in)."""
    made = ModelEntry(name, Path(name), ModelSettings(name=name), "nereid.yaml", state=state, reason=reason)
    if calls:
        made.loaded = LoadedVersion("meta", None, None, None, None, None, 0.0, None, None, depends_on=calls)
    return made


def entries(*made: ModelEntry) -> dict[str, ModelEntry]:
    return {one.name: one for one in made}


def lines(caplog) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in caplog.records]


def test_a_caller_is_ready_exactly_while_what_it_calls_is_and_each_change_is_logged(caplog):
    caplog.set_level(logging.DEBUG, "nereid.repository")
    states = DependentStates()
    known = entries(entry("a", ModelState.READY, calls=("b",)), entry("b", ModelState.UNAVAILABLE, "unloaded"))
    states.refresh(known)
    assert (known["a"].state, known["a"].reason) == (
        ModelState.UNAVAILABLE, "dependency 'b' is not ready (UNAVAILABLE: unloaded)")
    assert lines(caplog) == [(logging.WARNING, "model 'a' is UNAVAILABLE: dependency 'b' is not ready "
                                               "(UNAVAILABLE: unloaded)")]
    caplog.clear()
    states.refresh(known)  # nothing changed: nothing said
    assert lines(caplog) == []
    known["b"].state, known["b"].reason = ModelState.READY, ""
    states.refresh(known)
    assert (known["a"].state, known["a"].reason) == (ModelState.READY, "")
    assert lines(caplog) == [(logging.INFO, "model 'a' is READY (every model it calls is READY)")]


def test_waiting_on_a_model_loading_is_info_and_its_failure_then_a_warning(caplog):
    caplog.set_level(logging.DEBUG, "nereid.repository")
    states = DependentStates()
    known = entries(entry("a", ModelState.READY, calls=("b",)), entry("b", ModelState.LOADING))
    states.refresh(known)
    known["b"].state, known["b"].reason = ModelState.UNAVAILABLE, "bad weights"
    states.refresh(known)  # UNAVAILABLE already, but now on a failure, not a model READY soon: said again
    assert lines(caplog) == [
        (logging.INFO, "model 'a' is waiting for the models it calls: dependency 'b' is not ready (LOADING)"),
        (logging.WARNING, "model 'a' is UNAVAILABLE: dependency 'b' is not ready (UNAVAILABLE: bad weights)")]


def test_a_caller_blocked_by_another_dependency_is_said_again_and_a_repeated_store_failure_is_debug(caplog):
    caplog.set_level(logging.DEBUG, "nereid.repository")
    states = DependentStates()
    known = entries(entry("a", ModelState.READY, calls=("b", "c")), entry("b", ModelState.UNAVAILABLE, "gone"),
                    entry("c", ModelState.UNAVAILABLE, "store down"))
    states.refresh(known)
    known["b"].state, known["b"].reason = ModelState.READY, ""
    states.refresh(known, repeated=True)
    assert lines(caplog) == [
        (logging.WARNING, "model 'a' is UNAVAILABLE: dependency 'b' is not ready (UNAVAILABLE: gone)"),
        (logging.DEBUG, "model 'a' is UNAVAILABLE: dependency 'c' is not ready (UNAVAILABLE: store down)")]


def test_an_unloading_caller_is_left_unloading_and_a_model_calling_none_is_ready(caplog):
    states = DependentStates()
    known = entries(entry("a", ModelState.UNLOADING, calls=("b",)), entry("b", ModelState.UNAVAILABLE, "gone"),
                    entry("plain", ModelState.LOADING))
    states.refresh(known)
    assert known["a"].state is ModelState.UNLOADING and caplog.records == []
    assert DependentStates.verdict(known, "plain").ready
    known["a"].state = ModelState.READY
    assert DependentStates.verdict(known, "a").blocker == "b"


def test_callers_of_callers_settle_in_one_refresh_and_a_cycle_never_is_ready():
    states = DependentStates()
    known = entries(entry("top", ModelState.READY, calls=("middle",)), entry("middle", ModelState.READY,
                                                                            calls=("leaf",)),
                    entry("leaf", ModelState.UNAVAILABLE, "unloaded"),
                    entry("x", ModelState.READY, calls=("y",)), entry("y", ModelState.READY, calls=("x",)))
    states.refresh(known)
    assert known["top"].reason == ("dependency 'middle' is not ready (UNAVAILABLE: dependency 'leaf' is not ready "
                                   "(UNAVAILABLE: unloaded))")
    assert known["x"].state is known["y"].state is ModelState.UNAVAILABLE
    assert "depends_on cycle" in known["x"].reason
