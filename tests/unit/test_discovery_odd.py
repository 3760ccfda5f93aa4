"""Discovery on odd input: rows in another order or without uuids, a GPU name in a legacy
encoding, an nvidia-smi killed by a signal or saying why in several lines, sysfs files
that are not the kernel's usual text, unseen memory at the allowance, and simulated specs
written loosely.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery import infiniband, memory, simulated, smi

HW = Path(__file__).resolve().parents[1] / "fixtures" / "hw"
SMI = HW / "nvidia-smi"
VGPU = SMI / "h200-141c-vgpu-x4.query.csv"
NO_APPS = SMI / "h200-1gpu-580-llmgw.apps.csv"

# GPU0 and GPU1 joined by NVLink, GPU2 and GPU3 on PCIe only.
TOPOLOGY_4 = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\n"
    "GPU0\t X \tNV12\tSYS\tSYS\n"
    "GPU1\tNV12\t X \tSYS\tSYS\n"
    "GPU2\tSYS\tSYS\t X \tPIX\n"
    "GPU3\tSYS\tSYS\tPIX\t X \n"
)


@given(st.permutations(range(4)))
def test_rows_in_any_order_give_each_gpu_its_own_domain_and_memory(order: list[int]) -> None:
    """A GPU's NVLink domain and whether our engines hold it follow its index column, not
    the row's place in the output: the recorded vGPU guest's rows, in any order."""
    header, *rows = VGPU.read_text().splitlines(keepends=True)
    query = header + "".join(rows[i] for i in order)
    gpus = smi.gpus_from_smi(query, NO_APPS.read_text(), TOPOLOGY_4, own_gpus=frozenset({1}))
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.nvlink_domain for g in gpus] == [0, 0, None, None]
    assert [g.foreign_memory_mib for g in gpus] == [45662, 0, 137255, 111082]


def test_a_query_without_uuids_names_each_gpu_by_its_index() -> None:
    """The recorded RTX PRO 6000 rows carry no uuid: each GPU still gets one of its own."""
    header = "index, name, memory.total [MiB]\n"
    gpus = smi.gpus_from_smi(header + (SMI / "rtxpro6000-maxq-x2.noheader.csv").read_text())
    assert [g.uuid for g in gpus] == ["GPU-index-0", "GPU-index-1"]


def test_a_topology_row_of_a_gpu_missing_from_its_header_is_left_out() -> None:
    """A row for GPU2 under a header that names GPU0 and GPU1 only (output cut or wrapped):
    the GPUs the header names keep their domain, and the parse is not a KeyError."""
    topo = "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \nGPU2\tNV4\tNV4\t X \n"
    assert smi.parse_topology(topo) == {0: 0, 1: 0}


def test_a_topology_header_in_ansi_escapes_still_names_every_gpu() -> None:
    """The 590 driver underlines `topo -m`'s header (recorded in h100-sxm-1gpu-590.topo.txt):
    the two NVLinked GPUs of the recorded DL380a, with that header, share one domain."""
    header, *rows = (SMI / "h100-pcie-x2-nvlink-dl380ag11.topo.txt").read_text().splitlines()
    underlined = "\n".join([f"\t\x1b[4m{header.lstrip()}\x1b[0m", *rows])
    assert smi.parse_topology(underlined) == {0: 0, 1: 0}


def test_blank_lines_are_no_rows_and_a_field_past_csvs_limit_is_an_smi_error() -> None:
    query = (SMI / "h200-1gpu-590.query.csv").read_text()
    assert smi.gpus_from_smi(query.replace("\n", "\n\n")) == smi.gpus_from_smi(query)
    # Python's csv refuses a field over 128 KiB: before, csv.Error escaped the refresh.
    with pytest.raises(smi.SmiError, match="not CSV"):
        smi.gpus_from_smi("index, name, memory.total [MiB]\n0, " + "H" * 200_000 + ", 1\n")


def test_an_nvidia_smi_that_closes_its_output_and_hangs_is_killed() -> None:
    """Its streams at end of file is not its exit: the wait for its status is bounded too."""
    hang = (sys.executable, "-c", "import os, time; os.close(1); os.close(2); time.sleep(120)")
    began = time.monotonic()
    with pytest.raises(smi.SmiError, match="did not answer"):
        smi.run(hang, timeout_s=0.5)
    assert time.monotonic() - began < 60  # generous: the command sleeps 120 s


def test_a_gpu_name_in_a_legacy_encoding_is_read_not_a_crash() -> None:
    """nvidia-smi printing a byte that is not UTF-8 (a Latin-1 board name): before, the
    discovery raised UnicodeDecodeError, which the heartbeat's refresh does not expect."""
    script = (
        "import sys; sys.stdout.buffer.write(b'index, uuid, name, memory.total [MiB]\\n"
        "0, GPU-0, NVIDIA RTX A6000 \\xc9dition, 49140 MiB\\n')"
    )
    (gpu,) = smi.gpus_from_smi(smi.run((sys.executable, "-c", script)))
    assert gpu.name == "NVIDIA RTX A6000 \ufffddition"
    assert gpu.memory_mib == 49140


