"""Which safetensors files hold a bundle's weights, and which tensor each contributes.

A bundle's weights are one file, or shards:

* ``manifest.yaml``'s ``weights_file``, when set: that one file;
* ``weights.safetensors.index.json``: its ``weight_map`` (tensor name -> file)
  says which shard holds each tensor. A tensor the map names but its file
  lacks fails the load, naming both. An index that is not valid JSON, or has
  no ``weight_map``, is ignored with a warning (the fallback below); any other
  problem in it (a shard that is not there, a map that is not names to files)
  fails the load;
* ``weights.safetensors``, when there is no index (the single-file bundle);
* otherwise every ``*.safetensors`` file of the folder in name order, the
  first occurrence of a tensor name winning.

The program's argument order is the index's ``metadata.argument_order`` when
present (a list of every tensor name, once each); otherwise the files in name
order, each in its own order (its ``argument_order`` metadata, else the order
of its data). All files must use one layout (``axis_order: xla`` or legacy).

The rules are those the streaming safetensors loaders use for
``model.safetensors.index.json`` and ``*.safetensors``. They are written
against :class:`BundleFiles`, so a bundle in a local folder and one in an
object store resolve the same way.

A local file's header and its data are read through one descriptor, held by
the weight set from the header's read until its data is read (one per
shard), so a file replaced meanwhile (an atomic redeploy, a migration's
``replace``) is read whole as it was when its header was read (unlinked but
open): never that header's offsets applied to its successor's bytes.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from nereid.backends.xla.bundle import DEFAULT_WEIGHTS_FILE
from nereid.backends.xla.manifest import CURRENT_FORMAT_VERSION, MANIFEST_NAME, Manifest
from nereid.backends.xla.safetensors import (DEFAULT_CHUNK_BYTES, DEFAULT_READ_THREADS, SafetensorsHeader,
                                             TensorEntry, empty_for, open_weights_file, read_entries_into,
                                             read_header_fd, to_program_array)
from nereid.errors import ConfigError, cap_message
from nereid.files import not_regular_reason

log = logging.getLogger(__name__)

INDEX_FILE = "weights.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"
# An index lists names and file names; 16 MiB is about 150,000 tensors, as for a header.
MAX_INDEX_BYTES = 16 * 1024 * 1024


class OpenWeightFiles:
    """The weights files a load read the headers of, each held open (one descriptor) until its data is read.

    Closed by :meth:`close` (what reads the data calls it); one nobody closed (a weight set looked at and
    dropped) is closed when it is collected, as a Python file object is.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, SafetensorsHeader]] = {}

    def held(self, name: str) -> tuple[int, SafetensorsHeader] | None:
        """The descriptor of file ``name`` and the header read through it; None when it is not held."""
        return self._held.get(name)

    def hold(self, name: str, fd: int, header: SafetensorsHeader) -> None:
        """Keep ``fd`` (now owned here), through which ``header`` was read, for the data of file ``name``."""
        self._held[name] = (fd, header)

    def close(self) -> None:
        """Close every held descriptor (again: nothing)."""
        while self._held:
            _, (fd, _) = self._held.popitem()
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # (at interpreter exit os may be gone: the descriptors go with the process)
            pass


class BundleFiles(Protocol):
    """The files of one bundle folder, wherever it lives."""

    def names(self) -> list[str]:
        """The names of the entries directly in the folder, of any type: one that should be a weights file and is
        a folder or a FIFO is named as such when it is read (left out, it was skipped without a word)."""

    def where(self, name: str) -> str:
        """The file's path or URL, for messages."""

    def read_small(self, name: str, limit: int) -> bytes:
        """A small file's bytes; ConfigError when it holds more than ``limit`` bytes."""

    def header(self, name: str) -> SafetensorsHeader:
        """The validated safetensors header of a file."""

    @property
    def opened(self) -> OpenWeightFiles:
        """The local files :meth:`header` read, held open for their data (see :class:`OpenWeightFiles`)."""


