"""Models that call other models: cycles in ``depends_on`` and readiness that follows dependencies.

Pure functions over names, shared by the repository (which keeps a meta model
READY only while everything it calls is READY) and by backends that check a
dependency graph at load from files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from nereid.errors import ConfigError, cap_message


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


class DependencyCycle(ConfigError):
    """A load refused because the model's ``depends_on`` closes a cycle; ``cycle`` is the path (as
    :func:`find_cycle` gives it). In dynamic mode the repository tries the load again once another model on
    the cycle has loaded a new version or gone, which may have broken it."""

    def __init__(self, message: str, cycle: list[str]) -> None:
        super().__init__(message)
        self.cycle = tuple(cycle)


@dataclass(frozen=True)
class Readiness:
    """Whether a model that calls other models can be READY now, and if not, why."""

    why: str | None  # None: every model it calls (and every model those call) is READY
    loading: bool = False  # the root cause is a model still LOADING: it should be READY soon
    blocker: str | None = None  # the dependency the reason names first (None: ready, or on a cycle)

    @property
    def ready(self) -> bool:
        return self.why is None


READY = Readiness(None)


def callers_readiness(callers: Mapping[str, tuple[str, ...]],
                      states: Mapping[str, tuple[str, str]]) -> dict[str, Readiness]:
    """Every caller's readiness, each dependency followed once, deepest first.

    ``callers`` maps each model that calls other models (and whose state
    follows them) to its dependencies, in the order it declares them; ``states``
    maps every known model to its (state, reason), as RepositoryIndex shows them
    (a caller's own entry there is ignored: it is what this computes). A caller
    is READY exactly when every dependency is, callers among them as settled
    here; a caller on a cycle never is. The reason names the first dependency
    that is not READY and the root cause behind it, however deep the chain
    (``dependency 'b' is not ready (UNAVAILABLE: dependency 'echo' is not ready
    (UNAVAILABLE: unloaded))``), never every level between.

    Linear in the graph's size outside cycles: a chain of hundreds settles in
    one walk. Models calling each other in a group cost more (a cycle is
    found for each member): 0.14 s for 200 that all call each other.
    """
    verdicts: dict[str, Readiness] = {}
    roots: dict[str, str] = {}  # a caller that is not READY -> the root cause's text behind it
    for name, cycle in _cycles(callers).items():
        verdicts[name] = Readiness(cap_message(f"depends_on cycle {describe_cycle(cycle)}"))
        roots[name] = verdicts[name].why  # type: ignore[assignment]
    for start in callers:
        if start in verdicts:
            continue
        # An iterative walk, deepest first: a caller is judged once every caller it depends on is.
        stack = [(start, iter(callers[start]))]
        while stack:
            name, dependencies = stack[-1]
            deeper = next((d for d in dependencies if d in callers and d not in verdicts), None)
            if deeper is not None:
                stack.append((deeper, iter(callers[deeper])))
                continue
            stack.pop()
            if name not in verdicts:
                verdicts[name] = _judge(name, callers[name], states, verdicts, roots)
    return verdicts


def _judge(name: str, dependencies: tuple[str, ...], states: Mapping[str, tuple[str, str]],
           verdicts: Mapping[str, Readiness], roots: dict[str, str]) -> Readiness:
    """One caller's readiness, its callers among ``dependencies`` judged already."""
    for dependency in dependencies:
        settled = verdicts.get(dependency)
        if settled is not None:
            if settled.ready:
                continue
            root = roots[dependency]
            why = cap_message(f"dependency '{dependency}' is not ready (UNAVAILABLE: {root})")
            roots[name] = root
            return Readiness(why, settled.loading, dependency)
        known = states.get(dependency)
        if known is None:
            why = cap_message(f"dependency '{dependency}' is not a model of this server (no folder '{dependency}' "
                              "in ml_backends_path)")
            roots[name] = why
            return Readiness(why, blocker=dependency)
        state, reason = known
        if state != "READY":
            why = cap_message(f"dependency '{dependency}' is not ready ({state}{': ' + reason if reason else ''})")
            roots[name] = why
            return Readiness(why, state == "LOADING", dependency)
    return READY


def _cycles(callers: Mapping[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Each caller on a cycle of ``callers``, with its cycle (as :func:`find_cycle` gives it)."""
    on_cycles: dict[str, list[str]] = {}
    for component in _strongly_connected(callers):
        if len(component) > 1 or component[0] in callers.get(component[0], ()):
            members = set(component)
            for name in component:
                cycle = find_cycle(name, lambda n: [d for d in callers.get(n, ()) if d in members])
                if cycle is not None:
                    on_cycles[name] = cycle
    return on_cycles


def _strongly_connected(graph: Mapping[str, tuple[str, ...]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (edges to names outside it ignored), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            name, edges = work[-1]
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    break
                if target in on_stack:
                    low[name] = min(low[name], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[name])
                if low[name] == index[name]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == name:
                            break
                    components.append(component)
    return components
