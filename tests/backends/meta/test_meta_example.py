"""The shipped meta model, circle_score, end to end: circle_select, then mlp_bundle, over real gRPC."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

from support import ModelRepo

SHIPPED = Path(__file__).resolve().parents[3] / "ml-backends"


def add_shipped(repo: ModelRepo, *names: str) -> None:
    """Copy shipped example folders into the test repository (their .cache/ left behind)."""
    for name in names:
        shutil.copytree(SHIPPED / name, repo.models_dir / name, ignore=shutil.ignore_patterns(".cache"))


def infer(client: triton.InferenceServerClient, model: str, name: str, array: np.ndarray,
          **kwargs) -> triton.InferResult:
    tensor = triton.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor], **kwargs)


def features(points: np.ndarray) -> np.ndarray:
    """The example's features, written out again: the test does not import the model's code."""
    scaled = np.concatenate([points * k for k in (1, 2, 3, 4)], axis=1)
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def statistics(client: triton.InferenceServerClient, model: str):
    return client.get_inference_statistics(model, as_json=False).model_stats[0]


def test_circle_score_end_to_end(repo, serve) -> None:
    add_shipped(repo, "circle_select", "mlp_bundle", "circle_score")
    server = serve(repo.write_config("""
        - {name: circle_select}
        - {name: mlp_bundle}
        - {name: circle_score, queue_capacity: 16}
    """))
    client = server.client
    rng = np.random.default_rng(7)

    # 50 points inside the circle: more than the MLP's 32 rows, so the meta model makes two MLP calls.
    for inside in (50, 5):
        points = np.zeros((64, 2), np.float32)
        points[:inside] = rng.uniform(-0.3, 0.3, (inside, 2))
        points[inside:] = 5.0  # far outside
        result = infer(client, "circle_score", "points", points)
        selected = infer(client, "circle_select", "points", points).as_numpy("OUTPUT__0")
        np.testing.assert_array_equal(result.as_numpy("selected"), selected)
        assert selected.shape == (inside, 2)
        expected = np.concatenate([infer(client, "mlp_bundle", "input", features(selected[i:i + 32])).as_numpy("output")
                                   for i in range(0, inside, 32)])
        np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-5, atol=1e-6)

    # Nothing inside: the second model is not called at all (its statistics do not move).
    before = statistics(client, "mlp_bundle").inference_count
    result = infer(client, "circle_score", "points", np.full((64, 2), 5.0, np.float32))
    assert result.as_numpy("selected").shape == (0, 2) and result.as_numpy("scores").shape == (0, 4)
    assert statistics(client, "mlp_bundle").inference_count == before
    assert statistics(client, "circle_score").inference_count == 3

    # Shown like any other model: metadata, config, index, metrics.
    metadata = client.get_model_metadata("circle_score", as_json=True)
    assert metadata["platform"] == "nereid_meta"
    assert [(t["name"], t["shape"]) for t in metadata["outputs"]] == [("selected", ["-1", "2"]),
                                                                      ("scores", ["-1", "4"])]
    config = client.get_model_config("circle_score", as_json=True)["config"]
    assert config["platform"] == "nereid_meta" and config["backend"] == "meta"
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["circle_score"]["state"] == "READY"
    port = server.server.metrics_port
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'model="circle_score"' in metrics


def test_circle_score_s_sub_calls_wait_for_room_after_its_hooked_sub_call(repo, serve) -> None:
    """Found by the review hunt of 2c73ad2: circle_score calls circle_select (a bundle with a postprocess hook),
    whose hook marked the orchestration's own task as one whose model code had run, so its later sub-calls to a
    full mlp_bundle queue were refused at once (2,244 of 3,843 requests UNAVAILABLE), where they wait for room."""
    from concurrent.futures import ThreadPoolExecutor

    add_shipped(repo, "circle_select", "mlp_bundle", "circle_score")
    server = serve(repo.write_config("""
        - {name: circle_select}
        - {name: mlp_bundle, queue_capacity: 1, batching: {enabled: false}}
        - {name: circle_score, queue_capacity: 64}
    """))
    points = np.random.default_rng(3).uniform(-0.3, 0.3, (64, 2)).astype(np.float32)  # two MLP calls each

    def score(_: int) -> np.ndarray:
        client = triton.InferenceServerClient(server.url)
        return infer(client, "circle_score", "points", points).as_numpy("selected")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(score, range(32)))
    assert len(answers) == 32 and all(answer.shape == (64, 2) for answer in answers)
