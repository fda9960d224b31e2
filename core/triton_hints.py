"""Hints for a Triton user: what a Triton model folder, or a config.pbtxt copied into a textproto, becomes here.

nereid reads no ``config.pbtxt`` and no version folders (the README's
"Coming from Triton" maps each part). Without a hint, such a user got only
protobuf's "has no field named ..." or the generic list of each backend's files.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from nereid.dtypes import DType

COMING_FROM_TRITON = "the README's 'Coming from Triton' maps each part"
# The wire datatypes by the subprocess contract's names (numpy's: float32, bfloat16; bytes for BYTES), which a
# textproto's data_type does not take.
_BY_CONTRACT_NAME = {d.numpy.name: d.kserve for d in DType if d.on_wire and d is not DType.BYTES} | {"bytes": "BYTES"}
# How many entries of a folder are looked at for version folders (a folder of thousands costs no more).
_SCANNED_ENTRIES = 64
# Triton's model file names in a version folder (its backends' defaults), when no config.pbtxt says more; and
# nereid's own entry files put there by a user who kept Triton's layout while converting.
_TRITON_MODEL_FILE = re.compile(r"model\.(py|onnx|plan|pt|savedmodel|graphdef|netdef)$|main\.(py|cpp)$")

# config.pbtxt fields a textproto cannot hold, and where each goes here.
_TRITON_FIELDS = {
    "dynamic_batching": "dynamic batching is nereid.yaml's batching: (max_queue_delay_ms, preferred_batch_sizes)",
    "instance_group": "instances are nereid.yaml's instances: and device:",
    "name": "a model's name is its folder's",
    "backend": "a model's backend is told by its files (or nereid.yaml's backend:)",
    "platform": "a model's backend is told by its files (or nereid.yaml's backend:)",
    "optional": "nereid has no optional inputs: every declared input is sent (a -1 dim lets a client send one "
                "with no elements)",
    "version_policy": "every model has the one version 1",
    "reshape": "nereid has no reshape: declare the shape the model takes",
    # (The rest of the fields a config.pbtxt holds: each had only protobuf's bare "no field named"; the README
    # walkthrough.)
    "ensemble_scheduling": "an ensemble is a meta model (manifest.yaml with meta: true and an orchestrate in "
                           "model.py)",
    "sequence_batching": "nereid has no sequence batching: a stateful model keeps its state itself (a backend "
                         "plugin)",
    "parameters": "a model's own settings are nereid.yaml's runtime: (or its files)",
    "model_warmup": "nereid sends no warm-up requests: a model warms itself in its load (a bundle is compiled "
                    "at load)",
    "response_cache": "nereid has no response cache",
    "default_model_filename": "a model's files are named by its backend (main.py, main.cpp, manifest.yaml)",
    "label_filename": "nereid has no label files: classification answers with class indexes",
    "model_transaction_policy": "nereid models answer each request once (no decoupled models)",
    "model_operations": "nereid has no model operations settings",
    "model_repository_agents": "nereid has no repository agents",
    "cc_model_filenames": "a model's files are named by its backend",
    "metric_tags": "metrics are labelled by model name",
    "format": "an input has no image format here: declare the shape the model takes",
}


def folder_hint(folder: Path) -> str | None:
    """``it looks like a Triton model folder (...)`` when ``folder`` holds a config.pbtxt, or a version folder
    with a Triton model file (``1/model.onnx``: Triton completes the config of some backends itself); else None."""
    try:
        if (folder / "config.pbtxt").is_file():
            return _looks_like("config.pbtxt")
        for entry in itertools.islice(folder.iterdir(), _SCANNED_ENTRIES):
            if entry.name.isdigit() and entry.is_dir():
                model_file = next((f.name for f in itertools.islice(entry.iterdir(), _SCANNED_ENTRIES)
                                   if _TRITON_MODEL_FILE.match(f.name)), None)
                if model_file is not None:
                    return _looks_like(f"{entry.name}/{model_file}")
    except OSError:
        return None
    return None


def _looks_like(sign: str) -> str:
    return (f"it looks like a Triton model folder ({sign}): nereid reads no config.pbtxt and no version folders; "
            f"{COMING_FROM_TRITON}")


def python_model_hint(sign: str = "") -> str:
    """What to tell of a ``main.py`` that ``sign`` shows is a model of Triton's Python backend (``imports
    triton_python_backend_utils``; no ``sign`` where the message names it already)."""
    return (f"{f'main.py {sign}: ' if sign else ''}a model of Triton's Python backend? nereid calls no "
            "TritonPythonModel: main.py's "
            "top-level code is run once per batch, reading its inputs from stdin and writing its outputs to the file "
            "NEREID_OUTPUT_PATH names (the README's 'Coming from Triton', its TritonPythonModel row)")


def textproto_hint(problem: str) -> str:
    """What to add to protobuf's ``problem`` with a model_inference.textproto written as a config.pbtxt ("" when
    it is no such problem): a Triton field, or an unquoted ``TYPE_FP32``."""
    field = re.search(r'has no field named "(\w+)"', problem)
    if field is not None:
        where = _TRITON_FIELDS.get(field.group(1))
        if where is not None:
            return f" ({field.group(1)} is a field of Triton's config.pbtxt: {where}; {COMING_FROM_TRITON})"
        return ""
    unquoted = re.search(r"Expected string but found: '(\w+)'", problem)
    if unquoted is not None:
        found = unquoted.group(1)
        # (The message names no field: a datatype's name unquoted is most likely data_type's, but say only what
        # holds for any string field.)
        hint = datatype_hint(found) or (f'a string is quoted: "{found}"' if _is_datatype(found) else "")
        return f" ({hint})" if hint else ""
    return ""


def datatype_hint(data_type: str) -> str:
    """For a datatype spelled as Triton spells it (``TYPE_FP32``, ``STRING``), in lower case (``fp32``), or as the
    subprocess contract names it (``float32``), the spelling here; "" otherwise."""
    bare = data_type.removeprefix("TYPE_")
    if bare == "STRING":
        return 'write data_type: "BYTES" (KServe\'s name for Triton\'s TYPE_STRING)'
    if bare != data_type:
        return f'write data_type: "{bare}" (KServe\'s name for Triton\'s {data_type}, quoted)'
    if data_type != data_type.upper() and _is_datatype(data_type.upper()):
        return f'write data_type: "{data_type.upper()}" (datatypes are written in capitals)'
    kserve = _BY_CONTRACT_NAME.get(data_type.lower())
    if kserve is not None:  # (float32: what NEREID_INPUT_DTYPE and a frame header say, the README's dtype table)
        return (f'write data_type: "{kserve}" ({data_type.lower()} is the subprocess contract\'s and numpy\'s name; a '
                "textproto takes KServe's)")
    return ""


def _is_datatype(name: str) -> bool:
    try:
        DType.from_kserve(name)
    except ValueError:
        return False
    return True