class LocalBundleFiles:
    """A bundle in a local folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._opened = OpenWeightFiles()

    @property
    def opened(self) -> OpenWeightFiles:
        return self._opened

    def names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.folder.iterdir())
        except OSError as err:
            raise ConfigError(f"{self.folder}: cannot list: {err.strerror or err}") from None

    def where(self, name: str) -> str:
        return str(self.folder / name)

    def read_small(self, name: str, limit: int) -> bytes:
        path = self.folder / name
        if (reason := not_regular_reason(path)) is not None:
            raise ConfigError(reason)
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
        if len(data) > limit:
            raise ConfigError(f"{path}: larger than {limit} bytes")
        return data

    def header(self, name: str) -> SafetensorsHeader:
        """The header of file ``name``, read through a descriptor that is kept for its data (its header is read
        once: asked again, the same one)."""
        held = self._opened.held(name)
        if held is not None:
            return held[1]
        path = self.folder / name
        if (reason := not_regular_reason(path)) is not None:
            raise ConfigError(reason)
        fd = open_weights_file(path)
        try:
            header = read_header_fd(fd, path)
        except BaseException:
            os.close(fd)
            raise
        self._opened.hold(name, fd, header)
        return header


@dataclass(frozen=True)
class Weight:
    """One program weight: its tensor in one file."""

    file: str
    header: SafetensorsHeader
    entry: TensorEntry

    @property
    def program_shape(self) -> tuple[int, ...]:
        """The shape the program sees."""
        return self.header.program_shape(self.entry)


@dataclass(frozen=True)
class WeightSet:
    """A bundle's weights in argument order, and the files they come from (in name order)."""

    files: tuple[str, ...]
    weights: tuple[Weight, ...]
    index: str | None = None  # the index file, when the weight map came from one
    # The local files whose headers these are, held open for their data (read_local_into reads through them).
    opened: OpenWeightFiles | None = field(default=None, compare=False, repr=False)
    # The original weights file a migrated bundle falls back to, its copy stale (see migration.weights_to_load).
    fallback: bool = False

    def close(self) -> None:
        """Close the files held open for the data (done once it is read; again: nothing)."""
        if self.opened is not None:
            self.opened.close()

    @property
    def legacy(self) -> bool:
        """True for the legacy (column-major header shape) layout."""
        return bool(self.weights) and self.weights[0].header.legacy

    @property
    def nbytes(self) -> int:
        """The weights' data, in bytes."""
        return sum(w.entry.nbytes for w in self.weights)

    def describe(self) -> str:
        """``weights.safetensors``, or ``3 shards (weights.safetensors.index.json)``, for messages."""
        if len(self.files) == 1 and self.index is None:
            return self.files[0]
        source = self.index or "*.safetensors in name order"
        return f"{len(self.files)} shard(s) ({source})"


def single_file(files: BundleFiles, name: str) -> WeightSet:
    """The weights of one file."""
    header = files.header(name)
    return WeightSet((name,), tuple(Weight(name, header, e) for e in header.tensors))


def format_layout_problem(manifest: Manifest, weight_set: WeightSet | None) -> str | None:
    """Why a format 2.1 manifest's own weights in the legacy layout (no ``axis_order``) are refused; None when
    they are not such.

    2.1 says its weights are in program order (what the exporter and the migration write); a file written by
    another tool (the safetensors package, torch) has no ``axis_order`` and was read in the legacy layout: a
    square weight (any d x d layer) passed every shape check transposed, and the model answered wrong numbers,
    OK (the XLA read hunt). A migrated bundle falling back to its original legacy file (its copy stale) is the
    migration's rule, and loads: the file loaded is then another than the ``weights_file`` the manifest names
    (the review hunt: any ``weights_file`` was exempt, ``v2/weights.safetensors`` written by the safetensors
    package too, and answered transposed).
    """
    if (manifest.format_version != CURRENT_FORMAT_VERSION or weight_set is None or not weight_set.legacy
            or weight_set.fallback):  # (told by the fallback itself: ./weights.safetensors named no other file)
        return None
    return (f"{weight_set.describe()}: no axis_order in its metadata, so it would be read in the legacy layout "
            f"(column-major shapes), but {MANIFEST_NAME} says format_version \"{CURRENT_FORMAT_VERSION}\", whose "
            "weights are in the program's order: add {\"axis_order\": \"xla\"} to its metadata if its shapes are "
            "the program's, with {\"argument_order\": \"[...]\"}, the weights' names in the program's order as a "
            "JSON list (safetensors' save_file(..., metadata=...) writes them sorted by dtype and name, and weights "
            "of one shape would be passed swapped, unseen), or write it with "
            "nereid.backends.xla.export.write_safetensors")


