"""Bundles served over real gRPC: outputs equal jax.jit of the same function on the same inputs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.backends.xla.export import examples

# Same function, same inputs, but a padded batch may take another XLA kernel
# path than jax.jit at the request's own size: compare to float rounding.
RTOL, ATOL = 1e-6, 1e-6


def infer(client, model: str, name: str, array: np.ndarray, datatype: str, outputs: list[str] | None = None):
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    requested = [triton.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, [tensor], outputs=requested)


def index_of(client) -> dict:
    return {m.name: m for m in client.get_model_repository_index().models}


def mlp_reference(x: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(examples.mlp)(x, *examples.mlp_weights().values()))


@pytest.fixture
def mlp_server(repo, serve, add_bundle):
    add_bundle(repo.models_dir, "mlp_bundle")
    return serve(repo.write_config("- name: mlp_bundle\n"))


@pytest.mark.parametrize("rows", [1, 3, 8, 20, 32])
def test_mlp_serves_any_batch_up_to_the_largest_compiled_size(mlp_server, rows) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
    served = infer(mlp_server.client, "mlp_bundle", "input", x, "FP32").as_numpy("output")
    assert served.shape == (rows, 4) and served.dtype == np.float32
    np.testing.assert_allclose(served, mlp_reference(x), rtol=RTOL, atol=ATOL)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(mlp_server) -> None:
    rng = np.random.default_rng(42)
    requests = [rng.standard_normal((int(rng.integers(1, 9)), 16)).astype(np.float32) for _ in range(24)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        served = list(pool.map(
            lambda x: infer(mlp_server.client, "mlp_bundle", "input", x, "FP32").as_numpy("output"), requests))
    for x, y in zip(requests, served):
        np.testing.assert_allclose(y, mlp_reference(x), rtol=RTOL, atol=ATOL)


def test_mlp_metadata_config_and_limits(mlp_server) -> None:
    client = mlp_server.client
    metadata = client.get_model_metadata("mlp_bundle")
    assert metadata.platform == "nereid_xla"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("input", "FP32", [-1, 16])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("output", "FP32", [-1, 4])]
    config = client.get_model_config("mlp_bundle").config
    assert config.backend == "xla" and config.max_batch_size == 32 and list(config.input[0].dims) == [16]
    single = np.ones(16, np.float32)  # no batch axis: served as batch 1, answered without one
    served = infer(client, "mlp_bundle", "input", single, "FP32").as_numpy("output")
    np.testing.assert_allclose(served, mlp_reference(single[None])[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "mlp_bundle", "input", np.zeros((33, 16), np.float32), "FP32")
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "32" in caught.value.message()


def test_both_weight_layouts_serve_the_same_outputs(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "mlp_bundle")
    add_bundle(repo.models_dir, "mlp_legacy")
    server = serve(repo.write_config("- name: mlp_bundle\n- name: mlp_legacy\n"))
    x = np.random.default_rng(7).standard_normal((5, 16)).astype(np.float32)
    xla = infer(server.client, "mlp_bundle", "input", x, "FP32").as_numpy("output")
    legacy = infer(server.client, "mlp_legacy", "input", x, "FP32").as_numpy("output")
    np.testing.assert_array_equal(xla, legacy)


def test_largest_batch_size_only(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "mlp_bundle")
    server = serve(repo.write_config("- name: mlp_bundle\n  runtime: {batch_sizes: largest}\n"))
    backend = server.server.repository.ready_model("mlp_bundle").backend
    assert backend.report.programs == ("model.b32.mlir",)
    assert server.client.get_model_config("mlp_bundle").config.max_batch_size == 32
    x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
    served = infer(server.client, "mlp_bundle", "input", x, "FP32").as_numpy("output")
    np.testing.assert_allclose(served, mlp_reference(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scale, offset, found", [(0.5, 0.0, "all"), (2.0, 0.0, "some"), (0.1, 5.0, "none")])
def test_variable_length_result_is_trimmed_by_model_py(repo, serve, add_bundle, scale, offset, found) -> None:
    add_bundle(repo.models_dir, "circle_select")
    server = serve(repo.write_config("- name: circle_select\n"))
    rng = np.random.default_rng(11)
    points = (rng.uniform(-1, 1, (examples.CIRCLE_POINTS, 2)) * scale + offset).astype(np.float32)
    served = infer(server.client, "circle_select", "points", points, "FP32").as_numpy("OUTPUT__0")
    with jax.enable_x64(True):
        buffer, count = jax.jit(examples.circle_select)(points, examples.circle_weights()["radius"])
    expected = np.asarray(buffer)[:int(count[0])]
    np.testing.assert_array_equal(served, expected)
    inside = points[(points ** 2).sum(axis=1) <= examples.CIRCLE_RADIUS ** 2]
    np.testing.assert_array_equal(served, inside)  # and it is what the example promises
    assert {"all": len(points), "none": 0}.get(found, len(inside)) == len(served) and (
        found != "some" or 0 < len(served) < len(points))
    metadata = server.client.get_model_metadata("circle_select")
    assert [(t.name, list(t.shape)) for t in metadata.inputs] == [("points", [64, 2])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("OUTPUT__0", "FP32", [-1, 2])]


def test_model_py_hooks_transform_client_tensors(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "mlp_hooks")
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    metadata = server.client.get_model_metadata("mlp_hooks")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("pixels", "UINT8", [-1, 16])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("class", "INT64", [-1]), ("logits", "FP32", [-1, 4])]
    pixels = np.random.default_rng(5).integers(0, 256, (6, 16), dtype=np.uint8)
    result = infer(server.client, "mlp_hooks", "pixels", pixels, "UINT8")
    expected = mlp_reference(pixels.astype(np.float32) / 255.0)
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(result.as_numpy("class"), np.argmax(expected, axis=1))


def test_postprocess_outputs_are_matched_by_name_in_any_order(repo, serve, add_bundle) -> None:
    """Outputs in another order than client_outputs failed every request INTERNAL ("returned outputs ['logits',
    'class'], expected ['class', 'logits']"), where a preprocess result is matched by name."""
    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    text = (bundle / "model.py").read_text()
    (bundle / "model.py").write_text(text.replace("    return [NamedTensor.from_array(\"class\"",
                                                  "    return [*reversed([NamedTensor.from_array(\"class\"", 1)
                                     .replace("NamedTensor.from_array(\"logits\", logits.data)]",
                                              "NamedTensor.from_array(\"logits\", logits.data)])]", 1))
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    pixels = np.random.default_rng(6).integers(0, 256, (3, 16), dtype=np.uint8)
    result = infer(server.client, "mlp_hooks", "pixels", pixels, "UINT8")
    expected = mlp_reference(pixels.astype(np.float32) / 255.0)
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(result.as_numpy("class"), np.argmax(expected, axis=1))
    assert [o["name"] for o in result.get_response(as_json=True)["outputs"]] == ["class", "logits"]


