"""The example bundles shipped in ``ml-backends/``, and the command that regenerates them.

    python -m nereid.backends.xla.export.examples [ML_BACKENDS_DIR]     # default: ./ml-backends

* ``mlp_bundle``: a two-layer MLP, ``input`` FP32 [batch, 16] -> ``output`` FP32
  [batch, 4], compiled for batch sizes 1, 8 and 32 (any batch up to 32 is
  served, padded to the next compiled size).
* ``circle_select``: a variable-length result. The program takes 64 2-D points
  and returns a fixed-size buffer with the points inside a circle (radius: the
  bundle's one weight) moved to the front, plus their count; the bundle's
  model.py trims the buffer, so clients receive ``OUTPUT__0`` FP32 [-1, 2] with
  exactly the selected points.

The functions are importable so that tests compare the served outputs with
``jax.jit`` of the same function on the same inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from nereid.backends.xla.export.iospec import IOSpec
from nereid.backends.xla.export.jax_export import export_bundle
from nereid.backends.xla.export.provenance import collect_provenance

MLP_NAME = "mlp_bundle"
MLP_BATCH_SIZES = (1, 8, 32)
MLP_IN, MLP_HIDDEN, MLP_OUT = 16, 32, 4

CIRCLE_NAME = "circle_select"
CIRCLE_POINTS = 64
CIRCLE_RADIUS = 1.0

CIRCLE_MODEL_PY = '''\
"""circle_select's hooks: trim the program's fixed-size buffer to the points it found."""

import nereid
from nereid.tensors import NamedTensor


def trim(outputs):
    # outputs: DETECTIONS [64, 2] (selected points first, zero rows after) and NUM_DETECTIONS [1].
    by_name = {t.name: t.data for t in outputs}
    count = int(by_name["NUM_DETECTIONS"][0])
    return [NamedTensor.from_array("OUTPUT__0", by_name["DETECTIONS"][:count])]


nereid.register_model(postprocess=trim)
'''


def mlp(x: Any, w1: Any, b1: Any, w2: Any, b2: Any) -> Any:
    """relu(x @ w1 + b1) @ w2 + b2."""
    import jax

    return jax.nn.relu(x @ w1 + b1) @ w2 + b2


def mlp_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic MLP weights, in the order :func:`mlp` takes them."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((MLP_IN, MLP_HIDDEN)) / np.sqrt(MLP_IN)).astype(np.float32),
        "b1": (rng.standard_normal((MLP_HIDDEN,)) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((MLP_HIDDEN, MLP_OUT)) / np.sqrt(MLP_HIDDEN)).astype(np.float32),
        "b2": (rng.standard_normal((MLP_OUT,)) * 0.1).astype(np.float32),
    }


def circle_select(points: Any, radius: Any) -> tuple[Any, Any]:
    """The points inside the circle first (in input order, the rest zeroed), and how many there are."""
    import jax.numpy as jnp

    inside = jnp.sum(points * points, axis=1) <= radius * radius
    # A stable sort on "outside" moves the selected points to the front in input order:
    # a mask over a fixed-size buffer, since a program cannot return a data-dependent shape.
    order = jnp.argsort(jnp.logical_not(inside).astype(jnp.int32), stable=True)
    buffer = jnp.where(inside[order][:, None], points[order], jnp.zeros_like(points))
    count = jnp.sum(inside.astype(jnp.int64)).reshape(1)
    return buffer, count


def circle_weights() -> dict[str, np.ndarray]:
    """The circle's radius, the bundle's one weight."""
    return {"radius": np.array(CIRCLE_RADIUS, dtype=np.float32)}


def write_mlp(root: Path, provenance: Any = True) -> Path:
    """Export ``mlp_bundle`` under ``root``."""
    example = np.zeros((1, MLP_IN), dtype=np.float32)
    return export_bundle(mlp, [example], mlp_weights(), directory=Path(root) / MLP_NAME,
                         batch_sizes=MLP_BATCH_SIZES, input_names=["input"], output_names=["output"],
                         provenance=provenance, description="Two-layer MLP: FP32 [batch, 16] -> [batch, 4]")


def write_circle_select(root: Path, provenance: Any = True) -> Path:
    """Export ``circle_select`` (with its model.py) under ``root``."""
    example = np.zeros((CIRCLE_POINTS, 2), dtype=np.float32)
    return export_bundle(circle_select, [example], circle_weights(), directory=Path(root) / CIRCLE_NAME,
                         input_names=["points"], output_names=["DETECTIONS", "NUM_DETECTIONS"],
                         client_outputs=[IOSpec("OUTPUT__0", "f32", (-1, 2), letters="dc")],
                         model_py=CIRCLE_MODEL_PY, provenance=provenance, x64=True,
                         description="Points inside a circle: a fixed-size buffer + count, trimmed by model.py")


def write_examples(root: Path, provenance: Any = True) -> list[Path]:
    """Export every example bundle under ``root``."""
    return [write_mlp(root, provenance), write_circle_select(root, provenance)]


def main(argv: list[str] | None = None) -> int:
    """Regenerate the example bundles (``python -m nereid.backends.xla.export.examples``)."""
    parser = argparse.ArgumentParser(prog="python -m nereid.backends.xla.export.examples",
                                     description=(__doc__ or "").split("\n")[0])  # (python -OO: no __doc__)
    parser.add_argument("root", nargs="?", type=Path, default=Path("ml-backends"),
                        help="the model repository to write into (default: ./ml-backends)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder", file=sys.stderr)
        return 2
    # The examples live in the repository itself: record the commit and the dirty
    # flag, but no working_tree.patch. Their own folders are left out of the flag,
    # or regenerating them twice would call the second export dirty.
    provenance = collect_provenance(args.root, include_patch=False,
                                    exclude=[args.root / MLP_NAME, args.root / CIRCLE_NAME])
    for path in write_examples(args.root, provenance):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
