"""Dynamic batching policy: how queued requests are coalesced into one execution.

Resolved once per model at load from its ``batching:`` settings and signature.
The rules (Triton's dynamic batcher, with the cost budget of a token batcher):

* requests are taken in arrival order; a batch never mixes requests whose
  non-batch shapes or datatypes differ, and never exceeds ``max_rows``;
* with a cost budget, a batch closes once its summed cost is no longer below
  it; the first request is always accepted, whatever its rows or cost;
* a batch is dispatched as soon as it is full (the row cap, the cost budget,
  or an incompatible request next in line), or as soon as the requests waiting
  can form a preferred size (it is then cut back to the largest preferred
  size it reached, the rest staying first in line); otherwise when its first
  request has waited ``max_delay_ns``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        if not settings.enabled or not signature.batches:
            return cls(enabled=False)
        cap = settings.max_batch_size or signature.max_batch_size
        if cap > signature.max_batch_size:
            raise ConfigError(f"{origin}.batching.max_batch_size: must not exceed the model's max_batch_size "
                              f"{signature.max_batch_size}, got {cap}")
        too_big = [p for p in settings.preferred_batch_sizes if p > cap]
        if too_big:
            raise ConfigError(f"{origin}.batching.preferred_batch_sizes: must not exceed max_batch_size {cap}, "
                              f"got {list(settings.preferred_batch_sizes)}")
        return cls(True, cap, int(settings.max_queue_delay_ms * 1_000_000), settings.preferred_batch_sizes,
                   settings.max_batch_cost)


def batch_key(inputs: list[NamedTensor]) -> tuple:
    """Requests with equal keys may share a batch: same datatypes and non-batch shapes."""
    return tuple((t.dtype, t.shape[1:]) for t in inputs)


def request_cost(signature: ModelSignature, inputs: list[NamedTensor], rows: int) -> int:
    """Rows times the largest number of elements along any input's variable (-1) axes.

    A model without variable axes costs one per row; a request of 2 rows of
    37 tokens on a ``dims: [-1]`` input costs 74.
    """
    per_row = 1
    offset = 1 if signature.batches else 0  # skip the batch axis
    for spec, tensor in zip(signature.inputs, inputs):
        variable = [tensor.shape[offset + axis] for axis, dim in enumerate(spec.dims) if dim == -1]
        if variable:
            per_row = max(per_row, math.prod(variable))
    return rows * per_row
