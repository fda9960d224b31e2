"""Hints for a Triton user: what a Triton model folder, or a config.pbtxt copied into a textproto, becomes here.

nereid reads no ``config.pbtxt`` and no version folders (the README's
"Coming from Triton" maps each part). Without a hint, such a user got only
protobuf's "has no field named ..." or the generic list of each backend's files;
and a folder that serves with Triton's files still in it, not a word of them
(:func:`leftovers_note`).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Iterable

from google.protobuf import text_format

from nereid.dtypes import DType
from nereid.errors import ConfigError
from nereid.files import read_text_file

COMING_FROM_TRITON = "the README's 'Coming from Triton' maps each part"
# The wire datatypes by the subprocess contract's names (numpy's: float32, bfloat16; bytes for BYTES), which a
# textproto's data_type does not take.
_BY_CONTRACT_NAME = {d.numpy.name: d.kserve for d in DType if d.on_wire and d is not DType.BYTES} | {"bytes": "BYTES"}
# How many entries of a folder are looked at for version folders (a folder of thousands costs no more).
_SCANNED_ENTRIES = 64
# Triton's model file names in a version folder (its backends' defaults), when no config.pbtxt says more; and
# nereid's own entry files put there by a user who kept Triton's layout while converting.
_TRITON_MODEL_FILE = re.compile(r"model\.(py|onnx|plan|pt|savedmodel|graphdef|netdef)$|main\.(py|cpp)$")
# How much of a model.py is read for the signs of Triton's Python backend (its imports come first).
_MODEL_PY_READ_BYTES = 1 << 16
# What a model of Triton's Python backend is told of the python backend's contract.
_PYTHON_CONTRACT = ("nereid calls no TritonPythonModel: main.py's top-level code is run once per batch, reading its "
                    "inputs from stdin and writing its outputs to the file NEREID_OUTPUT_PATH names (the README's "
                    "'Coming from Triton', its TritonPythonModel row)")
# How many of a served folder's leftover version folders its note names (the rest are counted).
_NAMED_VERSIONS = 8
# How much of a leftover config.pbtxt is read to name the settings it holds (Triton's are a few KiB).
_CONFIG_READ_BYTES = 1 << 20
# A leftover config.pbtxt's fields that say nothing once the folder serves: its backend claimed it by its files.
_MOOT_ONCE_SERVED = frozenset({"name", "backend", "platform"})

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
    # (runtime: refuses any key but its backend's options: the hint sent a python model's settings there, to be
    # refused in turn; the migration hunt.)
    "parameters": "nereid.yaml's runtime: holds its backend's options only, and refuses any other key: a python, "
                  "cpp or meta model reads its own settings from a file in its folder (a python or cpp run starts "
                  "in the folder; a meta model's model.py finds it beside its __file__)",
    # (A python or cpp model has no load hook to warm itself in: say what each has.)
    "model_warmup": "nereid sends no warm-up requests: a python model's warm start imports what main.py imports "
                    "once, at its load (its top-level code runs per batch: the README's 'Warm start'), a cpp "
                    "model's main.cpp and a bundle are compiled at their load, and a plugin's model warms itself "
                    "in its load()",
    "response_cache": "nereid has no response cache",
    "default_model_filename": "a model's files are named by its backend (main.py, main.cpp, manifest.yaml)",
    "label_filename": "nereid has no label files: classification answers with class indexes",
    "model_transaction_policy": "nereid models answer each request once (no decoupled models)",
    "model_operations": "nereid has no model operations settings",
    "model_repository_agents": "nereid has no repository agents",
    "cc_model_filenames": "a model's files are named by its backend",
    "metric_tags": "metrics are labelled by model name",
    "format": "an input has no image format here: declare the shape the model takes",
    # (Ragged batching's: batch_input had "did you mean input?", the others only the list of valid fields.)
    "batch_input": "nereid has no batch inputs (nor ragged batching): a batch's inputs hold its requests' rows "
                   "along the batch axis, and their shapes tell the model how many",
    "batch_output": "nereid has no batch outputs (nor ragged batching): each output is split back by rows along "
                    "the batch axis",
    "allow_ragged_batch": "nereid has no ragged batching: requests batch together only when their shapes past "
                          "the batch axis match (one that differs starts the next batch)",
    "is_shape_tensor": "nereid has no shape tensors: an input's values are data, and a model reads the shapes "
                       "it needs from its tensors",
}
# The fields of _TRITON_FIELDS that Triton writes in an input {} or output {} block (the rest at the top).
_TENSOR_FIELDS = frozenset({"optional", "format", "reshape", "allow_ragged_batch", "is_shape_tensor"})

# Triton's names written as keys of nereid.yaml, by the section they were written in, with what nereid.yaml takes
# instead: config.pbtxt's fields in a model entry (where a textproto's are told the same), dynamic_batching's in a
# batching: section, Triton's command line flags under server:. Each was refused with the allowed keys alone.
_YAML_KEYS = {
    "model": {
        **{field: f"{field} is a field of Triton's config.pbtxt: {where}"
           for field, where in _TRITON_FIELDS.items() if field not in _TENSOR_FIELDS},
        # (Triton's is the model's own: here that is its contract's, and nereid.yaml's only caps merged batches.)
        "max_batch_size": "max_batch_size is a field of Triton's config.pbtxt: a model's own is in its "
                          "model_inference.textproto (a bundle's manifest.yaml), and nereid.yaml's batching: "
                          "{max_batch_size: N} caps the rows of the batches it merges",
    },
    "batching": {
        "max_queue_delay_microseconds": "max_queue_delay_microseconds is Triton's: nereid.yaml's is "
                                        "max_queue_delay_ms, in milliseconds (100 microseconds is 0.1)",
        "preferred_batch_size": "preferred_batch_size is Triton's: nereid.yaml's is preferred_batch_sizes, a list "
                                "of sizes",
    },
    "server": {
        "grpc_port": 'grpc_port is Triton\'s --grpc-port: nereid.yaml\'s is bind_addr, a host:port ("[::1]:8001"; '
                     "nereid serve --bind overrides it)",
        "http_port": 'http_port is Triton\'s --http-port: nereid.yaml\'s is http_addr, a host:port ("[::1]:8000"; '
                     "nereid serve --http-bind overrides it)",
        "metrics_port": "metrics_port is Triton's --metrics-port: nereid.yaml's is metrics_addr, a host:port "
                        '("127.0.0.1:8002"; nereid serve --metrics-bind overrides it)',
        "model_repository": "model_repository is Triton's --model-repository: nereid.yaml's is ml_backends_path",
    },
}


def yaml_key_hints(section: str) -> dict[str, str]:
    """For each key written as Triton names it in nereid.yaml's ``section`` (``model``: an entry of models:,
    ``batching``, ``server``), what to write instead: an unknown key's refusal adds it."""
    return dict(_YAML_KEYS.get(section, {}))


