"""A Triton user's folders and config.pbtxt fields: each gets a hint of what it becomes here (found by a hunt
acting as a Triton user moving to nereid)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import NEREID
from nereid import hookspecs
from nereid.backend import BackendClaim, ModelContext
from nereid.errors import ConfigError
from nereid.model_building import build_model
from nereid.plugins import make_plugin_manager
from nereid.settings import ModelSettings
from nereid.signature import load_textproto_signature
from nereid.triton_hints import folder_hint, leftovers_note, triton_fields

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
    # (The migration hunt: batch_input had "did you mean input?", the others the list of valid fields; model_warmup
    # said "a model warms itself in its load", which a python or cpp model has no hook for.)
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\nbatch_input [ { kind: BATCH_ELEMENT_COUNT } ]\n',
     "(batch_input is a field of Triton's config.pbtxt: nereid has no batch inputs (nor ragged batching): a "
     "batch's inputs hold its requests' rows along the batch axis, and their shapes tell the model how many; "),
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\nbatch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
     '} ]\n',
     "(batch_output is a field of Triton's config.pbtxt: nereid has no batch outputs (nor ragged batching): each "
     "output is split back by rows along the batch axis; "),
    ('input [ { name: "x" data_type: "FP32" dims: [ -1 ] allow_ragged_batch: true } ]\n',
     "(allow_ragged_batch is a field of Triton's config.pbtxt: nereid has no ragged batching: requests batch "
     "together only when their shapes past the batch axis match (one that differs starts the next batch); "),
    ('input [ { name: "x" data_type: "INT32" dims: [ 2 ] is_shape_tensor: true } ]\n',
     "(is_shape_tensor is a field of Triton's config.pbtxt: nereid has no shape tensors: an input's values are "
     "data, and a model reads the shapes it needs from its tensors; "),
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\nmodel_warmup [ { name: "w" batch_size: 1 } ]\n',
     "(model_warmup is a field of Triton's config.pbtxt: nereid sends no warm-up requests: a python model's warm "
     "start imports what main.py imports once, at its load (its top-level code runs per batch: the README's 'Warm "
     "start'), a cpp model's main.cpp and a bundle are compiled at their load, and a plugin's model warms itself "
     "in its load(); "),
    # (The migration hunt: it sent a python model's settings to runtime:, which refuses them.)
    ('input [ { name: "x" data_type: "FP32" dims: [ 4 ] } ]\nparameters { key: "k" value { string_value: "v" } }\n',
     "(parameters is a field of Triton's config.pbtxt: nereid.yaml's runtime: holds its backend's options only, "
     "and refuses any other key: a python, cpp or meta model reads its own settings from a file in its folder (a "
     "python or cpp run starts in the folder; a meta model's model.py finds it beside its __file__); "),
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


def _triton_folder_ported_in_place(root: Path, name: str = "m") -> Path:
    """A Triton folder (config.pbtxt, 1/model.py) with nereid's files added beside its own: a python model."""
    folder = root / "ml-backends" / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n')
    (folder / "1" / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    (folder / "main.py").write_text("print('never run')\n")
    (folder / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\n")
    return folder


def _build(root: Path, folder: Path, settings: ModelSettings, *plugins: object):
    context = ModelContext(folder.name, folder, settings, root / "scratch", "nereid.yaml")
    context.scratch_dir.mkdir(parents=True, exist_ok=True)
    return build_model(make_plugin_manager(load_entry_points=False, extra_plugins=plugins), context)


@pytest.mark.parametrize("settings, reason", [
    (ModelSettings("m", runtime={"threshold": "0.5"}), "unknown option of the python backend"),
    (ModelSettings("m", backend="Python"), "backend 'Python' (from nereid.yaml) is not installed (did you mean "
                                           "'python'?)"),
])
def test_a_triton_folder_failing_for_another_reason_is_not_told_it_looks_like_one(tmp_path, settings,
                                                                                  reason) -> None:
    """Defect: the hint was added to any ConfigError of a folder holding a config.pbtxt (a device without its
    driver: '...; set device: cpu; it looks like a Triton model folder (config.pbtxt)'), where it explained
    nothing."""
    folder = _triton_folder_ported_in_place(tmp_path)
    with pytest.raises(ConfigError) as refused:
        _build(tmp_path, folder, settings)
    assert reason in str(refused.value), str(refused.value)
    assert "Triton" not in str(refused.value), str(refused.value)


class Picky:
    """A backend that declines every folder, even one declared its own."""

    BACKEND_NAME = "picky"

    @hookspecs.hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        return None


def test_a_triton_folder_its_declared_backend_does_not_recognise_keeps_the_triton_hint(tmp_path) -> None:
    folder = tmp_path / "ml-backends" / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(ConfigError) as refused:
        _build(tmp_path, folder, ModelSettings("m", backend="picky"), Picky())
    assert str(refused.value) == f"backend 'picky' does not recognise the folder {folder}; " \
                                 + LOOKS_LIKE.format("1/model.onnx")


@pytest.mark.parametrize("backend, missing", [
    ("cpp", "missing model_inference.textproto in "),
    ("cxx", "missing model_inference.textproto in "),
    ("xla", ": missing manifest.yaml (a bundle holds "),
    ("meta", " has no manifest.yaml (a meta model holds "),
])
def test_each_backend_missing_its_file_in_a_triton_folder_keeps_the_triton_hint(tmp_path, backend, missing) -> None:
    """The hint explains a file a declared backend lacks, whichever backend: each raises MissingModelFile."""
    folder = tmp_path / "ml-backends" / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('name: "m"\n')
    (folder / "1" / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(ConfigError) as refused:
        _build(tmp_path, folder, ModelSettings("m", backend=backend))
    assert missing in str(refused.value), str(refused.value)
    assert str(refused.value).endswith("; " + LOOKS_LIKE.format("config.pbtxt")), str(refused.value)


# A config.pbtxt as Triton's Python backend has it, with the settings a port must carry over.
TRITON_CONFIG = """name: "text_len"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000 }
instance_group [ { count: 3 kind: KIND_CPU } ]
version_policy: { specific: { versions: [2] } }
"""
DROPPED = ("its dynamic_batching (dynamic batching is nereid.yaml's batching: (max_queue_delay_ms, "
           "preferred_batch_sizes)), instance_group (instances are nereid.yaml's instances: and device:) and "
           "version_policy (every model has the one version 1) do not apply")


def test_triton_fields_are_found_where_triton_writes_them() -> None:
    text = TRITON_CONFIG + 'input [ { name: "B" reshape: { shape: [ ] } } ]\n# optional: true\nparameters {}\n'
    assert triton_fields(text) == ["name", "backend", "dynamic_batching", "instance_group", "version_policy",
                                   "reshape", "parameters"]
    # A block's own "name" is no Triton field, nor one written as a value, in a string or in a comment.
    assert triton_fields('input { name: "parameters" }\ninstance_group [ { name: "g" } ] # name: "x"\n') == [
        "instance_group"]


@pytest.mark.parametrize("files, note", [
    ({"config.pbtxt": TRITON_CONFIG, "1/model.py": "", "2/model.py": ""},
     f"its config.pbtxt and version folders 1/, 2/ are not read: {DROPPED}, and 1/model.py, 2/model.py do not run "
     "(the model is the files at the top of its folder, its one version 1); remove them (the README's 'Coming from "
     "Triton' maps each part)"),
    ({"config.pbtxt": 'name: "m"\nbackend: "onnxruntime"\n'},  # (what is moot once served is not named)
     "its config.pbtxt is not read; remove it (the README's 'Coming from Triton' maps each part)"),
    ({"10/model.onnx": "", "9/model.plan": "", "3/weights.bin": ""},
     "its version folders 9/, 10/ are not read: 9/model.plan, 10/model.onnx do not run (the model is the files at "
     "the top of its folder, its one version 1); remove them ("),
    ({"main.py": "", "model_inference.textproto": ""}, None),
])
def test_what_a_served_folder_keeps_of_triton_s_is_named_with_where_it_goes(tmp_path, files, note) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    said = leftovers_note(tmp_path)
    assert said == note if note is None or note.endswith(")") else said.startswith(note), said


def _ported_text_len(models_dir: Path) -> Path:
    """The migration hunt's folder: main.py and the textproto added in place, Triton's files kept."""
    folder = models_dir / "text_len"
    for version in ("1", "2"):
        (folder / version).mkdir(parents=True)
        (folder / version / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    (folder / "config.pbtxt").write_text(TRITON_CONFIG)
    (folder / "main.py").write_text("print('never run here')\n")
    (folder / "model_inference.textproto").write_text(
        'max_batch_size: 8\ninput { name: "TEXT" data_type: "BYTES" dims: [1] }\n'
        'output { name: "LEN" data_type: "INT32" dims: [1] }\n')
    return folder


def test_nereid_check_notes_the_triton_files_a_model_that_loads_ignores(repo) -> None:
    """Defect: a folder ported in place that kept config.pbtxt (3 instances, a batching window, version 2) and its
    version folders was 'OK' without a word, and served 1 instance, no window, version 1."""
    _ported_text_len(repo.models_dir)
    repo.python("clean")
    result = subprocess.run([*NEREID, "check", "--config", str(repo.write_config())], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr  # (a note, not a problem: it serves)
    lines = {line.split(":")[0]: line for line in result.stdout.splitlines()}
    assert lines["text_len"].startswith("text_len: OK backend=python "), lines["text_len"]
    assert lines["text_len"].endswith("; note: its config.pbtxt and version folders 1/, 2/ are not read: "
                                      f"{DROPPED}, and 1/model.py, 2/model.py do not run (the model is the files "
                                      "at the top of its folder, its one version 1); remove them (the README's "
                                      "'Coming from Triton' maps each part)"), lines["text_len"]
    assert "note" not in lines["clean"] and "Triton" not in result.stderr, lines["clean"]


def test_a_config_pbtxt_copied_as_the_textproto_is_told_every_triton_field_in_one_refusal(tmp_path) -> None:
    """Defect (the migration hunt): protobuf stops at the first field it does not know, so a typical config.pbtxt
    took seven runs of nereid check, one Triton field (or datatype) told each time."""
    path = tmp_path / "model_inference.textproto"
    path.write_text(TRITON_CONFIG + 'parameters { key: "k" value { string_value: "v" } }\n')
    with pytest.raises(ConfigError) as refused:
        load_textproto_signature(path)
    said = str(refused.value)
    assert said.startswith(f'{path}:1:1 : Message type "nereid.ModelInference" has no field named "name". (name is '
                           "a field of Triton's config.pbtxt: a model's name is its folder's; the text holds more of "
                           "Triton's config.pbtxt, each refused in turn: backend (a model's backend is told by its "
                           "files (or nereid.yaml's backend:)), dynamic_batching (dynamic batching is "), said
    for more in ("), instance_group (instances are", "), version_policy (every model has the one version 1), "
                 "parameters (nereid.yaml's runtime: holds", '), data_type TYPE_STRING (write "BYTES"), data_type '
                 'TYPE_INT32 (write "INT32"); the README\'s \'Coming from Triton\' maps each part)'):
        assert more in said, said
    assert said.count("Triton's config.pbtxt") == 2 and said.count("(name is") == 1, said


def test_a_triton_datatype_refused_first_is_told_with_the_triton_fields_after_it(tmp_path) -> None:
    path = tmp_path / "model_inference.textproto"
    path.write_text('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                    'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\ninstance_group [ { count: 2 } ]\n')
    with pytest.raises(ConfigError) as refused:
        load_textproto_signature(path)
    assert str(refused.value).endswith(
        """Expected string but found: 'TYPE_FP32' (write data_type: "FP32" (KServe's name for Triton's TYPE_FP32, """
        "quoted); the text holds more of Triton's config.pbtxt, each refused in turn: instance_group (instances are "
        "nereid.yaml's instances: and device:); the README's 'Coming from Triton' maps each part)"), str(refused.value)


MODEL_PY_HINT = ("model.py names {}, as Triton's Python backend's file does: the python backend's entry file is "
                 "main.py (rename model.py to main.py), and nereid calls no TritonPythonModel: main.py's top-level "
                 "code is run once per batch, reading its inputs from stdin and writing its outputs to the file "
                 "NEREID_OUTPUT_PATH names (the README's 'Coming from Triton', its TritonPythonModel row)")


@pytest.mark.parametrize("files, hint", [
    ({"model.py": "class TritonPythonModel:\n    pass\n"}, MODEL_PY_HINT.format("TritonPythonModel")),
    ({"model.py": "import triton_python_backend_utils as pb_utils\n"},
     MODEL_PY_HINT.format("triton_python_backend_utils")),
    ({"model.py": "class TritonPythonModel: pass\n", "config.pbtxt": ""},
     LOOKS_LIKE.format("config.pbtxt") + "; " + MODEL_PY_HINT.format("TritonPythonModel")),
    ({"model.py": "print('a helper')\n"}, None),  # no sign of Triton's
    ({"model.py": "class TritonPythonModel: pass\n", "main.py": ""}, None),  # a helper beside main.py
    ({"model.py": "class TritonPythonModel: pass\n", "manifest.yaml": ""}, None),  # a bundle's or meta model's
])
def test_a_triton_model_py_at_the_top_is_told_the_python_entry_file_is_main_py(tmp_path, files, hint) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\n")
    assert folder_hint(tmp_path) == hint


@pytest.mark.parametrize("backend, reason", [
    (None, "no backend claims the folder "),
    ("python", "model 'm': missing main.py in "),
])
def test_a_triton_model_py_moved_to_the_top_is_told_to_be_main_py(tmp_path, backend, reason) -> None:
    """Defect (the migration hunt): Triton's 1/model.py moved next to the textproto, its name kept, got only the
    generic "no backend claims the folder" (with backend: python, only "missing main.py")."""
    folder = tmp_path / "ml-backends" / "m"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text("import triton_python_backend_utils as pb_utils\n\n\nclass TritonPythonModel:\n"
                                     "    def execute(self, requests):\n        return []\n")
    (folder / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\n")
    with pytest.raises(ConfigError) as refused:
        _build(tmp_path, folder, ModelSettings("m", backend=backend))
    assert reason in str(refused.value), str(refused.value)
    assert str(refused.value).endswith("; " + MODEL_PY_HINT.format("triton_python_backend_utils")), str(refused.value)
