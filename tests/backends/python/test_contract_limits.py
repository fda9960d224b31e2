"""Python models at the edges of the subprocess contract, on a real server: timeouts of any length, tensor
names the contract cannot carry, a FIFO or a folder where a file should be."""

from __future__ import annotations

import os

import numpy as np
import tritonclient.grpc as triton

from support import FRAMED_ECHO_MAIN, textproto_single

FOUR = np.arange(4, dtype=np.float32).reshape(1, 4)
# 25 days: past the ~24.8 days (2**31 ms) that one poll() can wait.
DAYS_25_S = 2_160_000


def multi(first_input: str) -> str:
    """Two inputs and two outputs; ``first_input`` as it is spelled inside the textproto's quotes."""
    return (f'input {{ name: "{first_input}" data_type: "FP32" dims: [4] }}\n'
            'input { name: "b" data_type: "FP32" dims: [4] }\n'
            'output { name: "sum" data_type: "FP32" dims: [4] }\noutput { name: "prod" data_type: "FP32" dims: [4] }\n')


def test_load_refusals_and_long_timeouts(repo, serve) -> None:
    repo.python("warm")
    repo.python("cold")
    repo.add("nul_name", multi("a\\000z"), main_py=FRAMED_ECHO_MAIN)
    repo.add("comma_name", multi("a,b"), main_py=FRAMED_ECHO_MAIN)
    fifo_textproto = repo.python("fifo_textproto") / "model_inference.textproto"
    fifo_textproto.unlink()
    os.mkfifo(fifo_textproto)
    fifo_main = repo.add("fifo_main", textproto_single()) / "main.py"
    os.mkfifo(fifo_main)
    folder_main = repo.add("folder_main", textproto_single()) / "main.py"
    folder_main.mkdir()
    server = serve(repo.write_config(f'''
        - {{name: warm, timeout_s: {DAYS_25_S}}}
        - {{name: cold, timeout_s: {DAYS_25_S}, runtime: {{warm_start: false}}}}
        - {{name: nul_name}}
        - {{name: comma_name}}
        - {{name: fifo_textproto}}
        - {{name: fifo_main}}
        - {{name: folder_main}}
    '''))
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}

    # Every request to a model with timeout_s past 24.8 days failed INTERNAL (OverflowError), warm or cold.
    for name in ("warm", "cold"):
        assert index[name] == ("READY", ""), index[name]
        tensor = triton.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(FOUR)
        assert server.client.infer(name, [tensor]).as_numpy("output").tolist() == FOUR.tolist()

    # Loaded READY, then every request failed with nereid's own traceback (NUL) or misnamed its inputs (comma).
    assert index["nul_name"] == ("UNAVAILABLE", "model 'nul_name': nul_name/model_inference.textproto: input "
                                 "'a\\x00z' holds a NUL character, which no environment variable can carry; "
                                 "rename it")
    assert index["comma_name"] == ("UNAVAILABLE", "model 'comma_name': comma_name/model_inference.textproto: "
                                   "input 'a,b' holds a comma, the separator of the names in NEREID_INPUT_NAMES; "
                                   "rename it")

    # Reported as a missing textproto, and as a folder no backend claims.
    assert index["fifo_textproto"] == ("UNAVAILABLE", "model 'fifo_textproto': fifo_textproto/"
                                       "model_inference.textproto: is a FIFO, not a regular file")
    assert index["fifo_main"] == ("UNAVAILABLE", "model 'fifo_main': fifo_main/main.py: is a FIFO, not a regular file")
    assert index["folder_main"] == ("UNAVAILABLE", "model 'folder_main': folder_main/main.py: is a directory, "
                                    "not a regular file")
