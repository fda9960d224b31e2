"""Reading a bundle's weights back, in program order and shape, whichever layout they use."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nereid.backends.xla.bundle import open_bundle
from nereid.backends.xla.migration import local_weight_set
from nereid.backends.xla.weights import read_local_weights


def read_bundle_weights(directory: Path | str) -> list[tuple[str, np.ndarray]]:
    """The weights of the bundle at ``directory`` as (name, array) in argument order (empty: none).

    One file or shards, whichever layout.
    """
    layout = open_bundle(Path(directory))
    weight_set = local_weight_set(layout)
    return read_local_weights(layout.folder, weight_set) if weight_set else []
