"""The GPUs a server may give its programs: its CUDA_VISIBLE_DEVICES read as CUDA reads it, else the driver's."""

from __future__ import annotations

import pytest

from nereid.backends.subprocess.gpus import cuda_visible_entries, visible_gpus

from support import fake_gpu_machine as machine


def test_visible_gpus_counts_the_servers_list_else_the_drivers_gpus(tmp_path) -> None:
    two = machine(tmp_path / "two", gpus=2)
    found = visible_gpus({}, two / "proc", two / "dev")
    assert (found.count, found.listed) == (2, None)
    assert found.described == f"the NVIDIA driver's {two}/proc/driver/nvidia/gpus lists 2 GPU(s), cuda:0 to cuda:1"
    # The server's own list wins (a scheduler gave it those); UUIDs and MIG ids pass through as written.
    listed = visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5f1c, GPU-7e2a"}, two / "proc", two / "dev")
    assert (listed.count, listed.listed) == (2, ("GPU-5f1c", "GPU-7e2a"))
    mig = visible_gpus({"CUDA_VISIBLE_DEVICES": "MIG-GPU-5f1c/1/0"}, two / "proc", two / "dev")
    assert (mig.count, mig.listed) == (1, ("MIG-GPU-5f1c/1/0",))
    for hidden in ("", "-1", "-1,0"):  # CUDA stops at the first entry it cannot use
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": hidden}, two / "proc", two / "dev").count == 0
    bare = machine(tmp_path / "bare")
    missing = visible_gpus({}, bare / "proc", bare / "dev")
    assert (missing.count, missing.described) == (0, "no NVIDIA GPU driver on this machine "
                                                     f"({bare}/proc/driver/nvidia/gpus is missing)")
    wsl = machine(tmp_path / "wsl", wsl=True)
    assert visible_gpus({}, wsl / "proc", wsl / "dev").count is None  # GPUs there, but nothing counts them
    # A container without the driver's /proc folder (CDI) still has a device node per GPU.
    nodes = machine(tmp_path / "nodes")
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (nodes / "dev" / name).touch()
    counted = visible_gpus({}, nodes / "proc", nodes / "dev")
    assert (counted.count, counted.described) == (3, f"the device nodes {nodes}/dev/nvidia<N> lists 3 GPU(s), "
                                                      "cuda:0 to cuda:2")


@pytest.mark.parametrize("value, physical, entries", [
    ("0,2,-1,1", 4, ("0", "2")),  # NVIDIA's own example: the entries before the first invalid one
    ("0,1,7,2", 4, ("0", "1")),  # 7: no such GPU on a 4-GPU machine, and CUDA uses nothing from there on
    ("0,1,7,2", None, ("0", "1", "7", "2")),  # the GPUs cannot be counted (WSL): no index is judged
    ("2,1", 4, ("2", "1")),
    ("1,x,2", 4, ("1",)),  # not an index
    (" 3, +1,02,0gpu", 4, ("3", "1", "2", "0")),  # read as C's strtoul reads it: "0gpu" is 0
    ("0,0", 4, ()),  # an entry given twice: CUDA shows no GPU at all
    ("1,2,01", 4, ()),
    ("GPU-5f1c,GPU-7e2a,GPU-5f1c", None, ()),
    ("5,GPU-7e2a", 8, ("5",)),  # the forms do not mix
    ("GPU-5f1c,3", 8, ("GPU-5f1c",)),
    ("GPU-5f1c,MIG-GPU-5f1c/1/0", 8, ("GPU-5f1c",)),
    ("", 4, ()), ("-1", 4, ()), (",0", 4, ()),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(tmp_path, value, physical, entries) -> None:
    """Defect: the count went on past entries CUDA stops at (an index the machine does not have, an entry that is no
    index) and counted a GPU given twice twice, where CUDA then shows none: a model loaded on a GPU its program would
    not see."""
    root = machine(tmp_path, wsl=True) if physical is None else machine(tmp_path, gpus=physical)
    found = visible_gpus({"CUDA_VISIBLE_DEVICES": value}, root / "proc", root / "dev")
    assert (found.count, found.listed) == (len(entries), entries)
    assert cuda_visible_entries(value, physical) == entries


def test_the_visible_gpus_stop_where_cuda_stops_and_say_why(tmp_path) -> None:
    two = machine(tmp_path / "two", gpus=2)
    gpus = two / "proc" / "driver" / "nvidia" / "gpus"
    stopped = visible_gpus({"CUDA_VISIBLE_DEVICES": "1,5,0"}, two / "proc", two / "dev")
    assert (stopped.count, stopped.listed) == (1, ("1",))
    assert stopped.described == ("the server's CUDA_VISIBLE_DEVICES='1,5,0' lists 1 GPU(s), cuda:0 to cuda:0 (CUDA "
                                 f"ignores the entries from '5' on: the NVIDIA driver's {gpus} lists 2 GPU(s))")
    twice = visible_gpus({"CUDA_VISIBLE_DEVICES": "1,1"}, two / "proc", two / "dev")
    assert (twice.count, twice.described) == (0, "the server's CUDA_VISIBLE_DEVICES='1,1' lists no GPU (it lists "
                                                 "'1' twice, and CUDA then shows no GPU at all)")
    # No GPUs counted (WSL, or driver files this server cannot see): the scheduler's indices are taken as they are.
    for root in (machine(tmp_path / "bare"), machine(tmp_path / "wsl", wsl=True)):
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,3"}, root / "proc", root / "dev").count == 2
