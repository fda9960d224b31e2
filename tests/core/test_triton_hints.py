"""A Triton user's folders and config.pbtxt fields: each gets a hint of what it becomes here (found by a hunt
acting as a Triton user moving to nereid)."""

from __future__ import annotations

import pytest

from nereid.backend import ModelContext
from nereid.errors import ConfigError
from nereid.model_building import build_model
from nereid.plugins import make_plugin_manager
from nereid.settings import ModelSettings
from nereid.signature import load_textproto_signature
from nereid.triton_hints import folder_hint

LOOKS_LIKE = ("it looks like a Triton model folder ({}): nereid reads no config.pbtxt and no version folders; "
              "the README's 'Coming from Triton' maps each part")


@pytest.mark.parametrize("files, sign", [
    ({"config.pbtxt": 'name: "m"'}, "config.pbtxt"),
    # Triton completes the config of an ONNX, TensorRT or TensorFlow model itself: no config.pbtxt at all.
    ({"1/model.onnx": "onnx"}, "1/model.onnx"),
    ({"3/model.plan": "plan", "notes.txt": ""}, "3/model.plan"),
    ({"1/main.py": "print()"}, "1/main.py"),  # converted, but still in a version folder
    ({"1/weights.bin": ""}, None),  # a numbered folder holding no Triton model file
    ({"v1/model.onnx": ""}, None),  # no version folder
    ({"main.py": ""}, None),
])
def test_a_triton_model_folder_is_told_by_its_config_or_its_version_folder(tmp_path, files, sign) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert folder_hint(tmp_path) == (None if sign is None else LOOKS_LIKE.format(sign))


@pytest.mark.parametrize("text, hint", [
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\noutput [ { name: "y" data_type: "FP32" dims: [ 4 ] } ]\n'
     "dynamic_batching { max_queue_delay_microseconds: 100 }\n",
     "(dynamic_batching is a field of Triton's config.pbtxt: dynamic batching is nereid.yaml's batching: "
     "(max_queue_delay_ms, preferred_batch_sizes); the README's 'Coming from Triton' maps each part)"),
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] optional: true } ]\n',
     "(optional is a field of Triton's config.pbtxt: nereid has no optional inputs: every declared input is sent "
     "(a -1 dim lets a client send one with no elements); the README's 'Coming from Triton' maps each part)"),
    ('name: "m"\ninput [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\n',
     "(name is a field of Triton's config.pbtxt: a model's name is its folder's; "),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n',
     """Expected string but found: 'TYPE_FP32' (write data_type: "FP32" (KServe's name for Triton's TYPE_FP32, """
     "quoted))"),
    ('input [ { name: "x" data_type: "TYPE_INT8" dims: [ 4 ] } ]\n',
     """; write data_type: "INT8" (KServe's name for Triton's TYPE_INT8, quoted)"""),
    ('input [ { name: "x" data_type: "STRING" dims: [ 4 ] } ]\n',
     """; write data_type: "BYTES" (KServe's name for Triton's TYPE_STRING)"""),
    # (Found by a README check: the right name unquoted, or in lower case, got no hint.)
    ('input [ { name: "x" data_type: FP32 dims: [ 4 ] } ]\n',
     """Expected string but found: 'FP32' (a string is quoted: "FP32")"""),
    ('input [ { name: "x" data_type: "fp32" dims: [ 4 ] } ]\n',
     """; write data_type: "FP32" (datatypes are written in capitals)"""),
    # (The new user's hunt: the subprocess contract's name, from the README's dtype table, got no hint.)
    ('input [ { name: "x" data_type: "float32" dims: [ 4 ] } ]\n',
     """; write data_type: "FP32" (float32 is the subprocess contract's and numpy's name; a textproto takes """
     "KServe's)"),
    ('input_shape: [4]\noutput_shape: [4]\ndata_type: "FLOAT32"\n',
     """; write data_type: "FP32" (float32 is the subprocess contract's and numpy's name; """),
    ('input [ { name: "x" data_type: "bfloat16" dims: [ 4 ] } ]\n', """; write data_type: "BF16" (bfloat16 is """),
    ('input [ { name: "x" data_type: float64 dims: [ 4 ] } ]\n',
     """Expected string but found: 'float64' (write data_type: "FP64" (float64 is the subprocess contract's"""),
    # (The README walkthrough: the other fields of a config.pbtxt had only protobuf's bare "no field named".)
    ('ensemble_scheduling { step [ ] }\n',
     "(ensemble_scheduling is a field of Triton's config.pbtxt: an ensemble is a meta model (manifest.yaml with "
     "meta: true and an orchestrate in model.py); "),
    ('input [ { name: "x" data_type: "FP32" format: FORMAT_NHWC dims: [ 4 ] } ]\n',
     "(format is a field of Triton's config.pbtxt: an input has no image format here: declare the shape the model "
     "takes; "),
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\nparameters { key: "k" value { string_value: "v" } }\n',
     "(parameters is a field of Triton's config.pbtxt: a model's own settings are nereid.yaml's runtime: "),
])
def test_a_config_pbtxt_written_as_a_textproto_is_told_where_each_triton_field_goes(tmp_path, text, hint) -> None:
    """Defect: protobuf's 'has no field named "dynamic_batching"' or 'Expected string but found: TYPE_FP32', or a
    bare list of datatypes for "STRING", said nothing of where the field goes here."""
    path = tmp_path / "model_inference.textproto"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_textproto_signature(path)
    assert hint in str(refused.value), str(refused.value)


def test_a_field_triton_does_not_have_gets_no_triton_hint(tmp_path) -> None:
    path = tmp_path / "model_inference.textproto"
    path.write_text('input_shape: [4]\noutput_shape: [4]\nbatching: 3\n')
    with pytest.raises(ConfigError) as refused:
        load_textproto_signature(path)
    assert 'has no field named "batching". (model_inference.textproto\'s fields are ' in str(refused.value)
    assert "Triton" not in str(refused.value)


def test_a_triton_folder_given_a_backend_in_nereid_yaml_keeps_the_triton_hint(tmp_path) -> None:
    """Defect: `backend: python` in nereid.yaml (Triton's own config says backend: "python") gave only "missing
    model_inference.textproto", the Triton hint gone, though 1/model.py and config.pbtxt were right there."""
    folder = tmp_path / "ml-backends" / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('name: "m"\nbackend: "python"\nmax_batch_size: 8\n')
    (folder / "1" / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    context = ModelContext("m", folder, ModelSettings("m", backend="python"), tmp_path, "nereid.yaml")
    with pytest.raises(ConfigError) as refused:
        build_model(make_plugin_manager(load_entry_points=False), context)
    assert str(refused.value) == f"model 'm': missing model_inference.textproto in {folder}; " \
                                 + LOOKS_LIKE.format("config.pbtxt")
