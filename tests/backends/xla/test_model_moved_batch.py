"""A bundle whose batch axis is not the leading row-major axis of every tensor (seed 000): coalesced and padded.

Clients see the batch axis leading (Triton's convention for a batching model);
the backend moves it to where the program has it and back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as triton

from nereid.backends.xla.manifest import load_manifest

W = np.arange(1, 5, dtype=np.float32)


@pytest.fixture
def moved(repo, serve, add_bundle):
    add_bundle(repo.models_dir, "moved_batch")
    return serve(repo.write_config("- name: moved_batch\n  batching: {max_queue_delay_ms: 50}\n"))


def _infer(client, x: np.ndarray):
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("moved_batch", [tensor])
    return result.as_numpy("y"), result.as_numpy("yt")


def test_the_manifest_puts_the_batch_axis_first_and_the_model_still_batches(moved, pristine) -> None:
    manifest = load_manifest(pristine("moved_batch") / "manifest.yaml")
    assert [t.row_major_batch_axis for t in manifest.executable_inputs] == [1]
    assert [t.row_major_batch_axis for t in manifest.executable_outputs] == [1, 0]
    config = moved.client.get_model_config("moved_batch").config
    assert config.max_batch_size == 4
    assert [list(i.dims) for i in config.input] == [[4]] and [list(o.dims) for o in config.output] == [[4], [4]]
    metadata = moved.client.get_model_metadata("moved_batch")
    assert [list(i.shape) for i in metadata.inputs] == [[-1, 4]]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_any_batch_up_to_the_largest_is_padded_and_moved(moved, rows) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
    y, yt = _infer(moved.client, x)
    np.testing.assert_array_equal(y, x * W)  # rows on the wire, the program's columns
    np.testing.assert_array_equal(yt, x * W)


def test_concurrent_requests_are_coalesced_along_the_moved_axis(moved) -> None:
    rng = np.random.default_rng(9)
    requests = [rng.standard_normal((int(rng.integers(1, 3)), 4)).astype(np.float32) for _ in range(12)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda x: _infer(moved.client, x), requests))
    for x, (y, yt) in zip(requests, results):
        np.testing.assert_array_equal(y, x * W)
        np.testing.assert_array_equal(yt, x * W)
    stats = moved.client.get_inference_statistics("moved_batch").model_stats[0]
    assert stats.execution_count < len(requests)  # some executions served several requests