def resolve_weights(files: BundleFiles, weights_file: str | None = None) -> WeightSet | None:
    """A bundle's weights by the rules above (None: the bundle has no weights file at all).

    ``weights_file`` is the manifest's (or the migration's choice): then only that file. The local files
    whose headers were read stay open, held by the set, until :func:`read_local_into` (or the set's
    ``close``) closes them.
    """
    try:
        weight_set = _resolve(files, weights_file)
    except BaseException:
        files.opened.close()
        raise
    if weight_set is None:
        files.opened.close()
        return None
    return replace(weight_set, opened=files.opened)


def _resolve(files: BundleFiles, weights_file: str | None) -> WeightSet | None:
    if weights_file is not None:
        return single_file(files, weights_file)
    names = files.names()
    if INDEX_FILE in names:
        weight_map = _read_index(files)
        if weight_map is not None:
            return _from_index(files, *weight_map)
    elif DEFAULT_WEIGHTS_FILE in names:
        return single_file(files, DEFAULT_WEIGHTS_FILE)
    shards = sorted(n for n in names if n.endswith(WEIGHTS_SUFFIX) and not n.startswith("."))
    if not shards:
        return None
    return _from_pattern(files, shards)


def _read_index(files: BundleFiles) -> tuple[dict[str, str], list[str] | None] | None:
    """The index's weight map and argument order; None (after a warning) when it is undecodable."""
    where = files.where(INDEX_FILE)
    raw = files.read_small(INDEX_FILE, MAX_INDEX_BYTES)
    try:
        document = json.loads(raw.decode("utf-8"))
        weight_map = document["weight_map"]
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as err:
        log.warning("%s: cannot be decoded (%s: %s); reading every *.safetensors file in name order instead",
                    where, type(err).__name__, cap_message(str(err), 200))
        return None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ConfigError(f"{where}: weight_map: must map tensor names to file names, got "
                          f"{cap_message(repr(weight_map), 200)}")
    metadata = document.get("metadata") or {}
    order = metadata.get("argument_order") if isinstance(metadata, dict) else None
    if isinstance(order, str):  # also accepted as a JSON string, as in a safetensors header
        try:
            order = json.loads(order)
        except (ValueError, RecursionError):  # (nested past the parser's depth): refused below, as any string
            pass
    if order is not None and (not isinstance(order, list) or not all(isinstance(n, str) for n in order)):
        raise ConfigError(f"{where}: metadata.argument_order: must be a list of tensor names, got "
                          f"{cap_message(repr(order), 200)}")
    return weight_map, order


def _from_index(files: BundleFiles, weight_map: dict[str, str], order: list[str] | None) -> WeightSet:
    where = files.where(INDEX_FILE)
    present = set(files.names())
    by_file: dict[str, list[str]] = {}
    for tensor, file in weight_map.items():
        by_file.setdefault(file, []).append(tensor)
    for file in sorted(by_file):
        if "/" in file or file.startswith(".") or file not in present:
            raise ConfigError(f"{where}: weight_map: tensor '{by_file[file][0]}' is in {file!r}, which is not a "
                              f"file of the bundle")
    headers = {file: files.header(file) for file in sorted(by_file)}
    weights: dict[str, Weight] = {}
    for file, header in headers.items():
        entries = {e.name: e for e in header.tensors}
        for tensor in by_file[file]:
            if tensor not in entries:
                raise ConfigError(f"{files.where(file)}: has no tensor '{tensor}', which {INDEX_FILE} places in it "
                                  f"(the file holds {len(entries)} tensor(s))")
            weights[tensor] = Weight(file, header, entries[tensor])
    if order is None:  # the files in name order, each in its own argument order
        ordered = [weights[e.name] for file, header in headers.items() for e in header.tensors
                   if weight_map.get(e.name) == file]
    else:
        ordered = _ordered(where, "metadata.argument_order", order, weights)
    return _checked(files, WeightSet(tuple(headers), tuple(ordered), INDEX_FILE))


