"""From manifest tensors to the core's ModelSignature (row-major, leading batch axis).

The core only knows a *leading* batch axis. Manifest shapes list the batch axis
last, which is the leading axis once reversed, so the usual bundle maps
directly: ``max_batch_size`` is the largest served compiled size and ``dims``
the non-batch row-major dims. When some tensor has no batch axis, or has it
elsewhere, the signature reports ``max_batch_size: 0`` with the full row-major
shape (the batch position as -1), and the backend requires the request's batch
to be exactly one of the compiled sizes.
"""

from __future__ import annotations

import enum
from typing import Sequence

from nereid.backends.xla.manifest import ManifestTensor
from nereid.signature import ModelSignature, TensorSpec


class BatchMode(enum.Enum):
    """How requests relate to the compiled batch sizes."""

    NONE = "none"        # no batching: one program, no batch axis
    LEADING = "leading"  # every tensor batched on its leading row-major axis: pad up to a compiled size
    EXACT = "exact"      # batching, but not every tensor leads with it: the batch must be a compiled size


def batch_mode(tensors: Sequence[ManifestTensor], batched: bool) -> BatchMode:
    """The mode of a set of tensors (``batched``: the manifest lists compiled sizes)."""
    if not batched:
        return BatchMode.NONE
    if all(t.row_major_batch_axis == 0 for t in tensors):
        return BatchMode.LEADING
    return BatchMode.EXACT


def build_signature(inputs: Sequence[ManifestTensor], outputs: Sequence[ManifestTensor], mode: BatchMode,
                    max_batch_size: int) -> ModelSignature:
    """The core signature of these tensors (``max_batch_size`` is used in LEADING mode only)."""
    leading = mode is BatchMode.LEADING

    def spec(tensor: ManifestTensor) -> TensorSpec:
        dims = tensor.row_major[1:] if leading else tensor.row_major
        return TensorSpec(tensor.name, tensor.dtype, tuple(d.client_size for d in dims))

    return ModelSignature(tuple(spec(t) for t in inputs), tuple(spec(t) for t in outputs),
                          max_batch_size if leading else 0)
