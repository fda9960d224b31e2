"""backends/subprocess/model.py's bound on a run's outputs: an output a response could never carry, from a python model
behind a real server.

The gRPC wire is where the defect showed (grpcio's RESOURCE_EXHAUSTED after the
whole output was read, naming no model, and the request counted a success), so
the check is made through it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from support import textproto_single

# Echoes its input; when the input's first value is 1, writes only the header of a 2.4 GB output.
HUGE_OR_ECHO_MAIN = '''
import os, sys
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    if data[:4] == b"\\x00\\x00\\x80\\x3f":  # 1.0 as float32
        out.write(b"float32 1,600000000\\n")
    else:
        out.write(f"float32 {os.environ['NEREID_INPUT_SHAPE']}\\n".encode() + data)
'''


def infer(client: triton.InferenceServerClient, array: np.ndarray) -> np.ndarray:
    tensor = triton.InferInput("input", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return client.infer("huge", [tensor]).as_numpy("output")


def test_an_output_past_what_a_response_carries_is_a_model_fault_and_the_server_serves_on(repo, serve) -> None:
    repo.python("huge", main=HUGE_OR_ECHO_MAIN, textproto=textproto_single("FP32", "[4]", "[-1]"))
    server = serve(repo.write_config())
    with pytest.raises(InferenceServerException) as caught:
        infer(server.client, np.ones((1, 4), np.float32))
    assert caught.value.status() == "StatusCode.INTERNAL"
    assert caught.value.message() == ("model 'huge': output 'output': header promises 2400000000 bytes of float32 "
                                      "[1, 600000000], file holds 0; nereid reads at most 2147483647 bytes "
                                      "of outputs from one run (what one gRPC answer carries; over HTTP too)")
    stats = server.server.repository.ready_model("huge").stats.snapshot()
    assert (stats.success.count, stats.fail.count) == (0, 1)
    good = np.arange(4, dtype=np.float32).reshape(1, 4) + 2
    assert infer(server.client, good).tolist() == good.tolist()
