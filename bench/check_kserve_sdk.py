"""Check by hand that the KServe Python SDK's clients work against `nereid serve` and the shipped examples.

The SDK is a large install, so it is not a test dependency. In a separate
virtualenv, against a running `nereid serve` (from the repository root):

    python3 -m venv /tmp/kserve-venv && /tmp/kserve-venv/bin/pip install kserve==0.21.0
    /tmp/kserve-venv/bin/python bench/check_kserve_sdk.py [--http http://[::1]:8000] [--grpc [::1]:50051]

It asserts every answer and prints one line per check.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="http://[::1]:8000")
    parser.add_argument("--grpc", default="[::1]:50051")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGUMENTS = parse_arguments(sys.argv[1:])
    # Importing kserve parses the process's arguments (kserve/model_server.py), taking --http for an
    # abbreviation of its --http_port: it must find none.
    del sys.argv[1:]

import httpx  # noqa: E402 - after the arguments are taken (see above)
import numpy as np  # noqa: E402
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig  # noqa: E402
from kserve.protocol.infer_type import RequestedOutput  # noqa: E402

ROWS = np.arange(32, dtype=np.float32).reshape(2, 16)


def tensor(name: str, array: np.ndarray, binary: bool = False) -> InferInput:
    value = InferInput(name, list(array.shape), "FP32")
    value.set_data_from_numpy(array, binary_data=binary)
    return value


async def check_rest(base: str) -> None:
    client = InferenceRESTClient(RESTConfig(protocol="v2"))
    assert await client.is_server_live(base) and await client.is_server_ready(base)
    assert await client.is_model_ready(base, "python_rowsum") and not await client.is_model_ready(base, "nope")
    for binary in (False, True):
        request = InferRequest(model_name="python_rowsum", infer_inputs=[tensor("input", ROWS, binary)],
                               request_id="r1")
        response = await client.infer(base, request, model_name="python_rowsum")
        assert response.id == "r1" and response.outputs[0].as_numpy().tolist() == [[120.0], [376.0]]
        pair = [tensor("a", ROWS[:1], binary), tensor("b", np.full((1, 16), 2, np.float32), binary)]
        request = InferRequest(model_name="multi_sumprod", infer_inputs=pair,
                               request_outputs=[RequestedOutput("prod", parameters={"binary_data": binary})])
        response = await client.infer(base, request, model_name="multi_sumprod")
        assert [o.name for o in response.outputs] == ["prod"]
        assert response.outputs[0].as_numpy().ravel().tolist() == (ROWS[0] * 2).tolist()
        wrong = InferRequest(model_name="python_rowsum", infer_inputs=[tensor("input", ROWS[:, :15], binary)])
        try:
            await client.infer(base, wrong, model_name="python_rowsum")
            raise AssertionError("a wrong shape was accepted")
        except httpx.HTTPStatusError as err:
            assert err.response.status_code == 400 and "expected [batch, 16]" in str(err), err
        print(f"REST ({'binary' if binary else 'JSON'} tensors): health, readiness, infer, outputs, errors OK")
    await client.close()


async def check_grpc(address: str) -> None:
    client = InferenceGRPCClient(address)
    assert await client.is_server_live() and await client.is_server_ready()
    assert await client.is_model_ready("python_rowsum")
    response = await client.infer(InferRequest(model_name="python_rowsum", infer_inputs=[tensor("input", ROWS)],
                                               request_id="g1"))
    assert response.id == "g1" and response.outputs[0].as_numpy().tolist() == [[120.0], [376.0]]
    print("gRPC: health, readiness, infer OK")
    await client.close()


def main(args: argparse.Namespace) -> None:
    asyncio.run(check_rest(args.http))
    asyncio.run(check_grpc(args.grpc))


if __name__ == "__main__":
    main(ARGUMENTS)