def folder_hint(folder: Path) -> str | None:
    """``it looks like a Triton model folder (...)`` when ``folder`` holds a config.pbtxt, or a version folder
    with a Triton model file (``1/model.onnx``: Triton completes the config of some backends itself); that its
    ``model.py`` is Triton's Python backend's file, under its name, where a python model's is main.py; else None.

    For a load error only where the folder explains it: no backend claimed it, or the backend lacks its file."""
    try:
        if (folder / "config.pbtxt").is_file():
            signs = [_looks_like("config.pbtxt")]
        else:
            signs = [_looks_like(file) for file in _version_folders(folder)[:1]]
        model_py = _triton_model_py(folder)
    except OSError:
        return None
    if model_py is not None:
        # (A Triton 1/model.py moved to the top, its name kept, got only "no backend claims the folder", or with
        # backend: python "missing main.py", not a word of the file there.)
        signs.append(f"model.py {model_py}, as Triton's Python backend's file does: the python backend's entry "
                     f"file is main.py (rename model.py to main.py), and {_PYTHON_CONTRACT}")
    return "; ".join(signs) or None


def _triton_model_py(folder: Path) -> str | None:
    """What shows a ``model.py`` at the top of ``folder`` is Triton's Python backend's (``names
    TritonPythonModel``), when the folder has no main.py and no manifest.yaml (a bundle's or meta model's
    model.py is theirs); else None. Raises OSError."""
    path = folder / "model.py"
    if not path.is_file() or any(os.path.lexists(folder / name) for name in ("main.py", "manifest.yaml")):
        return None
    with path.open("rb") as file:
        head = file.read(_MODEL_PY_READ_BYTES)
    return next((f"names {word.decode()}" for word in (b"triton_python_backend_utils", b"TritonPythonModel")
                 if word in head), None)


