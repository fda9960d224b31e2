"""Batch formation as a pure function: take_batch over plain queues, with no clock and no asyncio."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import pytest

from nereid.batching import BatchPolicy, request_cost, split_rows, stack_rows, take_batch
from nereid.dtypes import DType
from nereid.errors import ConfigError
from nereid.settings import BatchingSettings
from nereid.signature import ModelSignature, TensorSpec
from nereid.tensors import NamedTensor, bytes_array

FIXED = ModelSignature((TensorSpec("x", DType.FP32, (2,)),), (TensorSpec("y", DType.FP32, (2,)),), 16)
VARIABLE = ModelSignature((TensorSpec("x", DType.FP32, (-1,)),), (TensorSpec("y", DType.FP32, (-1,)),), 16)
MS = 1_000_000


@dataclass
class Req:
    label: str
    rows: int = 1
    enqueued_ns: int = 0
    key: tuple = ("fp32", (2,))
    cost: int = 0
    deadline_ns: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.cost = self.cost or self.rows

    def abandoned(self) -> bool:
        return self.cancelled


def policy(**settings) -> BatchPolicy:
    return BatchPolicy.resolve(BatchingSettings(**settings), FIXED, "nereid.yaml: models[0]")


def queue(*requests: Req) -> collections.deque[Req]:
    return collections.deque(requests)


def labels(requests) -> list[str]:
    return [r.label for r in requests]


def test_within_the_delay_nothing_goes_and_the_wake_up_is_the_first_requests_window_end() -> None:
    waiting = queue(Req("a", enqueued_ns=10 * MS), Req("b", enqueued_ns=11 * MS))
    decision = take_batch(waiting, policy(max_queue_delay_ms=5), now_ns=12 * MS)
    assert decision.batch == [] and decision.dropped == [] and decision.wake_ns == 15 * MS
    assert labels(waiting) == ["a", "b"]  # nothing left the queue
    decision = take_batch(waiting, policy(max_queue_delay_ms=5), now_ns=15 * MS)
    assert labels(decision.batch) == ["a", "b"] and not waiting and decision.wake_ns is None


def test_time_spent_waiting_for_a_busy_model_does_not_count_as_waiting_for_company() -> None:
    waiting = queue(Req("a", enqueued_ns=0), Req("b", enqueued_ns=1 * MS))
    rules = policy(max_queue_delay_ms=2)
    # the model was busy until 10 ms: the window runs from then, not from a's arrival
    decision = take_batch(waiting, rules, now_ns=10 * MS, free_since_ns=10 * MS)
    assert decision.batch == [] and decision.wake_ns == 12 * MS
    assert labels(take_batch(waiting, rules, now_ns=12 * MS, free_since_ns=10 * MS).batch) == ["a", "b"]
    # a slot that came free before the request arrived does not shorten its window either
    waiting = queue(Req("a", enqueued_ns=20 * MS))
    assert take_batch(waiting, rules, now_ns=21 * MS, free_since_ns=10 * MS).wake_ns == 22 * MS


def test_zero_delay_takes_what_waits_at_once() -> None:
    decision = take_batch(queue(Req("a"), Req("b")), policy(), now_ns=0)
    assert labels(decision.batch) == ["a", "b"]


def test_the_row_cap_closes_a_batch_without_waiting_and_never_splits_a_request() -> None:
    waiting = queue(*(Req(str(i), rows) for i, rows in enumerate([1, 2, 3, 1, 4])))
    rules = policy(max_batch_size=6, max_queue_delay_ms=1000)
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["0", "1", "2"]  # 6 rows: full
    decision = take_batch(waiting, rules, now_ns=0)
    assert decision.batch == [] and decision.wake_ns == 1000 * MS  # 5 rows: may still grow
    assert labels(take_batch(waiting, rules, now_ns=1000 * MS).batch) == ["3", "4"]


def test_a_request_that_would_pass_the_cap_or_differs_in_shape_starts_the_next_batch() -> None:
    rules = policy(max_batch_size=4, max_queue_delay_ms=1000)
    waiting = queue(Req("a", 3), Req("b", 2), Req("c", 1))
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a"]  # blocked by b: full, goes now
    other = queue(Req("a"), Req("b", key=("fp32", (3,))), Req("c"))
    assert labels(take_batch(other, rules, now_ns=0).batch) == ["a"]  # c never jumps over b
    assert labels(other) == ["b", "c"]


def test_cost_budget_closes_the_batch_and_the_first_request_is_always_taken() -> None:
    rules = BatchPolicy(True, max_rows=16, max_delay_ns=10**12, max_cost=100)
    waiting = queue(Req("huge", cost=500), Req("a", cost=40), Req("b", cost=40), Req("c", cost=40), Req("d", cost=10))
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["huge"]
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a", "b", "c"]  # 120 reached the budget
    assert take_batch(waiting, rules, now_ns=0).batch == []  # 10 is below it: wait for company


def test_a_preferred_size_goes_early_and_an_oversized_run_is_cut_back_to_it() -> None:
    rules = policy(preferred_batch_sizes=[4], max_queue_delay_ms=5000)
    waiting = queue(*(Req(str(i)) for i in range(6)))
    decision = take_batch(waiting, rules, now_ns=0)
    assert labels(decision.batch) == ["0", "1", "2", "3"]
    assert labels(waiting) == ["4", "5"]  # the rest stays first in line
    assert take_batch(waiting, rules, now_ns=0).wake_ns == 5000 * MS
    rules = policy(preferred_batch_sizes=[2, 3], max_batch_size=4, max_queue_delay_ms=5000)
    # the longest preferred prefix wins: rows 1, 2(+1), 3(+1) -> 3 requests
    assert labels(take_batch(queue(Req("a"), Req("b"), Req("c"), Req("d", 2)), rules, now_ns=0).batch) == \
        ["a", "b", "c"]


# Preferred sizes as Triton 2.41 forms batches with them (core r23.12, DynamicBatchScheduler::GetDynamicBatch):
# it marks the largest preferred size reached, or, reaching none, the batch so far where the next request would pass
# the largest preferred size; the marked batch goes while the queue delay has not passed (a delay of 0 never has).
# Found by a bug hunt: max_batch_size 8, preferred [4], two 3-row requests queued behind a running one ran as one
# batch of 6 where Triton runs [3] then [3]; a mixed load formed batches of 5, 6, 7 and 8.
PREFERRED_4 = {"max_batch_size": 8, "preferred_batch_sizes": [4]}


@pytest.mark.parametrize("rows, delay_ms, now_ms, expected", [
    # the next request would pass the largest preferred size, none reached: the batch so far is marked and goes,
    # with a delay of 0 (never "exceeded" in Triton) as within a delay's window (the hunt's [3] then [3])
    ([3, 3], 0, 0, ["0"]),
    ([3, 3], 5, 0, ["0"]),
    ([2, 1, 3, 1], 5, 0, ["0", "1"]),
    # an exact preferred size reached (several rows each) is marked, the largest one reached wins
    ([1, 3, 1], 5, 0, ["0", "1"]),
    ([3, 1, 1, 1, 1], 5, 0, ["0", "1"]),
    # a preferred size reached before the pass keeps the mark: the pass marks only when nothing is marked
    ([4, 4], 5, 0, ["0"]),
    # max_batch_size stops the batch, but the mark made before it (3 would pass 4 after 2) is what goes
    ([2, 3, 4], 1000, 0, ["0"]),
    # a request that alone passes the largest preferred size: the batch cannot reach one, so it goes at once...
    ([5], 1000, 0, ["0"]),
    # ...and alone when another waits (the mark falls before the second request, after the first)
    ([5, 1], 1000, 0, ["0"]),
    # the delay passed: the mark is ignored, and every request max_batch_size allows goes
    ([3, 3], 5, 5, ["0", "1"]),
    ([1, 1, 1, 1, 1, 1], 5, 5, ["0", "1", "2", "3", "4", "5"]),
    ([2, 3, 4], 5, 5, ["0", "1"]),
    # below every preferred size, nothing marked, a delay not passed: wait (Triton returns the wait)
    ([1, 2], 5, 0, []),
    # ...and with a delay of 0 what waits goes (Triton: "pending_batch_delay_ns_ == 0")
    ([1, 2], 0, 0, ["0", "1"]),
])
def test_preferred_sizes_form_the_batches_triton_forms(rows, delay_ms, now_ms, expected) -> None:
    waiting = queue(*(Req(str(i), r) for i, r in enumerate(rows)))
    decision = take_batch(waiting, policy(max_queue_delay_ms=delay_ms, **PREFERRED_4), now_ns=now_ms * MS)
    assert labels(decision.batch) == expected
    assert labels(waiting) == [str(i) for i in range(len(expected), len(rows))]  # the rest stays first in line
    assert decision.wake_ns == (None if expected else delay_ms * MS)


def test_the_hunts_two_three_row_requests_run_as_two_batches() -> None:
    """The hunt's repro step by step: [3] goes, then the second [3] alone (with a delay of 0; once its window
    ends with one)."""
    waiting = queue(Req("a", 3), Req("b", 3))
    assert labels(take_batch(waiting, policy(**PREFERRED_4), now_ns=0).batch) == ["a"]
    assert labels(take_batch(waiting, policy(**PREFERRED_4), now_ns=0).batch) == ["b"]
    waiting = queue(Req("a", 3), Req("b", 3))
    rules = policy(max_queue_delay_ms=0.1, **PREFERRED_4)
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a"]  # at once, not after the 0.1 ms
    assert take_batch(waiting, rules, now_ns=0).wake_ns == MS // 10
    assert labels(take_batch(waiting, rules, now_ns=MS // 10).batch) == ["b"]


def test_a_delay_window_restarted_by_a_freed_instance_keeps_the_preferred_mark() -> None:
    """nereid's own rule kept beside Triton's: the delay counts from when an instance came free after all were
    busy, so requests that queued behind a long execution are still within their window and the mark goes (Triton,
    counting from the oldest request's arrival, would find the delay passed and send both)."""
    waiting = queue(Req("a", 3, enqueued_ns=0), Req("b", 3, enqueued_ns=1 * MS))
    rules = policy(max_queue_delay_ms=5, **PREFERRED_4)
    assert labels(take_batch(waiting, rules, now_ns=100 * MS, free_since_ns=100 * MS).batch) == ["a"]


def test_without_preferred_sizes_the_row_cap_is_the_preferred_size() -> None:
    """Triton gives a dynamic batcher without preferred sizes max_batch_size as its one: nothing changes then."""
    rules = policy(max_batch_size=4, max_queue_delay_ms=5)
    waiting = queue(Req("a", 1), Req("b", 2), Req("c", 2))
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a", "b"]  # c would pass 4: full, goes
    assert take_batch(waiting, rules, now_ns=0).wake_ns == 5 * MS
    assert labels(take_batch(queue(Req("a", 4), Req("b")), rules, now_ns=0).batch) == ["a"]


def test_the_cost_budget_stops_a_batch_as_max_batch_size_does_and_the_preferred_mark_still_goes() -> None:
    """nereid's cost budget (Triton has none) closes the batch where max_batch_size would: the mark made before
    it goes within the delay, every request up to it once the delay has passed."""
    rules = BatchPolicy(True, max_rows=8, max_delay_ns=5 * MS, preferred_sizes=(4,), max_cost=100)
    waiting = queue(Req("a", 3, cost=30), Req("b", 3, cost=80), Req("c", 1))
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a"]
    waiting = queue(Req("a", 3, cost=30), Req("b", 3, cost=80), Req("c", 1))
    assert labels(take_batch(waiting, rules, now_ns=5 * MS).batch) == ["a", "b"]
    waiting = queue(Req("a", 1, cost=60), Req("b", 1, cost=60), Req("c", 1))
    assert labels(take_batch(waiting, rules, now_ns=0).batch) == ["a", "b"]  # over budget, nothing marked: full


def test_abandoned_and_expired_requests_are_dropped_wherever_they_wait() -> None:
    rules = policy(max_queue_delay_ms=1)
    waiting = queue(Req("gone", cancelled=True), Req("a"), Req("late", deadline_ns=5), Req("b", deadline_ns=50),
                    Req("left", cancelled=True), Req("c"))
    decision = take_batch(waiting, rules, now_ns=10 * MS)
    assert labels(decision.batch) == ["a", "c"]
    assert labels(decision.dropped) == ["gone", "late", "b", "left"]
    assert not waiting


def test_an_expired_first_request_does_not_hold_the_window_of_the_next() -> None:
    rules = policy(max_queue_delay_ms=10)
    waiting = queue(Req("late", enqueued_ns=0, deadline_ns=1 * MS), Req("a", enqueued_ns=5 * MS))
    decision = take_batch(waiting, rules, now_ns=11 * MS)
    assert labels(decision.dropped) == ["late"] and decision.batch == [] and decision.wake_ns == 15 * MS


def test_without_batching_each_request_goes_alone() -> None:
    waiting = queue(Req("a"), Req("b"))
    assert labels(take_batch(waiting, BatchPolicy(enabled=False), now_ns=0).batch) == ["a"]
    assert labels(waiting) == ["b"]


def test_an_empty_queue_decides_nothing() -> None:
    decision = take_batch(queue(), policy(), now_ns=0)
    assert decision.batch == [] and decision.dropped == [] and decision.wake_ns is None


def test_request_cost_counts_elements_along_variable_axes() -> None:
    tokens = [NamedTensor("x", DType.FP32, np.zeros((2, 37), np.float32))]
    assert request_cost(VARIABLE, tokens, 2) == 74
    assert request_cost(VARIABLE, [NamedTensor("x", DType.FP32, np.zeros((2, 0), np.float32))], 2) == 2  # as README
    assert request_cost(FIXED, [NamedTensor("x", DType.FP32, np.zeros((3, 2), np.float32))], 3) == 3


def test_policy_is_checked_against_the_model() -> None:
    assert policy().max_rows == 16 and policy(max_batch_size=4).max_rows == 4
    with pytest.raises(ConfigError, match=r"models\[0\].batching.max_batch_size: must not exceed the model's "
                                          r"max_batch_size 16, got 32"):
        policy(max_batch_size=32)
    unbatched = ModelSignature(FIXED.inputs, FIXED.outputs, 0)
    assert not BatchPolicy.resolve(BatchingSettings(), unbatched, "x").enabled
    assert not BatchPolicy.resolve(BatchingSettings(enabled=False, max_batch_size=4), unbatched, "x").enabled
    # A size asked of a model that does not batch was ignored without a word (found by a bug hunt), where one
    # past a batching model's max_batch_size is refused: the same rule, at 0.
    for given, refused in (({"max_batch_size": 4}, r"max_batch_size: the model does not batch \(its max_batch_size "
                                                   r"is 0: one request per execution\), got 4"),
                           ({"preferred_batch_sizes": (2,)}, r"preferred_batch_sizes: .*, got \[2\]"),
                           # (and, found by a later hunt, the window and the cost budget were ignored too)
                           ({"max_queue_delay_ms": 5.0}, r"max_queue_delay_ms: .*, got 5.0"),
                           ({"max_batch_cost": 64}, r"max_batch_cost: .*, got 64")):
        with pytest.raises(ConfigError, match=rf"^x\.batching\.{refused}$"):
            BatchPolicy.resolve(BatchingSettings(**given), unbatched, "x")
    # Requests without inputs are never merged: the model could not tell how many rows to answer.
    no_inputs = ModelSignature((), FIXED.outputs, 16)
    assert not BatchPolicy.resolve(BatchingSettings(), no_inputs, "x").enabled


def test_requests_are_stacked_into_one_padded_buffer_and_split_back_into_views() -> None:
    first = [NamedTensor("x", DType.FP32, np.arange(2 * 3, dtype=np.float32).reshape(2, 3))]
    second = [NamedTensor("x", DType.FP32, np.full((1, 3), 7, np.float32))]
    [stacked] = stack_rows([first, second], rows=4)  # a bundle compiled for 4 rows: one zero row of padding
    assert stacked.name == "x" and stacked.data.dtype == np.float32
    assert stacked.data.tolist() == [[0, 1, 2], [3, 4, 5], [7, 7, 7], [0, 0, 0]]
    [[own_first], [own_second]] = split_rows([stacked], [2, 1])
    assert own_first.data.tolist() == [[0, 1, 2], [3, 4, 5]] and own_second.data.tolist() == [[7, 7, 7]]
    assert np.shares_memory(own_second.data, stacked.data)  # views of the execution's output, no copies


def test_the_padding_rows_of_a_bytes_input_are_empty_bytes() -> None:
    """Defect: a BYTES input's padding rows were the int 0, which a padding model's len() or b"".join fails on."""
    first = [NamedTensor("s", DType.BYTES, bytes_array([b"ab"], (1,)))]
    second = [NamedTensor("s", DType.BYTES, bytes_array([b"cd"], (1,)))]
    [stacked] = stack_rows([first, second], rows=4)
    assert stacked.data.tolist() == [b"ab", b"cd", b"", b""]
    assert all(type(element) is bytes for element in stacked.data)


def test_a_delay_in_milliseconds_is_rounded_to_the_nanosecond_not_cut() -> None:
    """Found by a hunt acting as a Triton user: max_queue_delay_microseconds 1001 written as 1.001 ms came back
    from ModelConfig as 1000 (1.001 * 1e6 is 1000999.99...), 2,985 of the values 1 to 200,000 us one less."""
    assert policy(max_queue_delay_ms=1.001).max_delay_ns == 1_001_000
    assert all(policy(max_queue_delay_ms=us / 1000).max_delay_ns == us * 1000 for us in range(1, 20_001))
