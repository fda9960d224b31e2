"""Models that call other models: cycles in ``depends_on`` and readiness that follows dependencies.

Pure functions over names, shared by the repository (which keeps a meta model
READY only while everything it calls is READY) and by backends that check a
dependency graph at load from files.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping


def find_cycle(start: str, depends_on: Callable[[str], Iterable[str]]) -> list[str] | None:
    """A path ``start -> ... -> start`` through ``depends_on``, or None when ``start`` reaches no cycle through itself.

    ``depends_on(name)`` lists a model's dependencies (empty for a model that
    calls none, or one whose dependencies are unknown). The result names every
    model on the cycle once and ``start`` again at the end, in call order.
    """
    path: list[str] = [start]
    on_path = {start}
    done: set[str] = set()  # names fully explored without reaching start: never walked twice
    iterators = [iter(depends_on(start))]
    while iterators:
        for name in iterators[-1]:
            if name == start:
                return [*path, start]
            if name in on_path or name in done:
                continue  # a cycle that does not pass through start is that other model's to report
            path.append(name)
            on_path.add(name)
            iterators.append(iter(depends_on(name)))
            break
        else:
            iterators.pop()
            finished = path.pop()
            on_path.discard(finished)
            done.add(finished)
    return None


def describe_cycle(cycle: list[str]) -> str:
    """``'a' -> 'b' -> 'a'``: a cycle as error messages show it."""
    return " -> ".join(f"'{name}'" for name in cycle)


def waiting_for(dependencies: Iterable[str], states: Mapping[str, tuple[str, str]]) -> str | None:
    """Why a model with these dependencies cannot be READY, or None when every one is READY.

    ``states`` maps a known model to its (state, reason), as RepositoryIndex
    shows them; a name missing from it is a model the server does not know.
    """
    for name in dependencies:
        known = states.get(name)
        if known is None:
            return f"dependency '{name}' is not a model of this server (no folder '{name}' in ml_backends_path)"
        state, reason = known
        if state != "READY":
            detail = f": {reason}" if reason else ""
            return f"dependency '{name}' is not ready ({state}{detail})"
    return None