def _ordered(where: str, key: str, order: list[str], weights: dict[str, Weight]) -> list[Weight]:
    duplicates = sorted(n for n, count in Counter(order).items() if count > 1)
    unknown = [n for n in order if n not in weights]
    listed = set(order)
    missing = [n for n in weights if n not in listed]
    if duplicates or unknown or missing:
        raise ConfigError(cap_message(f"{where}: {key}: must name every tensor of the weight map exactly once; "
                                      f"twice: {duplicates}, not in the map: {unknown}, omitted: {missing}"))
    return [weights[n] for n in order]


def _from_pattern(files: BundleFiles, shards: Sequence[str]) -> WeightSet:
    weights: dict[str, Weight] = {}
    used: list[str] = []
    for file in shards:
        header = files.header(file)
        used.append(file)
        for entry in header.tensors:
            if entry.name in weights:
                log.info("%s: tensor '%s' also in %s; the first occurrence (%s) is kept", files.where(file),
                         entry.name, file, weights[entry.name].file)
                continue
            weights[entry.name] = Weight(file, header, entry)
    return _checked(files, WeightSet(tuple(used), tuple(weights.values())))


def _checked(files: BundleFiles, weight_set: WeightSet) -> WeightSet:
    layouts = {w.file: w.header.legacy for w in weight_set.weights}
    if len(set(layouts.values())) > 1:
        legacy = sorted(f for f, is_legacy in layouts.items() if is_legacy)
        xla = sorted(f for f, is_legacy in layouts.items() if not is_legacy)
        raise ConfigError(f"{files.where(weight_set.files[0])}: the weight files mix layouts: {xla} are "
                          f"axis_order: xla, {legacy} legacy; all shards of a bundle must use one")
    return weight_set


def read_local_weights(folder: Path, weight_set: WeightSet, *, threads: int = DEFAULT_READ_THREADS,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, np.ndarray]]:
    """Read every weight of a local bundle with ``pread`` into fresh arrays, in argument order (through the
    files the set holds open, which are then closed)."""
    arrays = [empty_for(w.entry) for w in weight_set.weights]
    try:
        read_local_into(folder, list(zip(weight_set.weights, arrays)), threads=threads, chunk_bytes=chunk_bytes,
                        opened=weight_set.opened)
    finally:
        weight_set.close()
    return [(w.entry.name, to_program_array(array, w.header.legacy)) for w, array in zip(weight_set.weights, arrays)]


def read_local_into(folder: Path, targets: Sequence[tuple[Weight, np.ndarray]], *,
                    threads: int = DEFAULT_READ_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    opened: OpenWeightFiles | None = None) -> None:
    """Read each weight from its file in ``folder`` (``pread``, in parallel) into the array paired with it.

    A file ``opened`` holds is read through the descriptor its header was read through (the weight's header
    must be that one); any other is opened by its path.
    """
    by_file: dict[str, tuple[list[TensorEntry], list[np.ndarray]]] = {}
    fds: dict[Path, int] = {}
    for weight, array in targets:
        entries, arrays = by_file.setdefault(weight.file, ([], []))
        entries.append(weight.entry)
        arrays.append(array)
        held = opened.held(weight.file) if opened is not None else None
        if held is not None and held[1] is weight.header:
            fds[Path(folder) / weight.file] = held[0]
    read_entries_into([(Path(folder) / file, entries, arrays) for file, (entries, arrays) in by_file.items()],
                      threads=threads, chunk_bytes=chunk_bytes, opened=fds)
