"""Triton's classification extension: an output returned as its top classes instead of its values.

A request asks for it per output with the ``classification`` parameter (what
tritonclient's ``InferRequestedOutput(name, class_count=k)`` sends). The output
then comes back as BYTES of shape ``[batch, k]`` (``[k]`` without a batch
axis): for each batch item, its ``k`` largest elements, in descending order,
each as ``"<value>:<index>"``, with the value printed as C++'s
``std::to_string`` prints it (``0.750000`` for floats, ``7`` for integers) and
the index counted in the item's flattened elements. Ties keep the lower index
first. nereid has no label files, so the ``:<label>`` suffix is never added.
"""

from __future__ import annotations

import numpy as np

from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.tensors import NamedTensor, bytes_array

# The request-output parameter, as Triton names it.
CLASSIFICATION_PARAMETER = "classification"

# The datatypes Triton classifies (no FP16, BF16, BOOL or BYTES).
CLASSIFIABLE: frozenset[DType] = frozenset({
    DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64,
    DType.INT8, DType.INT16, DType.INT32, DType.INT64,
    DType.FP32, DType.FP64,
})


def check_classifiable(model: str, output: str, dtype: DType) -> None:
    """InvalidArgument, before the model runs, for an output whose datatype cannot be classified."""
    if dtype not in CLASSIFIABLE:
        names = ", ".join(sorted(d.name for d in CLASSIFIABLE))
        raise InvalidArgument(f"model '{model}': output '{output}' is {dtype.name}; classification needs one "
                              f"of {names}")


def classify(tensor: NamedTensor, count: int, batched: bool) -> NamedTensor:
    """``tensor``'s top ``count`` classes per batch item (the whole tensor is one item when not ``batched``)."""
    data = np.asarray(tensor.data)
    items = data.reshape(data.shape[0], -1) if batched and data.ndim > 0 else data.reshape(1, -1)
    width = items.shape[1]
    kept = min(count, width)
    floating = data.dtype.kind == "f"
    if floating:
        # Descending values, the lower index first among equal ones, and NaN (no score at all) last: read
        # backwards, an ascending sort put NaN first, where Triton's order for it is undefined.
        missing = np.isnan(items)
        keys = (np.broadcast_to(np.arange(width), items.shape), -np.where(missing, 0, items), missing)
        order = np.lexsort(keys, axis=1)[:, :kept]
    else:
        # A stable ascending sort of the reversed items, read backwards: descending values, and among
        # equal values the lower original index first (negating would overflow unsigned integers).
        order = (width - 1) - np.argsort(items[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :kept]
    elements = []
    for item, indices in zip(items, order):
        for index in indices.tolist():
            value = item[index]
            text = f"{float(value):f}" if floating else str(int(value))
            elements.append(f"{text}:{index}".encode())
    shape = (len(items), kept) if batched and data.ndim > 0 else (kept,)
    return NamedTensor(tensor.name, DType.BYTES, bytes_array(elements, shape))