def test_a_preprocess_result_that_misfits_is_internal_and_a_hook_refusal_names_the_model(repo, serve,
                                                                                         add_bundle) -> None:
    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    text = (bundle / "model.py").read_text()
    (bundle / "model.py").write_text(text.replace("    (pixels,) = inputs\n", '''    (pixels,) = inputs
    if pixels.data[0, 0] == 1:
        raise nereid.errors.InvalidArgument("pixels[0, 0] = 1 is not allowed")
    if pixels.data[0, 0] == 2:
        return [NamedTensor.from_array("input", pixels.data.astype(np.float64))]
''', 1))
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    pixels = np.zeros((1, 16), np.uint8)
    for first, status, message in [
        (1, "INVALID_ARGUMENT", "model 'mlp_hooks': pixels[0, 0] = 1 is not allowed"),
        # The client's valid request is not blamed for what the hook made of it.
        (2, "INTERNAL", "model 'mlp_hooks': the preprocess hook returned tensors the program cannot take: "
                        "input 'input' has datatype FP64, expected FP32")]:
        pixels[0, 0] = first
        with pytest.raises(InferenceServerException) as caught:
            infer(server.client, "mlp_hooks", "pixels", pixels, "UINT8")
        assert (caught.value.status(), caught.value.message()) == (f"StatusCode.{status}", message)
    pixels[0, 0] = 0
    assert infer(server.client, "mlp_hooks", "pixels", pixels, "UINT8").as_numpy("class").shape == (1,)



