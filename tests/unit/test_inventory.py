"""Node inventory from real file trees laid out like other machines, and from this one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram.node_agent.gpus import nvml_gpus
from tangram.node_agent.inventory import (
    InventoryError,
    cgroup_version,
    parse_cpulist,
    read_inventory,
)


def fake_node(
    root: Path,
    *,
    online: str,
    numa: dict[int, str],
    mem_kib: int = 16 * 1024 * 1024,
    cgroup: int = 2,
    machine_id: str | None = "abc123",
) -> Path:
    cpu = root / "sys/devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online + "\n")
    nodes = root / "sys/devices/system/node"
    nodes.mkdir(parents=True)
    (nodes / "online").write_text("0\n")  # a sibling file that is not a node directory
    for n, cpus in numa.items():
        (nodes / f"node{n}").mkdir()
        (nodes / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (root / "proc").mkdir()
    (root / "proc/meminfo").write_text(f"MemTotal:       {mem_kib} kB\nMemFree: 1 kB\n")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    if cgroup == 2:
        (cg / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    else:
        (cg / "cpuset").mkdir()
    (root / "etc").mkdir()
    if machine_id is not None:
        (root / "etc/machine-id").write_text(machine_id + "\n")
    return root


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0-3", [0, 1, 2, 3]), ("0,2,4-5", [0, 2, 4, 5]), ("7", [7]), ("", []), ("1-2,1", [1, 2])],
)
def test_parse_cpulist(text: str, cores: list[int]) -> None:
    assert parse_cpulist(text) == cores


@pytest.mark.parametrize("bad", ["a-b", "3-1", "1-"])
def test_parse_cpulist_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(bad)


def test_two_numa_nodes_with_an_offline_core(tmp_path: Path) -> None:
    root = fake_node(tmp_path, online="0-2,4-7", numa={0: "0-3", 1: "4-7"}, cgroup=1)
    inv = read_inventory(root, hostname="worker-1")
    assert inv.numa == [[0, 1, 2], [4, 5, 6, 7]]  # core 3 is offline
    assert inv.cores == [0, 1, 2, 4, 5, 6, 7]
    assert inv.memory_gb == pytest.approx(16.0)
    assert inv.cgroup_version == 1
    assert inv.node_id == "abc123" and inv.hostname == "worker-1"
    assert inv.gpus == []


def test_no_numa_directory_means_one_node_and_hostname_identity(tmp_path: Path) -> None:
    root = fake_node(tmp_path, online="0-3", numa={}, machine_id=None)
    inv = read_inventory(root, hostname="box")
    assert inv.numa == [[0, 1, 2, 3]]
    assert inv.cgroup_version == 2
    assert inv.node_id == "box"


def test_missing_files_are_named(tmp_path: Path) -> None:
    root = fake_node(tmp_path, online="0-1", numa={0: "0-1"})
    (root / "proc/meminfo").unlink()
    with pytest.raises(InventoryError, match="meminfo"):
        read_inventory(root, hostname="h")
    with pytest.raises(InventoryError, match="neither a cgroup v2 root"):
        cgroup_version(tmp_path / "nowhere")


def test_gpus_come_from_the_given_lister(tmp_path: Path) -> None:
    from tangram.api.inventory import GpuInfo

    root = fake_node(tmp_path, online="0", numa={0: "0"})
    gpu = GpuInfo(index=0, name="H100", uuid="GPU-1", memory_gb=80.0)
    assert read_inventory(root, hostname="h", gpus=lambda: [gpu]).gpus == [gpu]


def test_this_machine() -> None:
    inv = read_inventory()
    assert inv.cores and inv.memory_gb > 0
    assert inv.cgroup_version in (1, 2)
    assert read_inventory().node_id == inv.node_id  # stable


def test_without_a_driver_nvml_reports_no_gpus() -> None:
    # Whether nvidia-ml-py is missing or the driver is: no GPUs, and no exception.
    if Path("/dev/nvidiactl").exists():
        pytest.skip("an NVIDIA driver is present: the GPU tests cover nvml_gpus")
    assert nvml_gpus() == []


def test_allotments_share_an_environment_between_concurrent_actions() -> None:
    from tangram.node_agent.execution import Allotments

    a = Allotments()
    assert a.enter("env", [2], 1.0) == ([2], 1.0)
    assert a.enter("env", [0, 1], 2.0) == ([0, 1, 2], 3.0)
    assert a.leave("env", [2], 1.0) == ([0, 1], 2.0)
    assert a.leave("env", [0, 1], 2.0) is None  # the last one: back to idle
    assert a.leave("env", [0, 1], 2.0) is None  # leaving twice changes nothing