def leftovers_note(folder: Path) -> str | None:
    """What a folder that serves still holds of Triton's, which nothing reads, and where each setting goes here
    (``its config.pbtxt and version folders 1/, 2/ are not read, ...; remove them``); None when it holds none.

    Such a folder loaded READY without a word: Triton's instances, batching window and version policy silently
    dropped, and a version other than the one Triton served in use.
    """
    try:
        config = folder / "config.pbtxt"
        has_config = config.is_file()
        versions = _version_folders(folder)
    except OSError:
        return None
    if not has_config and not versions:
        return None
    folders = [file.split("/")[0] for file in versions]
    named = [f"{name}/" for name in folders[:_NAMED_VERSIONS]] + (
        [f"{len(folders) - _NAMED_VERSIONS} more"] if len(folders) > _NAMED_VERSIONS else [])
    what = [*(["config.pbtxt"] if has_config else []),
            *([f"version folder{'s' if len(folders) > 1 else ''} {', '.join(named)}"] if folders else [])]
    several = len(folders) + has_config > 1
    unread = []
    fields = [field for field in _config_fields(config) if field not in _MOOT_ONCE_SERVED] if has_config else []
    if fields:
        unread.append(f"its {_listed(f'{field} ({_TRITON_FIELDS[field]})' for field in fields)} "
                      f"{'do' if len(fields) > 1 else 'does'} not apply")
    if folders:
        unread.append(f"{', '.join(versions[:_NAMED_VERSIONS])} {'do' if len(folders) > 1 else 'does'} not run (the "
                      "model is the files at the top of its folder, its one version 1)")
    return (f"its {' and '.join(what)} {'are' if several else 'is'} not read{': ' if unread else ''}"
            f"{', and '.join(unread)}; remove {'them' if several else 'it'} ({COMING_FROM_TRITON})")


def _config_fields(config: Path) -> list[str]:
    """The Triton fields a config.pbtxt writes (none when it cannot be read: the note names the file alone)."""
    try:
        return triton_fields(read_text_file(config, _CONFIG_READ_BYTES))
    except (ConfigError, OSError):
        return []


