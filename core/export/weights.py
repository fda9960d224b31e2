"""Reading a bundle's weights back, in program order and shape, whichever layout they use."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nereid.backends.xla.bundle import open_bundle
from nereid.backends.xla.safetensors import load_weights


def read_bundle_weights(directory: Path | str) -> list[tuple[str, np.ndarray]]:
    """The weights of the bundle at ``directory`` as (name, array) in argument order (empty: none)."""
    layout = open_bundle(Path(directory))
    return load_weights(layout.weights_path) if layout.weights_path else []
