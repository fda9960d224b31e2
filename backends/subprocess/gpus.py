"""The GPUs a server may give its model programs, counted as CUDA would count them, without starting CUDA.

A model on ``cuda:<i>`` runs with ``CUDA_VISIBLE_DEVICES`` naming the i-th of
them (see :class:`~nereid.backends.subprocess.model.SubprocessModel`).
Starting CUDA in the server to ask would hold GPU memory there for every GPU
model, so the server's own ``CUDA_VISIBLE_DEVICES``, the NVIDIA driver's
/proc folder and the device nodes are read instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

# The NVIDIA kernel driver's folder of GPUs (one entry per GPU, under /proc), and WSL's GPU device (under /dev).
NVIDIA_GPUS_DIR = "driver/nvidia/gpus"
WSL_GPU_DEVICE = "dxg"
_GPU_NODE = re.compile(r"nvidia[0-9]+")  # /dev/nvidia0, ... (not nvidiactl, nvidia-uvm)


@dataclass(frozen=True)
class VisibleGpus:
    """The GPUs this server may give its programs, as told without initialising CUDA in the server."""

    count: int | None  # None: there are GPUs but nothing counts them (WSL)
    listed: tuple[str, ...] | None  # the server's CUDA_VISIBLE_DEVICES entries CUDA uses; None when it has none
    described: str  # what was found where, for messages ("... lists 2 GPU(s), cuda:0 to cuda:1")


@dataclass(frozen=True)
class CudaVisible:
    """What CUDA makes of a ``CUDA_VISIBLE_DEVICES`` value: the entries it uses, and why it used no more."""

    entries: tuple[str, ...]
    left_out: str = ""  # why entries were left out ("" when CUDA uses them all)


# The prefixes of the two non-index forms: a GPU's UUID (or its first characters) and a MIG instance.
_UUID_PREFIXES = ("GPU-", "MIG-")
# What C's strtoul reads of an entry, as CUDA does: leading blanks, an optional "+", digits; the rest is ignored.
_INDEX = re.compile(r"[ \t\n\r\f\v]*\+?([0-9]+)")


def parse_cuda_visible_devices(value: str, physical: int | None = None, source: str = "") -> CudaVisible:
    """The devices CUDA makes visible for ``value``, in order, as CUDA reads it.

    NVIDIA documents that CUDA uses the entries before the first invalid one
    (``0,2,-1,1`` shows 0 and 2; an empty value or ``-1`` shows none). Invalid
    is: an index of a GPU that is not there (``physical``: how many the driver
    has; None: unknown, no index is judged), an entry with no leading digits
    (CUDA reads an index as C's strtoul does: ``1a`` is 1), or, after a first
    UUID (``GPU-``) or MIG (``MIG-``) entry, an entry not of that form (the forms
    do not mix). An entry given twice makes CUDA show no GPU at all. The rules
    beyond NVIDIA's text are PyTorch's (``torch.cuda._parse_visible_devices``),
    written to count devices as the driver does. Indices come back as CUDA reads
    them (`` 07`` as ``7``), UUIDs and MIG ids as written (without blanks).
    ``source`` says where ``physical`` was read, for the reason an index is invalid.
    """
    entries: list[str] = []
    items = value.split(",")
    form = next((prefix for prefix in _UUID_PREFIXES if items[0].strip().startswith(prefix)), None)
    for item in items:
        if form is not None:
            entry = item.strip()
            if not entry.startswith(form):
                return CudaVisible(tuple(entries), f"CUDA ignores the entries from {item!r} on: after a "
                                                   f"{form}... entry only {form}... entries count")
        else:
            match = _INDEX.match(item)
            if match is None:
                return CudaVisible(tuple(entries), f"CUDA ignores the entries from {item!r} on, which is not a GPU "
                                                   "index")
            entry = str(int(match.group(1)))
            if physical is not None and int(entry) >= physical:
                return CudaVisible(tuple(entries), f"CUDA ignores the entries from {item!r} on: "
                                                   f"{source or f'the machine has {physical} GPU(s)'}")
        if entry in entries:
            return CudaVisible((), f"it lists {entry!r} twice, and CUDA then shows no GPU at all")
        entries.append(entry)
    return CudaVisible(tuple(entries))


def cuda_visible_entries(value: str, physical: int | None = None) -> tuple[str, ...]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value makes visible, in order (see :func:`parse_cuda_visible_devices`)."""
    return parse_cuda_visible_devices(value, physical).entries


def _driver_gpus(proc_root: Path, dev_root: Path) -> tuple[int | None, str] | None:
    """How many GPUs the NVIDIA driver has, and where that was read; (None, where) under WSL; None without a driver."""
    gpus = proc_root / NVIDIA_GPUS_DIR
    try:
        return len(os.listdir(gpus)), f"the NVIDIA driver's {gpus}"
    except OSError:  # no NVIDIA kernel driver loaded
        pass
    # A container set up without the driver's /proc folder (CDI, some runtimes) still has a device node per GPU.
    try:
        nodes = sum(1 for name in os.listdir(dev_root) if _GPU_NODE.fullmatch(name))
    except OSError:
        nodes = 0
    if nodes:
        return nodes, f"the device nodes {dev_root}/nvidia<N>"
    if os.path.exists(dev_root / WSL_GPU_DEVICE):
        return None, f"WSL's {dev_root / WSL_GPU_DEVICE} (its GPUs are not counted)"
    return None


def visible_gpus(environ: Mapping[str, str], proc_root: Path = Path("/proc"),
                 dev_root: Path = Path("/dev")) -> VisibleGpus:
    """Count the GPUs a server with environment ``environ`` may use (``proc_root``, ``dev_root``: /proc and /dev).

    The server's own ``CUDA_VISIBLE_DEVICES`` when it has one, read as CUDA reads
    it (see :func:`parse_cuda_visible_devices`: CUDA then numbers only the
    entries it uses, and an index the driver does not have ends them, when the
    driver's GPUs can be counted); else the
    NVIDIA driver's entries in /proc/driver/nvidia/gpus; else its device nodes
    /dev/nvidia<N>; else 0, unless WSL's /dev/dxg is there (its GPUs are not
    listed anywhere, so they are not counted). Nothing here starts CUDA, which
    would hold GPU memory in the server for every GPU model.
    """
    def lists(count: int) -> str:
        return f"lists {count} GPU(s), cuda:0 to cuda:{count - 1}" if count else "lists no GPU"

    driver = _driver_gpus(proc_root, dev_root)
    no_driver = f"no NVIDIA GPU driver on this machine ({proc_root / NVIDIA_GPUS_DIR} is missing)"
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        # Indices are judged only against GPUs counted: where none were found (WSL, or a driver whose files this
        # server cannot see) the scheduler that set the variable is trusted, and a run on a GPU that is not
        # there fails in the program, saying so.
        physical, where = driver if driver is not None else (None, "")
        visible = parse_cuda_visible_devices(value, physical, f"{where} lists {physical} GPU(s)")
        count = len(visible.entries)
        left_out = f" ({visible.left_out})" if visible.left_out and value.strip() else ""
        return VisibleGpus(count, visible.entries, f"the server's CUDA_VISIBLE_DEVICES={value!r} {lists(count)}"
                                                   f"{left_out}")
    if driver is None:
        return VisibleGpus(0, None, no_driver)
    count, where = driver
    return VisibleGpus(count, None, where if count is None else f"{where} {lists(count)}")
