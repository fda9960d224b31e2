"""Readiness that follows dependencies (nereid.dependencies.callers_readiness): pure, so tested without a server."""

from __future__ import annotations

from nereid.dependencies import READY, Readiness, callers_readiness
from nereid.errors import MESSAGE_LIMIT


def chain(length: int, bottom: str = "echo") -> dict[str, tuple[str, ...]]:
    """c0 -> c1 -> ... -> c{length-1} -> bottom."""
    return {f"c{i}": (f"c{i + 1}",) if i + 1 < length else (bottom,) for i in range(length)}


def test_a_long_chain_settles_in_one_walk_naming_the_root_cause() -> None:
    """Defect: the repository settled one level per pass, each pass walking every cycle: a chain of 120 meta
    models held the event loop 14 s at start and about 1 s per load or unload of the model at its bottom."""
    callers = chain(5000)
    unloaded = callers_readiness(callers, {"echo": ("UNAVAILABLE", "unloaded")})
    root = "dependency 'echo' is not ready (UNAVAILABLE: unloaded)"
    assert unloaded["c4999"] == Readiness(root, blocker="echo")
    assert unloaded["c0"] == Readiness(f"dependency 'c1' is not ready (UNAVAILABLE: {root})", blocker="c1")
    assert all(not verdict.ready for verdict in unloaded.values())
    assert all(verdict.ready for verdict in callers_readiness(callers, {"echo": ("READY", "")}).values())
    loading = callers_readiness(callers, {"echo": ("LOADING", "")})
    assert loading["c0"].loading and loading["c0"].why == "dependency 'c1' is not ready (UNAVAILABLE: " \
                                                          "dependency 'echo' is not ready (LOADING))"


def test_the_first_dependency_not_ready_is_named_in_declaration_order() -> None:
    callers = {"top": ("a", "b", "ghost"), "a": ("x",), "b": ("y",)}
    states = {"x": ("READY", ""), "y": ("UNAVAILABLE", "failed to load: no main.py"), "a": ("READY", ""),
              "top": ("LOADING", "")}
    verdicts = callers_readiness(callers, states)
    assert verdicts["a"] is READY
    assert verdicts["b"].why == "dependency 'y' is not ready (UNAVAILABLE: failed to load: no main.py)"
    assert verdicts["top"].why == f"dependency 'b' is not ready (UNAVAILABLE: {verdicts['b'].why})"
    assert not verdicts["top"].loading
    states["y"] = ("READY", "")
    assert callers_readiness(callers, states)["top"].why == ("dependency 'ghost' is not a model of this server "
                                                  "(no folder 'ghost' in ml_backends_path)")


def test_cycles_are_never_ready_and_their_callers_say_why() -> None:
    callers = {"a": ("b",), "b": ("c",), "c": ("a",), "self": ("self",), "above": ("echo", "a"),
               "diamond": ("left", "right"), "left": ("echo",), "right": ("echo",)}
    verdicts = callers_readiness(callers, {"echo": ("READY", "")})
    assert verdicts["a"].why == "depends_on cycle 'a' -> 'b' -> 'c' -> 'a'"
    assert verdicts["c"].why == "depends_on cycle 'c' -> 'a' -> 'b' -> 'c'"
    assert verdicts["self"].why == "depends_on cycle 'self' -> 'self'"
    assert verdicts["above"].why == "dependency 'a' is not ready (UNAVAILABLE: depends_on cycle 'a' -> 'b' -> " \
                                    "'c' -> 'a')"
    assert verdicts["diamond"] is READY


def test_a_long_root_cause_is_capped() -> None:
    verdicts = callers_readiness(chain(3), {"echo": ("UNAVAILABLE", "x" * 10_000)})
    assert all(len(verdict.why) <= MESSAGE_LIMIT for verdict in verdicts.values())
