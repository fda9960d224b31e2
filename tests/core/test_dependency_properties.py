"""Property-based tests (hypothesis) of two pure functions of the core: meta-model readiness and batch formation.

``nereid.dependencies.callers_readiness`` (and ``find_cycle``), over random graphs of a
few names (self-loops, cycles, diamonds, duplicate edges, edges to names no
model has) with random states (READY, LOADING, UNLOADING, UNAVAILABLE, with
short and over-long reasons) for the models that call none:

* a caller is ready exactly when every model it calls is READY, callers among
  them as settled (the least fixed point: a caller on a cycle never is);
* a caller on a cycle is never ready, has no blocker, is not ``loading``, and
  its reason names a real cycle through it (the first one in declaration
  order);
* otherwise its reason names the first dependency (in declaration order) that
  is not READY, which is its ``blocker``, and the root cause at the end of
  that chain, whatever the depth; ``loading`` is true exactly when that root
  cause is a model LOADING; the whole verdict is the one an independent,
  recursive oracle computes;
* the verdicts do not depend on the order of the ``callers`` and ``states``
  dicts, and a caller's own entry in ``states`` is ignored;
* graphs of 200 names are judged in bounded time (about 0.2 s at worst);
* every reason is capped at MESSAGE_LIMIT.

``nereid.batching.take_batch``, over random queues (rows, costs, keys,
arrival times, deadlines, callers gone) and policies (row cap, delay,
preferred sizes, cost budget, batching off), at a random instant:

* nothing is lost or duplicated (the queue after, the batch and the dropped
  requests are the queue before), and what stays keeps its order;
* the batch is a prefix of the live queue, never mixes keys, never exceeds
  the row cap unless it is one request, and reached the cost budget (if
  ever) only with its last request;
* the dropped requests are exactly the expired or abandoned ones among those
  it looked at, and no batched request is one of them;
* no batch: the whole (live) queue could still grow, and ``wake_ns`` is the
  window's end, in the future; within the delay, a batch with preferred
  sizes is Triton's marked one (the longest prefix whose rows are a
  preferred size, else the prefix before the request that would pass the
  largest), past the delay every request the row cap and budget allow;
  every decision is the one an independent reference computes;
* deciding again at ``wake_ns`` releases a batch unless a deadline passed in
  between, and deciding at each wake-up drains any queue, each request
  batched or dropped exactly once, in arrival order.

Examples are bounded so the module runs in a few seconds;
``NEREID_HYPOTHESIS_EXAMPLES=5000`` searches deeper.
"""

from __future__ import annotations

import collections
import os
import random
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nereid.batching import BatchPolicy, take_batch
from nereid.dependencies import Readiness, callers_readiness, describe_cycle, find_cycle
from nereid.errors import MESSAGE_LIMIT, cap_message

