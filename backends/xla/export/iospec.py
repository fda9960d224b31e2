"""IOSpec: one tensor of a bundle as the exporter describes it (row-major, like the program)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nereid.backends.xla.dtype_tokens import dtype_of_token, token_of

from nereid.dtypes import DType

BATCH_LETTER = "n"
# Letters for non-batch axes, assigned in manifest (column-major) order; n and b
# are the reserved batch markers.
_AXIS_LETTERS = "acdefghijklmopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class IOSpec:
    """One tensor of a bundle, as the program sees it.

    ``shape`` is the row-major shape *without* the batch axis (as in nereid's
    signatures; -1 marks a variable axis). ``batch_axis`` is where the batch axis
    sits in the program's row-major shape (0, the leading axis, is the
    convention and maps to the manifest's last letter), or None for an
    unbatched tensor. ``letters`` optionally names the non-batch axes, one per
    entry of ``shape`` in the same order; ``n`` and ``b`` are reserved. The
    manifest stores the shape reversed (column-major, batch axis last).
    """

    name: str
    dtype: DType | str | Any
    shape: tuple[int, ...]
    batch_axis: int | None = None
    letters: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if not self.name:
            raise ValueError("IOSpec needs a name")
        for size in self.shape:
            if size == 0 or size < -1:
                raise ValueError(f"IOSpec '{self.name}': sizes must be positive or -1 (variable), got {self.shape}")
        if self.batch_axis is not None and not 0 <= self.batch_axis <= len(self.shape):
            raise ValueError(f"IOSpec '{self.name}': batch_axis {self.batch_axis} is outside 0..{len(self.shape)}")
        if self.letters is not None:
            if len(self.letters) != len(self.shape):
                raise ValueError(f"IOSpec '{self.name}': letters {self.letters!r} must name each of the "
                                 f"{len(self.shape)} non-batch axes")
            bad = [c for c in self.letters if c in "nb" or not (c.isascii() and c.isalpha())]
            if bad or len(set(self.letters)) != len(self.letters):
                raise ValueError(f"IOSpec '{self.name}': letters {self.letters!r} must be distinct ASCII letters "
                                 "other than the batch markers n and b")

    def program_shape(self, batch_size: int | None) -> tuple[int, ...]:
        """The row-major shape with the batch axis inserted at ``batch_size`` rows."""
        if self.batch_axis is None:
            return self.shape
        if batch_size is None:
            raise ValueError(f"IOSpec '{self.name}' is batched: give a batch size")
        return (*self.shape[:self.batch_axis], batch_size, *self.shape[self.batch_axis:])

    def manifest_entry(self) -> dict[str, Any]:
        """The manifest's entry for this tensor: column-major shape string and dims."""
        letters = list(self.letters) if self.letters is not None else None
        if letters is None:
            letters = [""] * len(self.shape)
            # Assign in manifest order so "the first letter" is the innermost axis, as in "chwn".
            for position, letter in zip(reversed(range(len(self.shape))), _AXIS_LETTERS):
                letters[position] = letter
        axes: list[tuple[str, int | None]] = list(zip(letters, self.shape))
        if self.batch_axis is not None:
            axes.insert(self.batch_axis, (BATCH_LETTER, None))
        manifest_axes = list(reversed(axes))
        return {
            "name": self.name,
            "dtype": token_of(self.dtype),
            "shape": "".join(letter for letter, _ in manifest_axes),
            "dims": {letter: size for letter, size in manifest_axes if size is not None},
        }


def as_dtype(value: Any) -> DType:
    """A DType from a DType, a manifest token (``"f32"``), a KServe string or a numpy dtype."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        for lookup in (dtype_of_token, DType.from_kserve):
            try:
                return lookup(value)
            except ValueError:
                continue
    try:
        return DType.of(np.empty(0, dtype=value))
    except (TypeError, ValueError):
        raise ValueError(f"not a datatype nereid knows: {value!r}") from None
