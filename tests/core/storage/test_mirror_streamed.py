"""Which files of a bucket's model folder stay in the store (``nereid.storage.mirror``'s StreamedFiles, the claiming
backend's nereid_streamed_files hook) and which are fetched to disk, against a real S3 API (moto)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

from moto_s3 import upload_folder
from nereid.settings import load_settings
from nereid.storage.mirror import read_marker


def test_a_python_model_gets_its_own_safetensors_files_on_disk(s3, tmp_path, python_folder, bucket_config) -> None:
    """Only a bundle's loader streams weights; a main.py that reads a .safetensors file needs it locally."""
    from nereid.storage import materialize_model_folder

    source = tmp_path / "source"
    folder = python_folder(source, "reader")
    (folder / "table.safetensors").write_bytes(b"not really, but a file")
    upload_folder(s3.store, source, s3.prefix)
    config = bucket_config(tmp_path, s3.url())
    local = materialize_model_folder(load_settings(config).server, "reader")
    assert (local / "table.safetensors").read_bytes() == b"not really, but a file"
    assert read_marker(local).streamed == {}


# A meta model that reads a table of its own folder's at load (missing, its load fails) and adds it to its input.
TABLE_META_MANIFEST = ('format_version: "2.1"\nmeta: true\ndepends_on: []\n'
                       "client_inputs: [{name: x, dtype: f32, shape: a, dims: {a: 4}}]\n"
                       "client_outputs: [{name: y, dtype: f32, shape: a, dims: {a: 4}}]\n")


TABLE_META_MODEL = """\
from pathlib import Path

import nereid
from safetensors.numpy import load_file
from nereid.tensors import NamedTensor

TABLE = load_file(str(Path(__file__).parent / "TABLE"))["table"]


async def orchestrate(inputs, ctx):
    return [NamedTensor("y", inputs[0].dtype, inputs[0].data + TABLE)]


nereid.register_model(orchestrate=orchestrate)
"""


def _table_meta_folder(root: Path, name: str, table: str) -> Path:
    """A meta model (see TABLE_META_MODEL) reading ``table``, a path in its folder, at load."""
    from safetensors.numpy import save_file

    folder = root / name
    (folder / table).parent.mkdir(parents=True)
    (folder / "manifest.yaml").write_text(TABLE_META_MANIFEST)
    (folder / "model.py").write_text(TABLE_META_MODEL.replace("TABLE\"", f'{table}"'))
    save_file({"table": np.arange(4, dtype=np.float32)}, str(folder / table))
    return folder


def test_a_meta_model_gets_its_own_safetensors_files_on_disk(s3, serve, tmp_path, bucket_config) -> None:
    """Defect (found by the structure review): the mirror left every *.safetensors of a folder holding a
    manifest.yaml in the store, for the xla backend to stream, a meta model's (meta: true) too: its model.py found
    no tables/table.safetensors from a bucket, though it loaded from a local folder. Only the backend that streams
    a file (a bundle's weights: the xla backend's nereid_streamed_files hook) keeps it in the store."""
    source = tmp_path / "source"
    _table_meta_folder(source, "pipeline", "tables/table.safetensors")
    _table_meta_folder(source, "flat", "table.safetensors")  # refused by the meta backend, as locally
    upload_folder(s3.store, source, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url()))
    assert server.client.is_model_ready("pipeline")
    tensor = triton.InferInput("x", [4], "FP32")
    tensor.set_data_from_numpy(np.ones(4, np.float32))
    answer = server.client.infer("pipeline", [tensor]).as_numpy("y")
    np.testing.assert_array_equal(answer, np.arange(4, dtype=np.float32) + 1)
    local = server.server.settings.server.ml_backends_path / "pipeline"
    assert (local / "tables" / "table.safetensors").is_file()
    assert read_marker(local).streamed == {}
    # A top-level one is refused as from a local folder, where it was a FileNotFoundError of model.py's.
    index = {m.name: m.reason for m in server.client.get_model_repository_index().models}
    assert ("says meta: true, but the folder holds program or weights files (table.safetensors)" in index["flat"]), \
        index["flat"]


def test_a_folder_declared_python_gets_its_manifest_s_neighbours_on_disk_and_a_bundle_streams(s3, tmp_path, capsys,
                                                                                              python_folder,
                                                                                              bucket_config) -> None:
    """A folder nereid.yaml declares ``backend: python`` is the python backend's whatever it holds: a
    manifest.yaml beside its main.py made the mirror leave its .safetensors in the store (an xla bundle's
    rule), where its main.py would read them. A bundle in the same bucket still has its weights streamed,
    through ``nereid check``'s fetch as through a server's."""
    from nereid.cli import main

    source = tmp_path / "source"
    folder = python_folder(source, "reader")
    (folder / "manifest.yaml").write_text("format_version: '2.1'\n")  # (a bundle's, were the folder not declared)
    (folder / "table.safetensors").write_bytes(b"the model's own, read by its main.py")
    upload_folder(s3.store, source, s3.prefix)
    shipped = Path(__file__).resolve().parents[3] / "ml-backends" / "mlp_bundle"
    upload_folder(s3.store, shipped, f"{s3.prefix}/mlp_bundle")
    config = bucket_config(tmp_path, s3.url(), "- name: reader\n  backend: python\n- name: mlp_bundle\n")
    assert main(["check", "--config", str(config)]) == 0, capsys.readouterr().out
    lines = sorted(line for line in capsys.readouterr().out.splitlines() if line.startswith(("mlp_bundle", "reader")))
    assert lines[0].startswith("mlp_bundle: OK backend=xla") and lines[1].startswith("reader: OK backend=python"), \
        lines
    root = load_settings(config).server.ml_backends_path
    assert (root / "reader" / "table.safetensors").read_bytes() == b"the model's own, read by its main.py"
    assert read_marker(root / "reader").streamed == {}
    assert sorted(read_marker(root / "mlp_bundle").streamed) == ["weights.safetensors"]
    assert not (root / "mlp_bundle" / "weights.safetensors").exists()
