"""Dynamic batching policy: how queued requests are coalesced into one execution.

Resolved once per model at load from its ``batching:`` settings and signature.
The rules (Triton's dynamic batcher, with the cost budget of a token batcher):

* requests are taken in arrival order; a batch never mixes requests whose
  non-batch shapes or datatypes differ, and never exceeds ``max_rows``;
* with a cost budget, a batch closes once its summed cost is no longer below
  it; the first request is always accepted, whatever its rows or cost;
* a batch is dispatched as soon as it is full (the row cap, the cost budget,
  or an incompatible request next in line), or as soon as the requests waiting
  reach a preferred size or would pass the largest one (below); otherwise once
  its first request has waited ``max_delay_ns`` for company, counted from its
  arrival or from the moment an instance last came free after every instance
  was busy, whichever is later. Time spent waiting because every instance was
  busy is not time spent waiting for company: without this rule, under load,
  the requests that queued during one execution would leave at once as the
  next batch, while the clients answered by that execution could never join
  it, and a saturated model would alternate between two half batches. Only
  that time is left out: an instance freed while another stood free restarts
  no window;
* preferred sizes form the batch Triton's dynamic batcher forms (2.41,
  ``DynamicBatchScheduler::GetDynamicBatch``): it marks the longest prefix of
  the requests that may share a batch whose rows are a preferred size, else,
  when their rows pass the largest preferred size, the requests before the one
  that passes it (at least the first). Until the delay has passed (always,
  with a delay of 0) a marked batch goes at once, the rest staying first in
  line; once it has passed, the batch takes every request the row cap and the
  cost budget allow. Without preferred sizes the row cap plays their part, as
  Triton makes ``max_batch_size`` the one preferred size then; the cost budget
  (Triton has none) stops a batch as the row cap does;
* a request whose caller went away, or whose deadline passed, never runs: it
  leaves the queue at the next decision and is handed back to be answered.

:func:`take_batch` applies these rules to a queue at one instant. It reads no
clock and awaits nothing, so the scheduler owns only the waiting and the
rules are tested on plain lists. :func:`stack_rows` and :func:`split_rows` make
a batch's tensors out of its requests' and give each request its rows back.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from nereid.errors import ConfigError
from nereid.settings import BatchingSettings
from nereid.signature import ModelSignature
from nereid.tensors import NamedTensor


@dataclass(frozen=True)
class BatchPolicy:
    """The resolved batching rules of one model; ``enabled`` False: one request per execution."""

    enabled: bool
    max_rows: int = 1
    max_delay_ns: int = 0
    preferred_sizes: tuple[int, ...] = ()
    max_cost: int | None = None

    @classmethod
    def resolve(cls, settings: BatchingSettings, signature: ModelSignature, origin: str) -> BatchPolicy:
        """Combine settings with the model's contract; ConfigError names the setting and value."""
        asked = [(key, value) for key, value in (("max_batch_size", settings.max_batch_size),
                                                 ("preferred_batch_sizes", list(settings.preferred_batch_sizes)),
                                                 ("max_queue_delay_ms", settings.max_queue_delay_ms),
                                                 ("max_batch_cost", settings.max_batch_cost)) if value]
        if settings.enabled and not signature.batches and asked:
            # A batching rule asked of a model that takes one request at a time was ignored without a word, where
            # a size past a batching model's max_batch_size is refused: the same rule, at 0.
            key, value = asked[0]
            raise ConfigError(f"{origin}.batching.{key}: the model does not batch (its max_batch_size is 0: one "
                              f"request per execution), got {value}")
        if not settings.enabled or not signature.batches or not signature.inputs:
            # Without inputs nothing would tell the model how many requests a batch holds.
            return cls(enabled=False)
        cap = settings.max_batch_size or signature.max_batch_size
        if cap > signature.max_batch_size:
            raise ConfigError(f"{origin}.batching.max_batch_size: must not exceed the model's max_batch_size "
                              f"{signature.max_batch_size}, got {cap}")
        too_big = [p for p in settings.preferred_batch_sizes if p > cap]
        if too_big:
            raise ConfigError(f"{origin}.batching.preferred_batch_sizes: must not exceed max_batch_size {cap}, "
                              f"got {list(settings.preferred_batch_sizes)}")
        return cls(True, cap, round(settings.max_queue_delay_ms * 1_000_000), settings.preferred_batch_sizes,
                   settings.max_batch_cost)

    def over_budget(self, cost: int) -> bool:
        """True once a batch's summed cost has reached the cost budget (never without one)."""
        return self.max_cost is not None and cost >= self.max_cost


def batch_key(inputs: list[NamedTensor]) -> tuple:
    """Requests with equal keys may share a batch: same datatypes and non-batch shapes."""
    return tuple((t.dtype, t.shape[1:]) for t in inputs)


def request_cost(signature: ModelSignature, inputs: list[NamedTensor], rows: int) -> int:
    """Rows times the largest number of elements along any input's variable (-1) axes, at least one per row.

    A model without variable axes costs one per row; a request of 2 rows of
    37 tokens on a ``dims: [-1]`` input costs 74, one of 2 rows of 0 tokens 2
    (an empty request still takes an execution's place in the batch).
    """
    per_row = 1
    offset = 1 if signature.batches else 0  # skip the batch axis
    for spec, tensor in zip(signature.inputs, inputs):
        variable = [tensor.shape[offset + axis] for axis, dim in enumerate(spec.dims) if dim == -1]
        if variable:
            per_row = max(per_row, math.prod(variable))
    return rows * per_row


