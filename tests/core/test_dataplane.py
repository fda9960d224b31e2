"""The data plane on its own: every question and command the protocol surfaces forward, without a wire."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from nereid.dtypes import DType
from nereid.errors import InvalidArgument, ModelFailure, NotFound, PermissionDenied, Unavailable
from nereid.tensors import InferRequest, NamedTensor
from toy_backends import toy_dataplane


def request(name: str = "toy", **kwargs) -> InferRequest:
    return InferRequest(name, [NamedTensor("input", DType.FP32, np.ones((2, 4), np.float32))], **kwargs)


def test_infer_metadata_config_statistics_and_index(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        response = await plane.infer(request(id="r"))
        assert response.id == "r" and response.outputs[0].data.tolist() == [[2.0] * 4] * 2
        metadata = plane.model_metadata("toy")
        assert (metadata.platform, metadata.inputs[0].shape, metadata.versions) == ("toy_platform", (-1, 4), ("1",))
        config = plane.model_config("toy", "1")
        assert (config.backend, config.max_batch_size, config.instance_group.count) == ("toy", 8, 2)
        assert config.dynamic_batching is not None and config.inputs[0].shape == (4,)
        ((name, stats),) = plane.statistics("toy")
        assert name == "toy" and stats.inference_count == 2 and stats.success.count == 1
        index = {e.name: e.state for e in await plane.repository_index()}
        assert index == {"spare": "UNAVAILABLE", "toy": "READY"}
        assert [e.name for e in await plane.repository_index(ready_only=True)] == ["toy"]
        assert plane.ready() and plane.model_ready("toy") and not plane.model_ready("spare")
        await plane.unload("toy")
        assert plane.changes == ["changed", "changed"]
    asyncio.run(scenario())


def test_errors_carry_their_meaning(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy")
        with pytest.raises(NotFound, match="model 'toy' has no version '2'"):
            plane.model_metadata("toy", "2")
        with pytest.raises(NotFound, match="unknown model 'nope'"):
            await plane.infer(request("nope"))
        with pytest.raises(Unavailable, match="model 'spare' is not ready"):
            await plane.infer(request("spare"))
        with pytest.raises(InvalidArgument, match="unknown requested output 'z'"):
            await plane.infer(request(requested_outputs=["z"]))
        (tmp_path / "ml-backends" / "spare" / "fail.txt").write_text("no")
        with pytest.raises(ModelFailure, match="failed to load model 'spare'"):
            await plane.load("spare")
        await plane.unload("toy")
    asyncio.run(scenario())


def test_repository_control_off_refuses_load_and_unload(tmp_path):
    plane = toy_dataplane(tmp_path, control=False)

    async def scenario():
        with pytest.raises(PermissionDenied, match="RepositoryModelLoad is turned off"):
            await plane.load("toy")
        with pytest.raises(PermissionDenied, match="RepositoryModelUnload is turned off"):
            await plane.unload("toy")
    asyncio.run(scenario())


def test_load_overrides_are_refused_not_ignored_and_unload_dependents_is_accepted(tmp_path):
    plane = toy_dataplane(tmp_path)

    async def scenario():
        await plane.load("toy", ["some_future_key"])  # a parameter nereid does not know is let through
        with pytest.raises(InvalidArgument, match=r"model 'spare': load parameters 'config', 'file:1/model.onnx' "
                                                  r"are not supported"):
            await plane.load("spare", ["file:1/model.onnx", "config"])
        assert not plane.model_ready("spare")  # refused before anything was loaded
        await plane.unload("toy", unload_dependents=True)
        assert not plane.model_ready("toy")
    asyncio.run(scenario())