# NEREID_HYPOTHESIS_EXAMPLES=5000 searches deeper (about four minutes) than the suite does by default.
BOUNDED = settings(max_examples=int(os.environ.get("NEREID_HYPOTHESIS_EXAMPLES", 50)), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(BOUNDED, max_examples=max(1, BOUNDED.max_examples // 20))

# ---------------------------------------------------------------------------------------------------------------
# callers_readiness: readiness of models that call other models
# ---------------------------------------------------------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e", "f"]
UNKNOWN = ["ghost", "typo"]  # never in states: no folder of that name
STATES = ["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
REASONS = ["", "unloaded", "failed to load: no main.py", "x" * (MESSAGE_LIMIT + 100)]


@st.composite
def graphs(draw: st.DrawFn) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, str]]]:
    """(callers, states): a few callers with random dependencies, every other name with a random state or none."""
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    callers = {name: tuple(draw(st.lists(st.sampled_from(NAMES + UNKNOWN), max_size=4))) for name in names}
    if draw(st.booleans()):  # deep chains are rare by chance: chain the callers, each calling the next first
        chain = draw(st.permutations(names))
        for upper, lower in zip(chain, chain[1:]):
            callers[upper] = (lower, *callers[upper])
    states: dict[str, tuple[str, str]] = {}
    for name in NAMES:
        # A caller's own entry is what RepositoryIndex shows of it: callers_readiness ignores it, so any state goes.
        if draw(st.integers(0, 5)) > 0 or name in callers:
            states[name] = (draw(st.sampled_from(STATES)), draw(st.sampled_from(REASONS)))
    return callers, states


def reachable(callers: dict[str, tuple[str, ...]], start: str) -> set[str]:
    """Callers reachable from ``start`` in one step or more."""
    seen: set[str] = set()
    todo = [d for d in callers[start] if d in callers]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(d for d in callers[name] if d in callers)
    return seen


def first_cycle(callers: dict[str, tuple[str, ...]], start: str) -> list[str] | None:
    """The first simple path start -> ... -> start in declaration order (a plain recursive search, no memo)."""
    def walk(path: list[str]) -> list[str] | None:
        for name in callers.get(path[-1], ()):
            if name == start:
                return [*path, start]
            if name in callers and name not in path:
                found = walk([*path, name])
                if found is not None:
                    return found
        return None
    return walk([start])


def fixed_point_ready(callers: dict[str, tuple[str, ...]], states: dict[str, tuple[str, str]]) -> dict[str, bool]:
    """The least fixed point of 'ready when every dependency is': cycles never become ready."""
    ready = {name: False for name in callers}
    changed = True
    while changed:
        changed = False
        for name, dependencies in callers.items():
            now = all(ready[d] if d in callers else states.get(d, ("", ""))[0] == "READY" for d in dependencies)
            if now and not ready[name]:
                ready[name], changed = True, True
    return ready


def oracle(callers: dict[str, tuple[str, ...]], states: dict[str, tuple[str, str]]) -> dict[str, Readiness]:
    """Every caller's verdict, computed recursively from the rules the docstring and the README state."""
    ready = fixed_point_ready(callers, states)
    verdicts: dict[str, Readiness] = {}
    roots: dict[str, str] = {}

    def judge(name: str) -> Readiness:
        if name in verdicts:
            return verdicts[name]
        if name in reachable(callers, name):
            cycle = first_cycle(callers, name)
            assert cycle is not None
            verdict = Readiness(cap_message(f"depends_on cycle {describe_cycle(cycle)}"))
            roots[name] = verdict.why  # type: ignore[assignment]
        elif ready[name]:
            verdict = Readiness(None)
        else:
            dependency = next(d for d in callers[name]
                              if not (ready[d] if d in callers else states.get(d, ("", ""))[0] == "READY"))
            if dependency in callers:
                below = judge(dependency)
                roots[name] = roots[dependency]
                verdict = Readiness(cap_message(f"dependency '{dependency}' is not ready (UNAVAILABLE: "
                                                f"{roots[dependency]})"), below.loading, dependency)
            elif dependency not in states:
                why = cap_message(f"dependency '{dependency}' is not a model of this server (no folder "
                                  f"'{dependency}' in ml_backends_path)")
                roots[name] = why
                verdict = Readiness(why, False, dependency)
            else:
                state, reason = states[dependency]
                why = cap_message(f"dependency '{dependency}' is not ready ({state}{': ' + reason if reason else ''})")
                roots[name] = why
                verdict = Readiness(why, state == "LOADING", dependency)
        verdicts[name] = verdict
        return verdict

    for caller in callers:
        judge(caller)
    return verdicts


def is_cycle_through(callers: dict[str, tuple[str, ...]], name: str, cycle: list[str]) -> bool:
    """``cycle`` is name -> ... -> name along declared edges, each caller on it once."""
    inner = cycle[:-1]
    return (len(cycle) >= 2 and cycle[0] == cycle[-1] == name and len(set(inner)) == len(inner)
            and all(c in callers for c in inner) and all(b in callers[a] for a, b in zip(cycle, cycle[1:])))


def root_state(callers: dict[str, tuple[str, ...]], states: dict[str, tuple[str, str]],
               verdicts: dict[str, Readiness], name: str) -> str | None:
    """Follow the blockers down to the model that is the root cause: its state (None: a cycle, or no model)."""
    seen = set()
    while name in callers:
        assert name not in seen, f"the blockers from {name!r} go round in a circle"
        seen.add(name)
        blocker = verdicts[name].blocker
        if blocker is None:
            return None  # on a cycle
        name = blocker
    return states[name][0] if name in states else None


@BOUNDED
@given(graphs())
@example(({"a": ("b",), "b": ("c",), "c": ("a",), "self": ("self",), "above": ("echo", "a"),
           "diamond": ("left", "right"), "left": ("echo",), "right": ("echo",)}, {"echo": ("READY", "")}))
@example(({"top": ("a", "b", "ghost"), "a": ("x",), "b": ("y",)},
          {"x": ("READY", ""), "y": ("LOADING", ""), "top": ("UNAVAILABLE", "stale")}))
@example(({"a": ("b",), "b": ("c",), "c": ("d", "ghost"), "d": ("e",)}, {"e": ("LOADING", ""), "ghost": ("READY", "")}))
def test_callers_readiness_agrees_with_the_rules(graph: tuple[dict, dict]) -> None:
    callers, states = graph
    verdicts = callers_readiness(callers, states)
    assert set(verdicts) == set(callers)
    ready = fixed_point_ready(callers, states)
    for name, dependencies in callers.items():
        verdict = verdicts[name]
        # Ready exactly when everything it calls is READY, callers among them as settled.
        assert verdict.ready == ready[name], (name, verdict)
        assert verdict.ready == all(verdicts[d].ready if d in callers else states.get(d, ("", ""))[0] == "READY"
                                    for d in dependencies)
        if verdict.ready:
            assert verdict == Readiness(None), verdict
            continue
        assert len(verdict.why) <= MESSAGE_LIMIT, verdict.why  # (names here are short: see test_every_reason_...)
        if name in reachable(callers, name):
            # On a cycle: never ready, no blocker, not waiting on a LOADING model, the cycle named.
            assert verdict.blocker is None and not verdict.loading, verdict
            assert verdict.why.startswith("depends_on cycle '"), verdict.why
            cycle = [part.strip("'") for part in verdict.why[len("depends_on cycle "):].split(" -> ")]
            assert is_cycle_through(callers, name, cycle), (name, cycle)
            continue
        # The blocker is the first dependency, in declaration order, that is not ready; it really is not.
        blocker = verdict.blocker
        assert blocker in dependencies, verdict
        before = dependencies[:dependencies.index(blocker)]
        assert all(verdicts[d].ready if d in callers else states.get(d, ("", ""))[0] == "READY" for d in before)
        assert not (verdicts[blocker].ready if blocker in callers else states.get(blocker, ("", ""))[0] == "READY")
        assert verdict.why.startswith(f"dependency '{blocker}' is not "), verdict.why
        # The root cause, not every level between: at most the blocker and the model at the end of its chain.
        assert verdict.why.count("dependency '") <= 2, verdict.why
        # loading exactly when the root cause at the end of the chain of blockers is a model LOADING.
        assert verdict.loading == (root_state(callers, states, verdicts, name) == "LOADING"), (name, verdicts)
    assert verdicts == oracle(callers, states)


@BOUNDED
@given(graphs(), st.randoms(use_true_random=False))
def test_callers_readiness_does_not_depend_on_dict_order_or_on_a_callers_own_state(graph: tuple[dict, dict],
                                                                                   rng: random.Random) -> None:
    callers, states = graph
    verdicts = callers_readiness(callers, states)
    caller_items, state_items = list(callers.items()), list(states.items())
    rng.shuffle(caller_items)
    rng.shuffle(state_items)
    assert callers_readiness(dict(caller_items), dict(state_items)) == verdicts
    # What RepositoryIndex shows of a caller is what callers_readiness computes: whatever it was, it is ignored.
    restated = dict(states)
    for name in callers:
        if rng.random() < 0.5:
            restated.pop(name, None)
        else:
            restated[name] = (rng.choice(STATES), rng.choice(REASONS))
    assert callers_readiness(callers, restated) == verdicts


@BOUNDED
@given(graphs(), st.sampled_from(NAMES))
def test_find_cycle_finds_a_cycle_exactly_when_there_is_one(graph: tuple[dict, dict], start: str) -> None:
    callers, _ = graph
    callers = {start: (), **callers}
    cycle = find_cycle(start, lambda name: callers.get(name, ()))
    if start in reachable(callers, start):
        assert cycle is not None and is_cycle_through(callers, start, cycle), cycle
        assert cycle == first_cycle(callers, start)
    else:
        assert cycle is None


@FEWER
@given(st.integers(0, 2**32 - 1), st.sampled_from(["sparse", "dense", "ring", "complete", "dag"]))
@example(0, "complete")
def test_two_hundred_callers_are_judged_in_bounded_time(seed: int, shape: str) -> None:
    rng = random.Random(seed)
    names = [f"m{i}" for i in range(200)]
    others = ["echo", "ghost"]
    if shape == "sparse":
        callers = {n: tuple(rng.sample(names + others, rng.randint(0, 4))) for n in names}
    elif shape == "dense":
        callers = {n: tuple(rng.sample(names + others, rng.randint(20, 100))) for n in names}
    elif shape == "ring":
        callers = {n: (names[(i + 1) % len(names)],) for i, n in enumerate(names)}
    elif shape == "complete":  # one strongly connected component of 200 (the slowest shape found: ~0.2 s)
        callers = {n: tuple(m for m in names if m != n) for n in names}
    else:
        callers = {n: tuple(names[i + 1:]) + ("echo",) for i, n in enumerate(names)}
    states = {"echo": (rng.choice(STATES), "")}
    started = time.perf_counter()
    verdicts = callers_readiness(callers, states)
    elapsed = time.perf_counter() - started
    # About 0.2 s at worst on an idle machine: the bound only catches a blow-up (a walk per path, not per
    # model), with room for a machine loaded by the rest of the suite.
    assert elapsed < 5.0, f"{shape}: {elapsed:.2f} s"
    assert set(verdicts) == set(callers)
    if shape in ("ring", "complete"):
        assert not any(v.ready for v in verdicts.values())
    if shape == "dag":
        assert all(v.ready == (states["echo"][0] == "READY") for v in verdicts.values())


# Defect: two of callers_readiness's reasons were not capped (a caller on a cycle; one calling a name no model
# has), and the repository shows them in RepositoryIndex as they are (README: "Reasons and errors are capped at
# 4 KiB").
@pytest.mark.parametrize("callers", [
    pytest.param({f"{i:03d}" + "m" * 250: (f"{(i + 1) % 20:03d}" + "m" * 250,) for i in range(20)}, id="cycle"),
    pytest.param({"relay": ("e" * 9000,)}, id="unknown-dependency"),
])
def test_every_reason_is_capped(callers: dict[str, tuple[str, ...]]) -> None:
    verdicts = callers_readiness(callers, {})
    assert all(len(v.why) <= MESSAGE_LIMIT for v in verdicts.values() if v.why is not None), \
        [len(v.why) for v in verdicts.values() if v.why is not None]


# ---------------------------------------------------------------------------------------------------------------
# take_batch: batch formation
# ---------------------------------------------------------------------------------------------------------------

MS = 1_000_000


@dataclass(eq=False)  # compared by identity: two requests alike are still two requests
class Req:
    label: int
    rows: int
    cost: int
    key: tuple
    enqueued_ns: int
    deadline_ns: int
    gone: bool

    def abandoned(self) -> bool:
        return self.gone

    def __repr__(self) -> str:
        extra = (f" dl={self.deadline_ns // 1000}us" if self.deadline_ns else "") + (" gone" if self.gone else "")
        return f"R{self.label}(rows={self.rows} cost={self.cost} {self.key[0]} at={self.enqueued_ns // 1000}us{extra})"


@st.composite
def policies(draw: st.DrawFn) -> BatchPolicy:
    if draw(st.integers(0, 9)) == 0:
        return BatchPolicy(enabled=False)
    max_rows = draw(st.integers(1, 12))
    preferred = tuple(draw(st.lists(st.integers(1, max_rows), unique=True, max_size=3)))
    delay = draw(st.sampled_from([0, 1 * MS, 5 * MS, 20 * MS]))
    cost = draw(st.none() | st.integers(1, 60))
    return BatchPolicy(True, max_rows, delay, preferred, cost)


@st.composite
def queues(draw: st.DrawFn) -> list[Req]:
    """Requests in arrival order (times nondecreasing), between 0 and ~30 ms."""
    at = 0
    requests = []
    for label in range(draw(st.integers(0, 10))):
        at += draw(st.sampled_from([0, 0, 100_000, 1 * MS, 3 * MS]))
        rows = draw(st.integers(1, 6))
        deadline = draw(st.sampled_from([0, 0, 0, at + 1, at + 2 * MS, at + 10 * MS, at + 40 * MS]))
        requests.append(Req(label, rows, rows * draw(st.sampled_from([1, 1, 3, 10])),
                            ("FP32", (draw(st.sampled_from([2, 2, 2, 3])),)), at, deadline,
                            draw(st.integers(0, 9)) == 0))
    return requests


@st.composite
def instants(draw: st.DrawFn, requests: list[Req]) -> tuple[int, int]:
    """(now_ns, free_since_ns): now at or after the last arrival; the slot came free at some point before now."""
    last = requests[-1].enqueued_ns if requests else 0
    now = last + draw(st.sampled_from([0, 1, 500_000, 2 * MS, 10 * MS, 25 * MS]))
    free = draw(st.sampled_from([0, 0, now, max(0, now - 1 * MS), max(0, now - 4 * MS), max(0, now - 30 * MS)]))
    return now, free


def dead(request: Req, now_ns: int) -> bool:
    return request.gone or (request.deadline_ns != 0 and now_ns >= request.deadline_ns)


def reference(requests: list[Req], policy: BatchPolicy, now: int, free: int) -> tuple[list, list, int | None]:
    """(batch, dropped, wake_ns) from the README's rules, computed over a plain list without mutating it."""
    dropped: list[Req] = []
    position = 0
    while position < len(requests) and dead(requests[position], now):
        dropped.append(requests[position])
        position += 1
    if position == len(requests):
        return [], dropped, None
    if not policy.enabled:
        return [requests[position]], dropped, None
    run = [requests[position]]

    def full_run() -> bool:
        return (sum(r.rows for r in run) >= policy.max_rows
                or (policy.max_cost is not None and sum(r.cost for r in run) >= policy.max_cost))

    blocked = False
    for candidate in requests[position + 1:]:
        if full_run():
            break
        if dead(candidate, now):
            dropped.append(candidate)
            continue
        if candidate.key != run[0].key or sum(r.rows for r in run) + candidate.rows > policy.max_rows:
            blocked = True
            break
        run.append(candidate)
    # Triton's GetDynamicBatch marks the longest prefix whose rows are a preferred size, else the prefix before the
    # first request that would pass the largest one (without preferred sizes: max_batch_size, the row cap here).
    largest = max(policy.preferred_sizes, default=policy.max_rows)
    sums = [sum(r.rows for r in run[:k]) for k in range(1, len(run) + 1)]
    marked = max((k for k in range(1, len(run) + 1) if sums[k - 1] in policy.preferred_sizes),
                 default=next((k for k in range(1, len(run)) if sums[k] > largest), 0))
    window_end = max(run[0].enqueued_ns, free) + policy.max_delay_ns
    waited_out = policy.max_delay_ns != 0 and now >= window_end  # a delay of 0 is never passed, in Triton
    if marked and not waited_out:
        return run[:marked], dropped, None
    if blocked or full_run() or sums[-1] >= largest or waited_out or policy.max_delay_ns == 0:
        return run, dropped, None
    return [], dropped, window_end


def check_decision(before: list[Req], queue: collections.deque, decision, policy: BatchPolicy, now: int,
                   free: int) -> None:
    """The invariants of one decision, stated each on its own."""
    after, batch, dropped = list(queue), decision.batch, decision.dropped
    ids = lambda requests: [id(r) for r in requests]  # noqa: E731
    # Nothing lost or duplicated; what stays keeps its order.
    assert sorted(ids(after + batch + dropped)) == sorted(ids(before)), (before, batch, dropped, after)
    assert len(set(ids(after + batch + dropped))) == len(before)
    gone = set(ids(batch + dropped))
    assert ids(after) == [id(r) for r in before if id(r) not in gone]
    assert ids(dropped) == [id(r) for r in before if id(r) in set(ids(dropped))]  # arrival order
    # Dropped: exactly the dead ones among a prefix of the queue that holds the whole batch.
    assert all(dead(r, now) for r in dropped), dropped
    assert not any(dead(r, now) for r in batch), batch
    met = max((before.index(r) + 1 for r in batch + dropped), default=0)
    assert ids(dropped) == [id(r) for r in before[:met] if dead(r, now)]
    # The batch is a prefix of the live queue, in arrival order.
    live = [r for r in before if id(r) not in set(ids(dropped))]
    assert ids(batch) == ids(live[:len(batch)])
    if batch:
        assert decision.wake_ns is None
        assert len({r.key for r in batch}) == 1, batch
        rows = sum(r.rows for r in batch)
        assert rows <= policy.max_rows or len(batch) == 1, (rows, batch)
        if not policy.enabled:
            assert len(batch) == 1
        if policy.max_cost is not None:  # the budget closes a batch: only its last request may reach it
            assert sum(r.cost for r in batch[:-1]) < policy.max_cost, batch
        # Within the delay, a batch with preferred sizes is the longest prefix of the run it could take whose rows
        # are a preferred size, else the prefix before the request that would pass the largest preferred size, else
        # the whole run; once the delay has passed, the whole run (Triton's GetDynamicBatch).
        if policy.enabled and policy.preferred_sizes:
            run, run_rows, run_cost = list(batch), rows, sum(r.cost for r in batch)
            for extra in after:
                if run_rows >= policy.max_rows or policy.over_budget(run_cost):
                    break
                if dead(extra, now):
                    continue  # the scan would drop it and go on
                if extra.key != batch[0].key or run_rows + extra.rows > policy.max_rows:
                    break
                run, run_rows, run_cost = run + [extra], run_rows + extra.rows, run_cost + extra.cost
            cuts = [k for k in range(1, len(run) + 1) if sum(r.rows for r in run[:k]) in policy.preferred_sizes]
            passing = [k for k in range(1, len(run)) if sum(r.rows for r in run[:k + 1]) > max(policy.preferred_sizes)]
            if policy.max_delay_ns and now >= max(batch[0].enqueued_ns, free) + policy.max_delay_ns:
                assert len(batch) == len(run), ("the delay passed: not the whole run", batch, run)
            else:
                assert len(batch) == (max(cuts) if cuts else passing[0] if passing else len(run)), \
                    ("not the batch Triton marks", batch, run)
    elif after:
        # Waiting: the whole queue is live and could still grow; the wake-up is the first one's window end.
        assert policy.enabled
        assert not any(dead(r, now) for r in after)
        assert len({r.key for r in after}) == 1
        assert sum(r.rows for r in after) < max(policy.preferred_sizes, default=policy.max_rows)
        assert not policy.over_budget(sum(r.cost for r in after))
        assert not any(sum(r.rows for r in after[:k]) in policy.preferred_sizes for k in range(1, len(after) + 1))
        assert decision.wake_ns == max(after[0].enqueued_ns, free) + policy.max_delay_ns
        assert decision.wake_ns > now
    else:
        assert decision.wake_ns is None and all(dead(r, now) for r in before)


@BOUNDED
@given(st.data(), queues(), policies())
def test_take_batch_follows_the_rules(data: st.DataObject, requests: list[Req], policy: BatchPolicy) -> None:
    now, free = data.draw(instants(requests))
    queue = collections.deque(requests)
    decision = take_batch(queue, policy, now, free)
    check_decision(requests, queue, decision, policy, now, free)
    batch, dropped, wake = reference(requests, policy, now, free)
    assert (decision.batch, decision.dropped, decision.wake_ns) == (batch, dropped, wake), \
        (requests, policy, now, free)


def tritons_batch_length(requests: list[Req], preferred_sizes: tuple[int, ...], max_batch_size: int, delay_ns: int,
                         now: int) -> int:
    """How many requests Triton 2.41's DynamicBatchScheduler::GetDynamicBatch (core r23.12) sends at ``now`` (0:
    it waits), transliterated for the case nereid has: a fresh cursor, no payload being grown, one priority level,
    every request live and within max_batch_size, the delay counted from the oldest request's arrival."""
    preferred = set(preferred_sizes) or {max_batch_size}  # NormalizeModelConfig: max_batch_size, without any
    max_preferred = max(preferred)
    pending = count = best = best_count = 0
    send_now = False
    for request in requests:
        batch_size = max(1, request.rows)
        if count:
            if pending + batch_size > max_preferred and best == 0:
                best, best_count = pending, count  # MarkCursor
            if pending + batch_size > max_batch_size or request.key != requests[0].key:
                send_now = True
                break
        pending, count = pending + batch_size, count + 1
        if pending in preferred:
            best, best_count = pending, count
    delay_is_exceeded = delay_ns != 0 and now - min(r.enqueued_ns for r in requests[:count]) >= delay_ns
    if best != 0 and not delay_is_exceeded:
        return best_count  # SetCursorToMark
    if send_now or pending >= max_preferred or delay_is_exceeded or delay_ns == 0:
        return count
    return 0


@BOUNDED
@given(st.data(), queues(), policies())
def test_take_batch_forms_tritons_batches(data: st.DataObject, requests: list[Req], policy: BatchPolicy) -> None:
    """Where Triton's rules apply (no cost budget, no request gone or out of time, none over the row cap, the window
    counted from arrival), each batch is the one Triton's batcher sends."""
    requests = [r for r in requests if not r.gone and not r.deadline_ns and r.rows <= policy.max_rows]
    if not policy.enabled or not requests:
        return
    policy = BatchPolicy(True, policy.max_rows, policy.max_delay_ns, policy.preferred_sizes)
    now = data.draw(instants(requests))[0]
    decision = take_batch(collections.deque(requests), policy, now, 0)
    expected = tritons_batch_length(requests, policy.preferred_sizes, policy.max_rows, policy.max_delay_ns, now)
    assert len(decision.batch) == expected, (requests, policy, now)


@BOUNDED
@given(st.data(), queues(), policies())
def test_deciding_again_at_the_wake_up_releases_a_batch(data: st.DataObject, requests: list[Req],
                                                       policy: BatchPolicy) -> None:
    now, free = data.draw(instants(requests))
    queue = collections.deque(requests)
    decision = take_batch(queue, policy, now, free)
    if decision.wake_ns is None:
        return
    waiting = list(queue)
    again = take_batch(queue, policy, decision.wake_ns, free)
    check_decision(waiting, queue, again, policy, decision.wake_ns, free)
    if not any(dead(r, decision.wake_ns) for r in waiting):
        assert again.batch == waiting and again.dropped == [], (waiting, again)  # nothing changed: all of it goes
    else:
        assert again.batch or again.dropped


@BOUNDED
@given(st.data(), queues(), policies())
def test_deciding_at_each_wake_up_drains_the_queue_in_arrival_order(data: st.DataObject, requests: list[Req],
                                                                   policy: BatchPolicy) -> None:
    now, free = data.draw(instants(requests))
    queue = collections.deque(requests)
    batched: list[Req] = []
    dropped: list[Req] = []
    for _ in range(2 * len(requests) + 1):
        if not queue:
            break
        before = list(queue)
        decision = take_batch(queue, policy, now, free)
        check_decision(before, queue, decision, policy, now, free)
        batched += decision.batch
        dropped += decision.dropped
        if decision.batch:
            free = now  # the slot is busy with it, then comes free again at once
        elif decision.wake_ns is not None:
            assert decision.wake_ns > now
            now = decision.wake_ns
    assert not queue, "the queue did not drain"
    assert sorted(map(id, batched + dropped)) == sorted(map(id, requests))
    assert [r.label for r in batched] == sorted(r.label for r in batched), "batches left out of arrival order"