def test_model_py_hook_time_is_the_request_s_compute_input_and_output_time(repo, serve, add_bundle) -> None:
    """Found by the accounting hunt: a bundle's model.py hook time was in no ModelStatistics stage, so with 50 ms
    of sleep in each hook perf_analyzer called 99% of a request's time the server's overhead. A request's
    preprocess hook is its compute input, its postprocess hook its compute output (Triton's preparing and
    extracting of the model's tensors); batch_stats and nereid_compute_duration_seconds stay the executions'."""
    pre_ns, post_ns, requests = 200_000_000, 300_000_000, 3
    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    text = (bundle / "model.py").read_text()
    (bundle / "model.py").write_text(
        text.replace("import numpy as np\n", "import time\nimport numpy as np\n", 1)
        .replace("    (pixels,) = inputs\n", f"    time.sleep({pre_ns / 1e9})\n    (pixels,) = inputs\n", 1)
        .replace("    (logits,) = outputs\n", f"    time.sleep({post_ns / 1e9})\n    (logits,) = outputs\n"
                 "    if len(logits.data) == 2:\n        raise ValueError('two rows')\n", 1))
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    for _ in range(requests):
        infer(server.client, "mlp_hooks", "pixels", np.zeros((1, 16), np.uint8), "UINT8")
    with pytest.raises(InferenceServerException, match="postprocess hook failed: ValueError: two rows"):
        infer(server.client, "mlp_hooks", "pixels", np.zeros((2, 16), np.uint8), "UINT8")
    stats = server.client.get_inference_statistics("mlp_hooks").model_stats[0]
    inference = stats.inference_stats
    # The request whose postprocess failed after its execution ran counts as a failure alone, as before.
    assert (inference.success.count, inference.fail.count) == (requests, 1)
    assert inference.queue.count == inference.compute_input.count == inference.compute_output.count == requests
    assert inference.compute_input.ns >= requests * pre_ns  # (each was the execution's own: microseconds)
    assert inference.compute_output.ns >= requests * post_ns
    assert inference.queue.ns < requests * pre_ns  # (one at a time: none waited, for the queue or a hook thread)
    accounted_ns = sum(getattr(inference, part).ns for part in ("queue", "compute_input", "compute_infer",
                                                                 "compute_output"))
    assert inference.success.ns - accounted_ns < requests * pre_ns  # (each request's two sleeps, without them)
    # Per execution, as hooks run per request: the executions' own times (batch assembly, split).
    assert sum(size.compute_input.ns + size.compute_output.ns for size in stats.batch_stats) < pre_ns
    figures = server.server.repository.ready_model("mlp_hooks").stats
    assert figures.compute_seconds.sum < pre_ns / 1e9
    assert figures.queue_seconds.sum == pytest.approx(inference.queue.ns / 1e9, abs=1e-6)  # the same figure