def _listed(items: Iterable[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _version_folders(folder: Path) -> list[str]:
    """``1/model.onnx`` for each numbered folder of ``folder`` holding a Triton model file, in version order
    (among its first entries: a folder of thousands costs no more). Raises OSError."""
    found = []
    for entry in itertools.islice(folder.iterdir(), _SCANNED_ENTRIES):
        if entry.name.isdigit() and entry.is_dir():
            model_file = next((f.name for f in itertools.islice(entry.iterdir(), _SCANNED_ENTRIES)
                               if _TRITON_MODEL_FILE.match(f.name)), None)
            if model_file is not None:
                found.append((int(entry.name), f"{entry.name}/{model_file}"))
    return [file for _, file in sorted(found)]


def triton_fields(text: str) -> list[str]:
    """The fields of Triton's config.pbtxt that ``text`` writes (the keys of ``_TRITON_FIELDS``), each once, in
    order: a model's at the top level, an input's or output's (``optional``, ``reshape``) in those blocks.

    A scan of protobuf's tokens (comments skipped, strings whole), where protobuf's parser stops at the first
    field it does not know.
    """
    return _scan(text)[0]


def _scan(text: str) -> tuple[list[str], list[str]]:
    """``text``'s Triton fields (see :func:`triton_fields`) and Triton datatypes (``TYPE_FP32``, quoted or not, as a
    data_type's value), each once, in order."""
    tokenizer = text_format.Tokenizer(text.split("\n"))
    fields: dict[str, None] = {}
    datatypes: dict[str, None] = {}
    blocks: list[str] = []  # the field each open {} block is the value of, outermost first
    field = ""  # the last field name met: the one a block opened next (or a value) belongs to
    previous = ""
    while not tokenizer.AtEnd():
        token = tokenizer.token
        if token in (":", "{", "<", "[") and previous.isidentifier():
            field = previous
            if field in _TRITON_FIELDS and (field in _TENSOR_FIELDS) == (len(blocks) == 1) \
                    and (not blocks or blocks[0] in ("input", "output")):
                fields[field] = None
        elif previous == ":" and field == "data_type" and token.strip('"').startswith("TYPE_"):
            datatypes[token.strip('"')] = None
        if token in ("{", "<"):
            blocks.append(field)
        elif token in ("}", ">") and blocks:
            field = blocks.pop()  # (a list of blocks, input [ {...}, {...} ]: the next one is the same field's)
        previous = token
        tokenizer.NextToken()
    return list(fields), list(datatypes)


def _more_of_triton(text: str, said: str) -> str:
    """``; the text holds more of Triton's config.pbtxt, ...``: each Triton field and datatype of ``text`` but
    ``said`` (the one protobuf refused), with where it goes; "" when there is none.

    protobuf stops at the first field it does not know: a config.pbtxt copied as the textproto took a run of
    nereid check per field (seven for a typical one) to learn them all.
    """
    fields, datatypes = _scan(text) if text else ([], [])
    more = [f"{field} ({_TRITON_FIELDS[field]})" for field in fields if field != said]
    more += [f'data_type {name} (write "{_kserve_name(name)}")' for name in datatypes
             if name != said and _is_datatype(_kserve_name(name))]
    return f"; the text holds more of Triton's config.pbtxt, each refused in turn: {', '.join(more)}" if more else ""


def _kserve_name(triton_datatype: str) -> str:
    """KServe's name for a Triton datatype: TYPE_FP32 is FP32, TYPE_STRING is BYTES."""
    bare = triton_datatype.removeprefix("TYPE_")
    return "BYTES" if bare == "STRING" else bare


def _looks_like(sign: str) -> str:
    return (f"it looks like a Triton model folder ({sign}): nereid reads no config.pbtxt and no version folders; "
            f"{COMING_FROM_TRITON}")


def python_model_hint(sign: str = "") -> str:
    """What to tell of a ``main.py`` that ``sign`` shows is a model of Triton's Python backend (``imports
    triton_python_backend_utils``; no ``sign`` where the message names it already)."""
    return f"{f'main.py {sign}: ' if sign else ''}a model of Triton's Python backend? {_PYTHON_CONTRACT}"


def textproto_hint(problem: str, text: str = "") -> str:
    """What to add to protobuf's ``problem`` with a model_inference.textproto written as a config.pbtxt ("" when
    it is no such problem): a Triton field, or an unquoted ``TYPE_FP32``; and, given the file's ``text``, every
    other Triton field and datatype it holds, which protobuf would refuse one run at a time."""
    field = re.search(r'has no field named "(\w+)"', problem)
    if field is not None:
        where = _TRITON_FIELDS.get(field.group(1))
        if where is not None:
            return (f" ({field.group(1)} is a field of Triton's config.pbtxt: {where}"
                    f"{_more_of_triton(text, field.group(1))}; {COMING_FROM_TRITON})")
        return ""
    unquoted = re.search(r"Expected string but found: '(\w+)'", problem)
    if unquoted is not None:
        found = unquoted.group(1)
        # (The message names no field: a datatype's name unquoted is most likely data_type's, but say only what
        # holds for any string field.)
        hint = datatype_hint(found) or (f'a string is quoted: "{found}"' if _is_datatype(found) else "")
        more = _more_of_triton(text, found) if found.startswith("TYPE_") else ""
        return f" ({hint}{more}{f'; {COMING_FROM_TRITON}' if more else ''})" if hint else ""
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
