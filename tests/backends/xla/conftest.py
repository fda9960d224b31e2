"""Small real bundles: the shipped examples, and others exported once per session with nereid's exporter.

Each builder writes a pristine bundle; tests copy it into their own model
repository (``add_bundle``) so that ``.cache/`` and edits never leak between
tests.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from nereid.backends.xla.export import IOSpec, examples, export_bundle, write_bundle

EXACT_SIZES = (2, 4)
VARIANT_LENGTHS = (4, 8)
VARIANT_SIZES = (1, 2)


def scale_rows(x, w):
    """Each row times w, and the per-column sum over the whole batch (an output without a batch axis)."""
    return x * w, (x * w).sum(axis=0)


def columns(x, w):
    """x is [4, batch] (its batch axis last, row-major): scaled per row, and the same transposed."""
    y = x * w[:, None]
    return y, y.T


def embed(ids, table):
    """Rows of a bf16 table picked by int64 ids, as float32."""
    return table[ids].astype("float32")


def scale(x, w):
    """x times a scalar weight (variable-length rows)."""
    return x * w


def _export_variants(directory: Path) -> Path:
    import jax
    from jax import export as jax_export

    w = np.array(3.0, dtype=np.float32)
    modules = []
    for length in VARIANT_LENGTHS:
        per_size = {}
        for size in VARIANT_SIZES:
            exported = jax_export.export(jax.jit(scale, keep_unused=True), platforms=["cpu"])(
                jax.ShapeDtypeStruct((size, length), np.float32), jax.ShapeDtypeStruct((), np.float32))
            per_size[size] = exported.mlir_module_serialized
        modules.append(per_size)
    return write_bundle(directory, directory.name, [IOSpec("x", "f32", (-1,), batch_axis=0)],
                        [IOSpec("y", "f32", (-1,), batch_axis=0)], modules, {"w": w},
                        input_shapes=[[length] for length in VARIANT_LENGTHS])


HOOKS_MODEL_PY = '''
import numpy as np
import nereid
from nereid.tensors import NamedTensor


def to_unit(inputs):
    (pixels,) = inputs
    return [NamedTensor.from_array("input", pixels.data.astype(np.float32) / 255.0)]


def to_class(outputs):
    (logits,) = outputs
    return [NamedTensor.from_array("class", np.argmax(logits.data, axis=1).astype(np.int64)),
            NamedTensor.from_array("logits", logits.data)]


nereid.register_model("ignored-name", preprocess=to_unit, postprocess=to_class)
'''

SHIPPED = Path(__file__).resolve().parents[3] / "ml-backends"


# A postprocess that adds an output without a batch axis (the program's rows, counted), to a batching program.
ROWS_MODEL_PY = '''
import numpy as np
import nereid
from nereid.tensors import NamedTensor


def with_rows(outputs):
    (y,) = outputs
    return [y, NamedTensor.from_array("rows", np.array([y.data.shape[0]], np.int32))]


nereid.register_model(postprocess=with_rows)
'''


def _shipped(directory: Path) -> Path:
    """The example bundle exactly as ml-backends/ ships it (its .cache/ left behind)."""
    shutil.copytree(SHIPPED / directory.name, directory, ignore=shutil.ignore_patterns(".cache"))
    return directory


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "mlp_bundle": _shipped,
    "circle_select": _shipped,
    "mlp_legacy": lambda d: export_bundle(examples.mlp, [np.zeros((1, 16), np.float32)], examples.mlp_weights(),
                                          directory=d, batch_sizes=(1, 8, 32), input_names=["input"],
                                          output_names=["output"], layout="legacy", provenance=False),
    "exact_batch": lambda d: export_bundle(scale_rows, [np.zeros((2, 4), np.float32)],
                                           {"w": np.arange(4, dtype=np.float32)}, directory=d,
                                           batch_sizes=EXACT_SIZES, input_names=["x"], output_names=["y", "total"],
                                           output_batch_axes=[0, None], provenance=False),
    "embedding": lambda d: export_bundle(embed, [np.zeros((1, 3), np.int64)],
                                         {"table": (np.arange(40).reshape(10, 4) / 8).astype("bfloat16")},
                                         directory=d, batch_sizes=(1, 4), input_names=["ids"],
                                         output_names=["vectors"], provenance=False),
    "variants": _export_variants,
    # Every tensor batched, the input's and one output's batch axis not leading (manifest "nc" -> "cn").
    "moved_batch": lambda d: export_bundle(columns, [np.zeros((4, 2), np.float32)],
                                           {"w": np.arange(1, 5, dtype=np.float32)}, directory=d,
                                           batch_sizes=(2, 4), input_names=["x"], output_names=["y", "yt"],
                                           input_batch_axes=[1], output_batch_axes=[1, 0], provenance=False),
    # The MLP's 4 weights (2048, 128, 512, 16 bytes) in 3 shards: w1 | b1 w2 | b2.
    "mlp_sharded": lambda d: export_bundle(examples.mlp, [np.zeros((1, 16), np.float32)], examples.mlp_weights(),
                                           directory=d, batch_sizes=(1, 8), input_names=["input"],
                                           output_names=["output"], provenance=False, shard_bytes=600),
    "rows_hooks": lambda d: export_bundle(scale, [np.zeros((1, 4), np.float32)],
                                          {"w": np.arange(1, 5, dtype=np.float32)}, directory=d,
                                          batch_sizes=(1, 2, 4), input_names=["x"], output_names=["y"],
                                          client_outputs=[IOSpec("y", "f32", (4,), batch_axis=0),
                                                          IOSpec("rows", "i32", (1,), batch_axis=None)],
                                          model_py=ROWS_MODEL_PY, provenance=False),
    "mlp_hooks": lambda d: export_bundle(examples.mlp, [np.zeros((1, 16), np.float32)], examples.mlp_weights(),
                                         directory=d, batch_sizes=(1, 8), input_names=["input"],
                                         output_names=["logits"],
                                         client_inputs=[IOSpec("pixels", "u8", (16,), batch_axis=0)],
                                         client_outputs=[IOSpec("class", "i64", (), batch_axis=0),
                                                         IOSpec("logits", "f32", (4,), batch_axis=0)],
                                         model_py=HOOKS_MODEL_PY, provenance=False),
}


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Callable[[str], Path]:
    """``pristine(name)``: the session's copy of a test bundle, built on first use. Do not modify it."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            root = tmp_path_factory.mktemp(f"bundle-{name}")
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get


@pytest.fixture
def add_bundle(pristine) -> Callable[..., Path]:
    """``add_bundle(folder_parent, name, as_name=None)``: copy a test bundle into a model repository."""

    def add(parent: Path, name: str, as_name: str | None = None) -> Path:
        target = Path(parent) / (as_name or name)
        shutil.copytree(pristine(name), target)
        return target

    return add


@pytest.fixture
def legacy(tmp_path, add_bundle) -> Path:
    """A legacy-layout MLP bundle (weights column-major) whose manifest has hand-written notes a migration keeps."""
    folder = add_bundle(tmp_path, "mlp_legacy")
    manifest = folder / "manifest.yaml"
    manifest.write_text("# hand-written note: keep me\n" + manifest.read_text() + "# trailing note\n")
    return folder


@pytest.fixture
def sharded(pristine, tmp_path) -> Path:
    """A copy of the MLP bundle whose weights are in 3 shards and an index (``mlp_sharded``)."""
    return shutil.copytree(pristine("mlp_sharded"), tmp_path / "mlp_sharded")
