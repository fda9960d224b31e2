"""From manifest tensors to the core's ModelSignature (row-major, leading batch axis).

The core only knows a *leading* batch axis. Manifest shapes usually list the
batch axis last, which is the leading axis once reversed, so the usual bundle
maps directly: ``max_batch_size`` is the largest served compiled size and
``dims`` the non-batch row-major dims. When every tensor has a batch axis but
some has it elsewhere (``"nchw"``), clients still see it leading (Triton's
convention for a batching model) and the backend moves it into place around
each execution, so such a bundle is coalesced and padded too. When some tensor
has no batch axis, the signature reports ``max_batch_size: 0`` with the full
row-major shape (the batch position as -1), and the backend requires the
request's batch to be exactly one of the compiled sizes.
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
    MOVED = "moved"      # every tensor batched, some elsewhere: leading on the wire, moved for the program
    EXACT = "exact"      # batching, but some tensor has no batch axis: the batch must be a compiled size

    @property
    def coalesces(self) -> bool:
        """True when requests are coalesced and padded along a (client-side leading) batch axis."""
        return self in (BatchMode.LEADING, BatchMode.MOVED)


def batch_mode(inputs: Sequence[ManifestTensor], outputs: Sequence[ManifestTensor], batched: bool) -> BatchMode:
    """The mode of a model's tensors (``batched``: the manifest lists compiled sizes). With no input batched, nothing
    in a request chooses a size: EXACT, its smallest serving (no inputs at all too, where LEADING coalesced and
    padded requests of none to a size whose rows came back as each one's; the XLA read hunt)."""
    if not batched:
        return BatchMode.NONE
    tensors = (*inputs, *outputs)
    if all(t.row_major_batch_axis is None for t in inputs):
        return BatchMode.EXACT
    if all(t.row_major_batch_axis == 0 for t in tensors):
        return BatchMode.LEADING
    if all(t.row_major_batch_axis is not None for t in tensors):
        return BatchMode.MOVED
    return BatchMode.EXACT


def build_signature(inputs: Sequence[ManifestTensor], outputs: Sequence[ManifestTensor], mode: BatchMode,
                    max_batch_size: int) -> ModelSignature:
    """The core signature of these tensors (``max_batch_size`` is used when the mode coalesces)."""
    leading = mode.coalesces

    def spec(tensor: ManifestTensor) -> TensorSpec:
        dims = client_dims(tensor) if leading else tensor.row_major
        return TensorSpec(tensor.name, tensor.dtype, tuple(d.client_size for d in dims))

    return ModelSignature(tuple(spec(t) for t in inputs), tuple(spec(t) for t in outputs),
                          max_batch_size if leading else 0)


def client_dims(tensor: ManifestTensor) -> tuple:
    """The row-major dims without the batch axis, wherever it stands (what follows the wire's leading axis)."""
    axis = tensor.row_major_batch_axis
    return tuple(d for i, d in enumerate(tensor.row_major) if i != axis)


def client_axis(program_axis: int, batch_axis: int) -> int:
    """Where a program (row-major) axis is on the wire, the batch axis having moved to the front."""
    return program_axis + 1 if program_axis < batch_axis else program_axis