def test_batch_must_be_a_compiled_size_when_a_tensor_has_no_batch_axis(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "exact_batch")
    server = serve(repo.write_config("- name: exact_batch\n"))
    config = server.client.get_model_config("exact_batch").config
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [-1, 4]
    w = np.arange(4, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    result = infer(server.client, "exact_batch", "x", x, "FP32")
    np.testing.assert_allclose(result.as_numpy("y"), x * w, rtol=RTOL)
    np.testing.assert_allclose(result.as_numpy("total"), (x * w).sum(axis=0), rtol=RTOL, atol=ATOL)
    with pytest.raises(InferenceServerException) as caught:
        infer(server.client, "exact_batch", "x", np.zeros((3, 4), np.float32), "FP32")
    message = caught.value.message()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    for part in ("exact_batch", "'x'", "batch size 3", "[2, 4]"):
        assert part in message


def test_input_shape_variants(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "variants")
    server = serve(repo.write_config("- name: variants\n"))
    assert list(server.client.get_model_metadata("variants").inputs[0].shape) == [-1, -1]
    for rows, length in ((1, 4), (2, 8), (1, 8)):
        x = np.random.default_rng(length).standard_normal((rows, length)).astype(np.float32)
        np.testing.assert_array_equal(infer(server.client, "variants", "x", x, "FP32").as_numpy("y"), x * 3)
    with pytest.raises(InferenceServerException) as caught:
        infer(server.client, "variants", "x", np.zeros((1, 5), np.float32), "FP32")
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'x' has shape [1, 5]; the bundle is compiled for [-1, 4], [-1, 8]" in caught.value.message()


def test_a_postprocess_adding_an_unbatched_output_leaves_each_request_its_rows_batched_or_not(repo, serve,
                                                                                             add_bundle) -> None:
    """Found by the bundle hunt: model.py's output without a batch axis made the client's tensors batch no more
    (max_batch_size 0), while the program batched: every request counted as one row, so one of 2 rows failed
    ("returned output 'y' with shape [2, 4], expected [1, 4]"), and, batched with others, failed them all
    (ValueError: Output array is the wrong shape)."""
    add_bundle(repo.models_dir, "rows_hooks")
    server = serve(repo.write_config("- name: rows_hooks\n  batching: {max_queue_delay_ms: 200}\n"))

    def infer(rows: int) -> tuple[list, list]:
        tensor = triton.InferInput("x", [rows, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((rows, 4), np.float32))
        result = server.client.infer("rows_hooks", [tensor])
        return result.as_numpy("y").tolist(), result.as_numpy("rows").tolist()

    assert infer(2) == ([[1.0, 2.0, 3.0, 4.0]] * 2, [2])
    with ThreadPoolExecutor(4) as pool:  # batched together within the window: 1 + 1 + 2 rows
        answers = list(pool.map(infer, [1, 1, 2]))
    assert [y for y, _ in answers] == [[[1.0, 2.0, 3.0, 4.0]] * rows for rows in (1, 1, 2)]
    stats = server.client.get_inference_statistics("rows_hooks").model_stats[0].inference_stats
    assert (stats.success.count, stats.fail.count) == (4, 0)


def test_int64_inputs_and_bf16_weights(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "embedding")
    server = serve(repo.write_config("- name: embedding\n"))
    ids = np.array([[0, 9, 3], [2, 2, 7]], dtype=np.int64)
    served = infer(server.client, "embedding", "ids", ids, "INT64").as_numpy("vectors")
    table = (np.arange(40).reshape(10, 4) / 8).astype("bfloat16")
    with jax.enable_x64(True):
        expected = np.asarray(jax.jit(embed_reference)(ids, table))
    np.testing.assert_array_equal(served, expected)


def embed_reference(ids, table):
    return table[ids].astype("float32")


POSTPROCESS_ONLY_MODEL_PY = '''
import nereid
from nereid.tensors import NamedTensor


def doubled(outputs):
    (y,) = outputs
    return [NamedTensor.from_array("y", y.data * 2)]


nereid.register_model(postprocess=doubled)
'''


def test_a_bundle_whose_model_py_registers_only_postprocess_refuses_a_client_s_shape_as_the_client_s(
        repo, serve, add_bundle) -> None:
    """Found by the export hunt: with a model.py registering only postprocess, the omitted preprocess (the identity)
    was still a hook step, and its result went through the check of a hook's result: a length no variant was
    compiled for was INTERNAL, "the preprocess hook returned tensors the program cannot take", where the same bundle
    without model.py answers INVALID_ARGUMENT naming the compiled shapes."""
    bundle = add_bundle(repo.models_dir, "variants")
    (bundle / "model.py").write_text(POSTPROCESS_ONLY_MODEL_PY)
    server = serve(repo.write_config("- name: variants\n"))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(infer(server.client, "variants", "x", x, "FP32").as_numpy("y"), x * 3 * 2)
    with pytest.raises(InferenceServerException) as refused:
        infer(server.client, "variants", "x", np.ones((1, 5), np.float32), "FP32")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
    assert "model 'variants': input 'x' has shape [1, 5]; the bundle is compiled for" in refused.value.message()
    assert "hook" not in refused.value.message()


def _difference(a, b):
    return a - b


def test_client_inputs_listed_in_another_order_reach_the_program_by_name_without_a_preprocess_hook(
        repo, serve, tmp_path) -> None:
    """Found by the review hunt of 51cacdf: with no preprocess step, a bundle whose client_inputs list the
    executable's inputs in another order (allowed: "in any order") had them sent to the program by position,
    swapped: a - b served as b - a, OK."""
    from nereid.backends.xla.export import IOSpec, export_bundle

    for name, model_py in (("post_only", POSTPROCESS_ONLY_MODEL_PY.replace('"y"', '"d"')),
                           ("no_hooks", "import nereid\nnereid.register_model()\n")):
        export_bundle(_difference, [np.zeros((1, 2), np.float32)] * 2, {}, directory=repo.models_dir / name,
                      batch_sizes=[1, 4], input_names=["a", "b"], output_names=["d"],
                      client_inputs=[IOSpec("b", "f32", (2,), batch_axis=0), IOSpec("a", "f32", (2,), batch_axis=0)],
                      client_outputs=[IOSpec("d", "f32", (2,), batch_axis=0)], model_py=model_py,
                      provenance=False)
    server = serve(repo.write_config("- name: post_only\n- name: no_hooks\n"))
    a, b = np.array([[1.0, 2.0]], np.float32), np.array([[100.0, 200.0]], np.float32)
    for name, factor in (("post_only", 2), ("no_hooks", 1)):
        inputs = []
        for input_name, array in (("a", a), ("b", b)):
            tensor = triton.InferInput(input_name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        served = server.client.infer(name, inputs).as_numpy("d")
        np.testing.assert_array_equal(served, (a - b) * factor)


GENERATOR_MODEL_PY = '''
import numpy as np
import nereid
from nereid.tensors import NamedTensor

def make(inputs):
    if list(inputs):
        raise ValueError(f"no client input expected, got {inputs}")
    return [NamedTensor.from_array("x", np.arange(4, dtype=np.float32)[None, :])]

nereid.register_model(preprocess=make)
'''


def test_a_bundle_whose_preprocess_makes_every_program_input_takes_no_client_input(repo, serve) -> None:
    """Noticed by the stop 56 bundle hunt as untested end to end: client_inputs: [] with a preprocess hook that
    makes the program's input (a generator). Served over gRPC and HTTP, counted as any request."""
    import tritonclient.http as triton_http

    from nereid.backends.xla.export import export_bundle

    folder = export_bundle(lambda x: x * 2, [np.zeros((1, 4), np.float32)], {}, directory=repo.models_dir / "gen",
                           input_names=["x"], output_names=["y"], provenance=False)
    (folder / "manifest.yaml").write_text((folder / "manifest.yaml").read_text() + "client_inputs: []\n")
    (folder / "model.py").write_text(GENERATOR_MODEL_PY)
    server = serve(repo.write_config("- name: gen\n"))
    assert list(server.client.get_model_metadata("gen").inputs) == []
    np.testing.assert_array_equal(server.client.infer("gen", []).as_numpy("y"), [[0, 2, 4, 6]])
    http = triton_http.InferenceServerClient(f"127.0.0.1:{server.server.http_port}")
    np.testing.assert_array_equal(http.infer("gen", []).as_numpy("y"), [[0, 2, 4, 6]])
    assert server.client.get_inference_statistics("gen").model_stats[0].inference_stats.success.count == 2