def test_an_nvidia_smi_killed_by_a_signal_is_an_error_not_its_partial_output() -> None:
    """A crash or the OOM killer ends nvidia-smi after part of its rows: its status is
    negative, and what it printed is not the node's GPUs."""
    script = (
        "import os, signal, sys\n"
        "print('index, uuid, name, memory.total [MiB]'); sys.stdout.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with pytest.raises(smi.SmiError, match="was killed by signal 9"):
        smi.run((sys.executable, "-c", script))


def test_a_failed_nvidia_smi_keeps_the_cause_it_prints_first() -> None:
    """nvidia-smi after a driver upgrade prints the cause, then the library's version: the
    error kept only the last line ("NVML library version: 570.124"), which hides the cause."""
    mismatch = (
        "import sys\n"
        "print('Failed to initialize NVML: Driver/library version mismatch')\n"
        "print('NVML library version: 570.124'); sys.exit(18)\n"
    )
    with pytest.raises(smi.SmiError) as failed:
        smi.run((sys.executable, "-c", mismatch))
    assert str(failed.value).endswith(
        "exited with 18: Failed to initialize NVML: Driver/library version mismatch"
        " / NVML library version: 570.124"
    )
    # A long output keeps its first and last lines, and stays short.
    chatty = "import sys; [print(f'line {i} ' + 'x' * 300, file=sys.stderr) for i in range(9)]; "
    with pytest.raises(smi.SmiError) as failed:
        smi.run((sys.executable, "-c", chatty + "sys.exit(1)"))
    detail = str(failed.value).split("exited with 1: ", 1)[1]
    assert detail.startswith("line 0 ")
    assert len(detail) == smi.MAX_DETAIL
    with pytest.raises(smi.SmiError, match=r"exited with 4: no output$"):
        smi.run((sys.executable, "-c", "import sys; sys.exit(4)"))


@pytest.mark.parametrize(
    ("unseen", "foreign"),
    [(memory.UNSEEN_ALLOWANCE_MIB, 0), (memory.UNSEEN_ALLOWANCE_MIB + 1, 1025)],
)
def test_unseen_memory_is_foreign_only_above_the_allowance(unseen: int, foreign: int) -> None:
    """Memory.used that no process accounts for: up to the allowance it is the driver's own
    (an idle board shows some), one MiB more is another tenant's."""
    assert memory.UNSEEN_ALLOWANCE_MIB == 1024
    query = "index, uuid, name, memory.total [MiB], memory.used [MiB]\n"
    query += f"0, GPU-0, NVIDIA H200, 143771 MiB, {unseen + 300} MiB\n"
    apps = "gpu_uuid, pid, used_gpu_memory [MiB]\nGPU-0, 4242, 300 MiB\n"
    (gpu,) = smi.gpus_from_smi(query, apps, own_pids=frozenset({4242}))
    assert gpu.foreign_memory_mib == foreign


# --------------------------------------------------------------------------- sysfs


def _port(root: Path, device: str, port: str, **files: bytes) -> None:
    folder = root / device / "ports" / port
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def test_sysfs_text_other_than_the_kernels_usual_reads_as_meant(tmp_path: Path) -> None:
    """A state without its numeric code, a fractional rate (the kernel prints SDR's 1X as
    2.5 Gb/sec), a rate and a port number at the log's bounds, a file holding bytes that
    are not UTF-8, and one that cannot be read: none is a crash of the heartbeat's refresh."""
    _port(tmp_path, "mlx4_0", "1", state=b"ACTIVE\n", rate=b"2.5 Gb/sec (1X SDR)\n")
    _port(tmp_path, "mlx5_0", "256", state=b"4: ACTIVE\n", rate=b"10000000 Gb/sec (4X)\n")
    _port(tmp_path, "mlx5_0", "257", state=b"4: ACTIVE\n")
    _port(tmp_path, "mlx5_1", "1", state=b"1: DOWN\n", link_layer=b"Ether\xffnet\n")
    # A file that cannot be read (here a folder; sysfs answers EINVAL for some states).
    _port(tmp_path, "mlx5_2", "1", state=b"4: ACTIVE\n")
    (tmp_path / "mlx5_2" / "ports" / "1" / "rate").mkdir()
    hcas = infiniband.read_hcas(tmp_path)
    assert [(h.name, h.port, h.state, h.rate_gbps) for h in hcas] == [
        ("mlx4_0", 1, "ACTIVE", 2.5),
        ("mlx5_0", 256, "ACTIVE", infiniband.MAX_RATE_GBPS),
        ("mlx5_1", 1, "DOWN", 0.0),
        ("mlx5_2", 1, "ACTIVE", 0.0),
    ]
    assert hcas[2].link_layer == "Ether\ufffdnet"


# --------------------------------------------------------------------------- simulated


def test_a_simulated_spec_may_be_written_in_capitals_and_with_spaces() -> None:
    gpus = simulated.parse_spec("8xH100-80G, 2 x l40s-45g")
    assert [g.gpu_class for g in gpus] == ["h100-80g"] * 8 + ["l40s-45g"] * 2
    # A family llmgw has no capability for gets Hopper's, not an empty one that refuses fp8.
    (unknown,) = simulated.parse_spec("1xmi300-192g")
    assert (unknown.gpu_class, unknown.compute_capability) == ("mi300-192g", "9.0")


def test_a_simulated_group_holds_at_most_64_gpus() -> None:
    assert len(simulated.parse_spec("64xh100-80g")) == 64
    with pytest.raises(simulated.SimSpecError, match="count must be 1-64"):
        simulated.parse_spec("65xh100-80g")


def test_a_simulated_inventory_file_without_a_suffix_or_content(tmp_path: Path) -> None:
    """A file is read as an inventory whatever its name; an empty one has no GPUs."""
    named = tmp_path / "inventory"
    named.write_text("gpus:\n  - {index: 0, uuid: GPU-a, name: NVIDIA L4, gpu_class: l4-23g,"
                     " memory_mib: 23034, compute_capability: '8.9'}\n")  # fmt: skip
    assert [g.uuid for g in simulated.load(str(named)).gpus] == ["GPU-a"]
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert simulated.load(str(empty)).gpus == ()
