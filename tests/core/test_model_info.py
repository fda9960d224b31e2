"""What the data plane says about a model (``nereid.model_info``), before any protocol formats it: its metadata and its
Triton configuration, derived from real toy models loaded in-process (the wire forms: test_grpc_service.py and
test_http_service.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import toy_backends
from nereid.dtypes import DType
from nereid.model_info import MODEL_VERSION, TensorInfo, describe_config, describe_metadata
from nereid.plugins import make_plugin_manager
from nereid.repository import ModelRepository
from nereid.settings import load_settings
from toy_backends import write_toy

PAIR = ('input { name: "ids" data_type: "INT64" dims: [3] }\ninput { name: "text" data_type: "BYTES" dims: [-1] }\n'
        'output { name: "scores" data_type: "FP16" dims: [2, 2] }\nmax_batch_size: {max_batch_size}\n')


def described(tmp_path: Path, models: str) -> dict[str, tuple]:
    """Each toy model of ``models`` (nereid.yaml's models: list, the toys' folders written before) loaded, then
    released: name -> (its metadata, its configuration)."""
    (tmp_path / "nereid.yaml").write_text(f'server:\n  ml_backends_path: "ml-backends"\nmodels:\n{models}')
    settings = load_settings(tmp_path / "nereid.yaml")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(sys.modules[toy_backends.__name__],))
    (tmp_path / "scratch").mkdir()
    repository = ModelRepository(settings, manager, tmp_path / "scratch")

    async def load_all() -> dict[str, tuple]:
        try:
            answers = {}
            for model in settings.models:
                entry = await repository.load(model.name)
                assert entry.loaded is not None, entry.reason
                answers[model.name] = (describe_metadata(model.name, entry.loaded),
                                       describe_config(model.name, entry.loaded, entry.settings))
            return answers
        finally:
            await repository.unload_all()
    return asyncio.run(load_all())


def test_metadata_gives_each_tensor_with_a_leading_batch_axis_when_the_model_batches(tmp_path: Path) -> None:
    write_toy(tmp_path / "ml-backends", "batched", PAIR.replace("{max_batch_size}", "4"))
    write_toy(tmp_path / "ml-backends", "single", PAIR.replace("{max_batch_size}", "0"))
    answers = described(tmp_path, "  - name: batched\n  - name: single\n")
    batched, single = answers["batched"][0], answers["single"][0]
    assert (batched.name, batched.versions, batched.platform) == ("batched", (MODEL_VERSION,), "toy_platform")
    assert batched.inputs == (TensorInfo("ids", "INT64", (-1, 3)), TensorInfo("text", "BYTES", (-1, -1)))
    assert batched.outputs == (TensorInfo("scores", "FP16", (-1, 2, 2)),)
    assert single.inputs == (TensorInfo("ids", "INT64", (3,)), TensorInfo("text", "BYTES", (-1,)))
    assert single.outputs == (TensorInfo("scores", "FP16", (2, 2)),)


def test_the_configuration_says_what_the_scheduler_really_does(tmp_path: Path) -> None:
    for name in ("tuned", "unbatched", "plain", "on_gpu"):
        write_toy(tmp_path / "ml-backends", name, PAIR.replace("{max_batch_size}", "8"))
    write_toy(tmp_path / "ml-backends", "single", PAIR.replace("{max_batch_size}", "0"))
    answers = described(tmp_path, "  - name: tuned\n    instances: 3\n    batching:\n      max_queue_delay_ms: 1.001\n"
                                  "      preferred_batch_sizes: [4, 2]\n"
                                  "  - name: unbatched\n    batching:\n      enabled: false\n"
                                  "  - name: plain\n  - name: single\n  - name: on_gpu\n    device: cuda:1\n")
    tuned = answers["tuned"][1]
    assert (tuned.name, tuned.platform, tuned.backend, tuned.max_batch_size) == ("tuned", "toy_platform", "toy", 8)
    assert tuned.inputs == (TensorInfo("ids", "INT64", (3,)), TensorInfo("text", "BYTES", (-1,)))  # (no batch axis)
    assert tuned.outputs == (TensorInfo("scores", "FP16", (2, 2)),)
    # Rounded, not cut: 1.001 ms is 1001 us (a Triton config's 1001 came back as 1000).
    assert (tuned.dynamic_batching.max_queue_delay_us, tuned.dynamic_batching.preferred_batch_sizes) == (1001, (2, 4))
    assert (tuned.instance_group.count, tuned.instance_group.kind, tuned.instance_group.gpus) == (3, "KIND_CPU", ())
    plain = answers["plain"][1]
    assert (plain.dynamic_batching.max_queue_delay_us, plain.dynamic_batching.preferred_batch_sizes) == (0, ())
    assert plain.instance_group.count == 1
    # (Only said: a toy runs nothing on the device, and declares nothing, so it counts as using the one assigned.)
    assert answers["on_gpu"][1].instance_group.kind == "KIND_GPU" and answers["on_gpu"][1].instance_group.gpus == (1,)
    # Off, or a model that takes no batch axis: no dynamic_batching, whatever the rest says.
    assert answers["unbatched"][1].dynamic_batching is None and answers["unbatched"][1].max_batch_size == 8
    assert answers["single"][1].dynamic_batching is None and answers["single"][1].max_batch_size == 0


@pytest.mark.parametrize("dtype", [dtype for dtype in DType if dtype.on_wire], ids=lambda dtype: dtype.kserve)
def test_a_configuration_type_is_triton_s_name_of_the_wire_datatype(dtype: DType) -> None:
    expected = "TYPE_STRING" if dtype.kserve == "BYTES" else f"TYPE_{dtype.kserve}"
    assert TensorInfo("t", dtype.kserve, (1,)).config_type == expected