class Queued(Protocol):
    """What batch formation reads of a waiting request."""

    rows: int
    cost: int
    key: tuple
    enqueued_ns: int
    deadline_ns: int  # 0: none

    def abandoned(self) -> bool:
        """True once its caller no longer waits for the answer."""
        ...


Q = TypeVar("Q", bound=Queued)


@dataclass
class Decision(Generic[Q]):
    """What :func:`take_batch` decided.

    ``batch``: requests to run now, in arrival order (empty: none yet).
    ``dropped``: abandoned or expired requests it took off the queue; answer them.
    ``wake_ns``: with no batch and a non-empty queue, the instant at which the
    first request's delay ends; decide again then, or at the next arrival.
    """

    batch: list[Q] = field(default_factory=list)
    dropped: list[Q] = field(default_factory=list)
    wake_ns: int | None = None


def take_batch(queue: collections.deque[Q], policy: BatchPolicy, now_ns: int, free_since_ns: int = 0) -> Decision[Q]:
    """Take the next batch off the front of ``queue`` if the rules say it goes at ``now_ns``.

    ``free_since_ns``: since when an instance has been free without a break,
    that is when the last stretch with every instance busy ended (the delay
    window starts no earlier). Removes from ``queue`` exactly the returned
    batch and dropped requests.
    """
    decision: Decision[Q] = Decision()
    while queue and will_not_run(queue[0], now_ns):
        decision.dropped.append(queue.popleft())
    if not queue:
        return decision
    if not policy.enabled:
        decision.batch.append(queue.popleft())
        return decision
    first = queue[0]
    count, rows, cost, blocked = 1, first.rows, first.cost, False
    while count < len(queue) and rows < policy.max_rows and not policy.over_budget(cost):
        candidate = queue[count]
        if will_not_run(candidate, now_ns):
            decision.dropped.append(candidate)
            del queue[count]
            continue
        if candidate.key != first.key or rows + candidate.rows > policy.max_rows:
            blocked = True  # it starts the next batch, keeping arrival order
            break
        count, rows, cost = count + 1, rows + candidate.rows, cost + candidate.cost
    full = blocked or rows >= policy.max_rows or policy.over_budget(cost)
    window_end = max(first.enqueued_ns, free_since_ns) + policy.max_delay_ns
    # Triton never finds a delay of 0 exceeded: a marked batch goes then too, not every request waiting.
    waited_out = policy.max_delay_ns != 0 and now_ns >= window_end
    marked = _preferred_mark(queue, count, policy.preferred_sizes) if policy.preferred_sizes else 0
    if marked and not waited_out:
        decision.batch.extend(queue.popleft() for _ in range(marked))  # the rest stays first in line
    elif full or waited_out or policy.max_delay_ns == 0:
        decision.batch.extend(queue.popleft() for _ in range(count))
    else:
        decision.wake_ns = window_end
    return decision


def will_not_run(request: Queued, now_ns: int) -> bool:
    """True for a request whose caller went away or whose deadline has passed at ``now_ns``."""
    return request.abandoned() or deadline_passed(request.deadline_ns, now_ns)


def deadline_passed(deadline_ns: int, now_ns: int) -> bool:
    """True when the absolute monotonic deadline ``deadline_ns`` (0: none) has passed at ``now_ns``."""
    return deadline_ns != 0 and now_ns >= deadline_ns


def stack_rows(requests: list[list[NamedTensor]], rows: int) -> list[NamedTensor]:
    """One tensor of ``rows`` rows per input: the requests' rows stacked in order, then zero rows (a bundle's
    padding; empty elements ``b""`` in a BYTES input), written straight into one buffer: one copy."""
    stacked = []
    for tensors in zip(*requests):
        first = tensors[0].data
        buffer = np.empty((rows, *first.shape[1:]), first.dtype)
        filled = sum(len(t.data) for t in tensors)
        np.concatenate([t.data for t in tensors], out=buffer[:filled])
        # A BYTES tensor holds bytes elements (an object array): a 0 there fails a model's len() or b"".join.
        buffer[filled:] = b"" if buffer.dtype == object else 0
        stacked.append(NamedTensor(tensors[0].name, tensors[0].dtype, buffer))
    return stacked


def split_rows(outputs: list[NamedTensor], rows: list[int]) -> list[list[NamedTensor]]:
    """Each request's own rows of every output (views, no copies)."""
    bounds = np.cumsum([0, *rows])
    return [[NamedTensor(t.name, t.dtype, t.data[bounds[i]:bounds[i + 1]]) for t in outputs]
            for i in range(len(rows))]


def _preferred_mark(queue: collections.deque[Q], count: int, preferred_sizes: tuple[int, ...]) -> int:
    """How many of the first ``count`` requests Triton's batcher marks to go within the delay (0: none).

    The longest prefix whose rows are a preferred size; else, once the rows
    pass the largest preferred size, the requests before the one that passes
    it (GetDynamicBatch's MarkCursor when the next request would pass it), at
    least the first: a first request past it alone cannot grow to one, and
    Triton sends it at once.
    """
    largest = max(preferred_sizes)
    rows, keep = 0, 0
    for index in range(count):
        rows += queue[index].rows
        if rows in preferred_sizes:
            keep = index + 1
        elif rows > largest:
            return keep or max(index, 1)  # no preferred size is reached past the largest
    return keep
