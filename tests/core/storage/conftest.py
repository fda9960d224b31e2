"""Fixtures of the object-storage tests (``nereid.storage``), shared by its files: a python model's folder to upload,
a nereid.yaml on a bucket, one echo request, a wait for a server's thread, and a boto3 client on the moto server.

The helpers are handed out by fixtures, as a conftest's are: a test module cannot import this one.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import tritonclient.grpc as triton

from support import ECHO_MAIN, textproto_single


def write_python_folder(root: Path, name: str, main: str = ECHO_MAIN) -> Path:
    """A python model folder ``root/name`` (``main`` echoes its input by default) with a file in a sub-folder."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text(textproto_single())
    (folder / "main.py").write_text(textwrap.dedent(main))
    (folder / "helpers").mkdir()
    (folder / "helpers" / "note.txt").write_text("a helper file in a sub-folder")
    return folder


def write_bucket_config(tmp_path: Path, url: str, models: str | None = None) -> Path:
    """``tmp_path/nereid.yaml`` serving the repository at ``url`` (the cache in ``tmp_path/cache``, ports free, no
    HTTP or metrics), with ``models`` (YAML list items) as its models: key when given."""
    text = (f'server:\n  bind_addr: "127.0.0.1:0"\n  metrics_addr: ""\n  http_addr: ""\n  ml_backends_path: "{url}"\n'
            f'  cache_dir: "{tmp_path / "cache"}"\n')
    if models is not None:
        text += "models:\n" + textwrap.indent(textwrap.dedent(models), "  ")
    config = tmp_path / "nereid.yaml"
    config.write_text(text)
    return config


def echo_request(client: Any, model: str, x: np.ndarray) -> np.ndarray:
    """What ``model`` answers to FP32 ``x`` as its ``input`` (its ``output``), over gRPC."""
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("output")


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 10) -> None:
    """Wait for ``check()`` (work done on a thread of the server's), failing after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


@pytest.fixture
def python_folder() -> Callable[..., Path]:
    """:func:`write_python_folder`."""
    return write_python_folder


@pytest.fixture
def bucket_config() -> Callable[..., Path]:
    """:func:`write_bucket_config`."""
    return write_bucket_config


@pytest.fixture
def echo() -> Callable[[Any, str, np.ndarray], np.ndarray]:
    """:func:`echo_request`."""
    return echo_request


@pytest.fixture
def until() -> Callable[..., None]:
    """:func:`wait_for`."""
    return wait_for


@pytest.fixture
def boto(s3) -> Any:
    """A boto3 client on the moto server: it can store the keys obstore refuses to (``dir/``, ``a//b``, tabs)."""
    import boto3

    from moto_s3 import ACCESS_KEY, REGION, SECRET_KEY

    return boto3.client("s3", endpoint_url=s3.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY)
