"""Prometheus metrics at /metrics: request outcomes, histograms, queue depth, states, load time."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_describe_requests_batches_and_models(repo, serve) -> None:
    repo.python("echo")
    repo.add("broken", "input_shape: [4\n", main_py="print()")
    server = serve(repo.write_config("- name: echo\n- name: broken\n"))
    client = server.client
    good = triton.InferInput("input", [2, 4], "FP32")
    good.set_data_from_numpy(np.ones((2, 4), np.float32))
    for _ in range(3):
        client.infer("echo", [good])
    bad = triton.InferInput("input", [2, 5], "FP32")
    bad.set_data_from_numpy(np.ones((2, 5), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("echo", [bad])

    samples = scrape(server.server.metrics_port)
    model = (("model", "echo"),)
    assert samples[("nereid_request_success_total", model)] == 3
    assert samples[("nereid_request_failure_total", (("model", "echo"), ("reason", "invalid_argument")))] == 1
    assert samples[("nereid_request_duration_seconds_count", model)] == 4
    assert samples[("nereid_queue_duration_seconds_count", model)] == 3
    assert samples[("nereid_compute_duration_seconds_count", model)] == 3
    assert samples[("nereid_compute_duration_seconds_sum", model)] > 0
    assert samples[("nereid_batch_size_sum", model)] == 6  # three executions of two rows
    assert samples[("nereid_batch_size_bucket", (("le", "2.0"), ("model", "echo")))] == 3
    assert samples[("nereid_batcher_submitted_total", model)] == 3  # the invalid one never reached the queue
    assert samples[("nereid_batcher_completed_total", model)] == 3
    assert samples[("nereid_batch_size_count", model)] == 3  # batches; avg size = sum / count
    assert samples[("nereid_queue_depth", model)] == 0
    assert 0 < samples[("nereid_batch_utilization", model)] <= 1
    assert samples[("nereid_model_load_duration_seconds_count", model)] == 1
    assert samples[("nereid_models", (("state", "READY"),))] == 1
    assert samples[("nereid_models", (("state", "UNAVAILABLE"),))] == 1


def test_metrics_can_be_turned_off(repo, serve) -> None:
    repo.python("echo")
    server = serve(repo.write_config(metrics_addr=""))
    assert server.server.metrics_port is None
