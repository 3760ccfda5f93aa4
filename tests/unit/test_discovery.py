"""Discovery parses the recorded nvidia-smi outputs and sysfs trees in tests/fixtures/hw."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent import discovery
from llmgw.agent.discovery import infiniband, simulated, smi
from llmgw.core.inventory import Gpu, Hca
from llmgw.core.limits import MAX_GPUS

HW = Path(__file__).resolve().parents[1] / "fixtures" / "hw"
SMI = HW / "nvidia-smi"
DERIVED = HW / "derived"


def read(path: Path) -> str:
    return path.read_text()


@pytest.mark.parametrize(
    ("fixture", "name", "gpu_class", "cc", "memory"),
    [
        ("h100-sxm-1gpu-590.query.csv", "NVIDIA H100 80GB HBM3", "h100-80g", "9.0", 81559),
        ("h200-1gpu-590.query.csv", "NVIDIA H200", "h200-140g", "9.0", 143771),
        ("l40s-1gpu-595.query.csv", "NVIDIA L40S", "l40s-45g", "8.9", 46068),
        (
            "rtx2080super-linux-610.query.csv",
            "NVIDIA GeForce RTX 2080 SUPER",
            "rtx2080super-8g",
            "7.5",
            8192,
        ),
        (
            "rtx4080super-linux-595.query.csv",
            "NVIDIA GeForce RTX 4080 SUPER",
            "rtx4080super-16g",
            "8.9",
            16376,
        ),
    ],
)
def test_query_csv_of_each_gpu_model(
    fixture: str, name: str, gpu_class: str, cc: str, memory: int
) -> None:
    (gpu,) = smi.gpus_from_smi(read(SMI / fixture))
    assert (gpu.index, gpu.name, gpu.gpu_class, gpu.compute_capability) == (0, name, gpu_class, cc)
    assert gpu.memory_mib == memory
    # "[N/A]" ECC on consumer cards reads as no errors, not as a parse failure.
    assert gpu.ecc_uncorrected == 0
    assert gpu.healthy


def test_multi_gpu_csv_with_partial_fields() -> None:
    gpus = smi.gpus_from_smi(read(SMI / "a10g-x4-aws.query.csv"))
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.gpu_class for g in gpus} == {"a10g-22g"}
    # No compute_cap column: unknown, which refuses fp8 later rather than guessing.
    assert {g.compute_capability for g in gpus} == {""}


def test_mixed_gpu_models_on_one_node() -> None:
    gpus = smi.gpus_from_smi(read(SMI / "mixed-rtx4080super-rtx3090.query.csv"))
    assert [g.gpu_class for g in gpus] == ["rtx4080super-16g", "rtx3090-24g"]
    assert gpus[1].uuid == "GPU-358353dd-5933-1dc6-ac0d-e1189b063e4c"


def test_csv_without_index_counts_rows() -> None:
    gpus = smi.gpus_from_smi(read(SMI / "a100-pcie-40gb-x2-dl380g11.query.csv"))
    assert [(g.index, g.gpu_class) for g in gpus] == [(0, "a100-40g"), (1, "a100-40g")]


def test_mig_enabled_gpu_is_left_out_with_a_warning() -> None:
    query = read(SMI / "h100-sxm-mig-590.query.csv")
    assert smi.gpus_from_smi(query) == ()
    (warning,) = smi.mig_warnings(query)
    assert warning.startswith("GPU 0 (NVIDIA H100 80GB HBM3) has MIG enabled and is left out")
    assert smi.mig_warnings(read(SMI / "h100-sxm-1gpu-590.query.csv")) == []


def test_ecc_faulty_gpu_is_unhealthy() -> None:
    (gpu,) = smi.gpus_from_smi(read(DERIVED / "h100-sxm-1gpu-590.ecc-faulty.query.csv"))
    assert gpu.ecc_uncorrected == 2
    assert not gpu.healthy
    assert gpu.health_problems == ("uncorrected ECC errors (2)",)


def test_foreign_compute_processes_mark_their_gpus() -> None:
    gpus = smi.gpus_from_smi(
        read(DERIVED / "rtx4090-x8-535.154.query.csv"),
        read(DERIVED / "rtx4090-x8-535.154.apps.csv"),
    )
    foreign = {g.index: g.foreign_memory_mib for g in gpus}
    assert foreign[0] == 20322
    assert foreign[5] == 0
    assert [g.index for g in gpus if g.healthy] == [5]


def test_own_engines_memory_is_not_foreign() -> None:
    gpus = smi.gpus_from_smi(
        read(DERIVED / "rtx4090-x8-535.154.query.csv"),
        read(DERIVED / "rtx4090-x8-535.154.apps.csv"),
        own_pids=frozenset({58130}),
    )
    assert gpus[0].foreign_memory_mib == 0
    assert gpus[0].healthy


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("h100-sxm-x8-sglang30401.topo.txt", dict.fromkeys(range(8), 0)),
        ("a100-sxm4-40gb-x8-epyc7742.topo.txt", dict.fromkeys(range(8), 0)),
        ("h100-x8-stas00.partial.topo.txt", dict.fromkeys(range(8), 0)),
        ("h100-pcie-x2-nvlink-dl380ag11.topo.txt", {0: 0, 1: 0}),
        ("a10-x4-2nic-xuesong.topo.txt", dict.fromkeys(range(4))),
        ("a100-pcie-40gb-x2-della-i14g20.topo.txt", {0: None, 1: None}),
        ("gtx1080ti-x2-xuesong.topo.txt", {0: None, 1: None}),
        ("h100-sxm-1gpu-590.topo.txt", {0: None}),  # header wrapped in ANSI escapes
        ("rtx2080super-windows-610.topo.txt", {0: None}),
    ],
)
def test_nvlink_domains_from_topology(fixture: str, expected: dict[int, int | None]) -> None:
    assert smi.parse_topology(read(SMI / fixture)) == expected


def test_two_nvlink_islands_get_two_domains() -> None:
    topo = "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV4\tSYS\tSYS\nGPU1\tNV4\t X \tSYS\tSYS\n"
    topo += "GPU2\tSYS\tSYS\t X \tNV4\nGPU3\tSYS\tSYS\tNV4\t X \n"
    assert smi.parse_topology(topo) == {0: 0, 1: 0, 2: 1, 3: 1}


def test_topology_goes_into_gpus() -> None:
    query = "index, uuid, name, memory.total [MiB], compute_cap\n"
    query += "".join(f"{i}, GPU-{i}, NVIDIA H100 80GB HBM3, 81559 MiB, 9.0\n" for i in range(8))
    gpus = smi.gpus_from_smi(query, "", read(SMI / "h100-sxm-x8-sglang30401.topo.txt"))
    assert {g.nvlink_domain for g in gpus} == {0}


@given(st.text(max_size=400))
def test_garbage_never_crashes_the_parsers(text: str) -> None:
    smi.parse_topology(text)
    with contextlib.suppress(smi.SmiError):
        smi.parse_apps(text)
    with contextlib.suppress(smi.SmiError):
        smi.gpus_from_smi(text)


_HEADER = (
    "index, uuid, name, memory.total [MiB], memory.used [MiB], "
    "ecc.errors.uncorrected.volatile.total\n"
)


def _within_log_bounds(gpus: tuple[Gpu, ...]) -> None:
    """Every reader decodes NodeRegistered with these bounds: one GPU out of them hides the node."""
    for gpu in gpus:
        msgspec.convert(msgspec.to_builtins(gpu), Gpu)


@pytest.mark.parametrize(
    "row",
    [
        "0, GPU-0, NVIDIA H100, " + "9" * 400 + ", 10, 0",  # before: OverflowError
        "0, GPU-0, NVIDIA H100, 81559, 10, " + "9" * 400,  # before: OverflowError
        "300, GPU-0, NVIDIA H100, 81559, 10, 0",  # before: GPU index 300 in the inventory
        "0, GPU-0, NVIDIA H100, 99999999999, 10, 0",  # before: 95 PiB of memory
        "0, GPU-0, " + "H" * 300 + ", 81559, 10, 0",  # before: a 300-character name
    ],
)
def test_out_of_range_row_is_an_smi_error_not_a_crash_or_an_unreadable_node(row: str) -> None:
    """An exception other than SmiError escaped the heartbeat's health refresh and ended
    the agent; a GPU outside the log's bounds made every reader refuse the registration."""
    with pytest.raises(smi.SmiError, match="row 0"):
        smi.gpus_from_smi(_HEADER + row + "\n")


def test_topology_with_a_gpu_number_of_thousands_of_digits_is_not_a_crash() -> None:
    # Before: ValueError, int() refuses 4,300 digits and more.
    assert smi.parse_topology("\tGPU0\tGPU" + "1" * 5000 + "\nGPU0\tX\tNV1\n") == {0: None}


def test_process_row_with_an_absurd_pid_is_skipped() -> None:
    apps = "gpu_uuid, pid, used_gpu_memory [MiB]\nGPU-0, " + "9" * 400 + ", 10\nGPU-0, 7, 5\n"
    assert smi.parse_apps(apps) == {"GPU-0": [(7, 5)]}  # before: OverflowError


@given(
    st.lists(
        st.tuples(
            *[st.one_of(st.from_regex(r"-?\d{1,30}(\.\d{1,3})?", fullmatch=True), st.text())] * 2,
            st.text(min_size=1),
            *[st.one_of(st.from_regex(r"-?\d{1,30}(\.\d{1,3})?", fullmatch=True), st.text())] * 3,
        ),
        max_size=4,
    )
)
def test_parsed_gpus_are_within_the_log_bounds_or_refused(rows: list[tuple[str, ...]]) -> None:
    text = _HEADER + "".join(",".join(f'"{c}"' for c in r).replace("\n", " ") + "\n" for r in rows)
    try:
        gpus = smi.gpus_from_smi(text)
    except smi.SmiError:
        return
    _within_log_bounds(gpus)


def test_an_nvidia_smi_printing_without_end_is_cut_off() -> None:
    """Before: all of it was read into memory (64 MiB here; a broken driver, any amount)."""
    flood = (sys.executable, "-c", "import sys; sys.stdout.write('x' * (64 << 20))")
    with pytest.raises(smi.SmiError, match="printed more than"):
        smi.run(flood, timeout_s=600)


def test_nvidia_smi_runs_report_output_exit_and_hang() -> None:
    script = "import sys; print('a,b'); print('no GPU found', file=sys.stderr); sys.exit({})"
    assert smi.run((sys.executable, "-c", script.format(0))) == "a,b\n"
    with pytest.raises(smi.SmiError, match="exited with 3: no GPU found"):
        smi.run((sys.executable, "-c", script.format(3)))
    with pytest.raises(smi.SmiError, match="did not answer"):
        smi.run(("sleep", "600"), timeout_s=0.2)


def test_row_without_memory_says_what_to_check() -> None:
    with pytest.raises(smi.SmiError, match="driver is loaded"):
        smi.gpus_from_smi("index, name\n0, NVIDIA H100\n")


def test_recorded_vgpu_and_workstation_names_give_short_classes() -> None:
    """Before: `h200141c-141g` and `rtxpro6000blackwellmaxqworkstationedition-96g`."""
    vgpu = smi.gpus_from_smi(read(SMI / "h200-141c-vgpu-x4.query.csv"))
    assert [g.gpu_class for g in vgpu] == ["h200-141g"] * 4
    # Recorded without a header (`--format=csv,noheader`): this is the one nvidia-smi
    # prints for the three fields the recording shows.
    header = "index, name, memory.total [MiB]\n"
    pro = smi.gpus_from_smi(header + read(SMI / "rtxpro6000-maxq-x2.noheader.csv"))
    assert [(g.index, g.gpu_class) for g in pro] == [
        (0, "rtxpro6000blackwell-96g"),
        (1, "rtxpro6000blackwell-96g"),
    ]


# --------------------------------------------------------------------------- InfiniBand


def test_native_infiniband_ndr_node() -> None:
    hcas = infiniband.read_hcas(DERIVED / "sysfs-h100-cx7-ndr-x8" / "sys/class/infiniband")
    ib = [h for h in hcas if h.kind == "infiniband"]
    assert len(ib) == 8
    assert {(h.state, h.rate_gbps, h.link_layer) for h in ib} == {("ACTIVE", 400.0, "InfiniBand")}
    (bond,) = [h for h in hcas if h.kind == "roce"]
    assert (bond.name, bond.rate_gbps) == ("mlx5_bond_0", 200.0)


def test_roce_node() -> None:
    (hca,) = infiniband.read_hcas(DERIVED / "sysfs-cx7-roce-coyote1" / "sys/class/infiniband")
    assert (hca.name, hca.port, hca.state, hca.link_layer, hca.kind) == (
        "mlx5_1",
        1,
        "ACTIVE",
        "Ethernet",
        "roce",
    )


def test_recorded_sysfs_trees() -> None:
    hcas = infiniband.read_hcas(HW / "sysfs/prometheus-procfs/sys/class/infiniband")
    by_port = {(h.name, h.port): h for h in hcas}
    assert set(by_port) == {("hfi1_0", 1), ("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)}
    assert by_port[("mlx5_0", 1)].rate_gbps == 25.0
    assert by_port[("mlx4_0", 2)].link_layer == "InfiniBand"  # file ends with an extra blank line
    assert all(h.state == "ACTIVE" and h.kind == "infiniband" for h in hcas)
    exporter = infiniband.read_hcas(HW / "sysfs/prometheus-node-exporter/sys/class/infiniband")
    assert {h.name for h in exporter} == {"i40iw0", "mlx4_0"}


def _port(root: Path, device: str, port: str, **files: str) -> None:
    folder = root / device / "ports" / port
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_garbage_in_sysfs_gives_adapters_within_the_log_bounds(tmp_path: Path) -> None:
    """Before: a 5,000-character state or an absurd rate made every reader refuse the
    node's registration (Hca out of its bounds), and a port folder named with a
    superscript digit raised ValueError out of the heartbeat's fabric refresh."""
    _port(tmp_path, "mlx5_0", "1", state="4: " + "X" * 5000, rate="99999999999 Gb/sec (4X)")
    _port(tmp_path, "mlx5_1", "1", state="4: ACTIVE", link_layer="\x00" * 5000)
    _port(tmp_path, "mlx5_2", "\u00b2", state="4: ACTIVE")
    _port(tmp_path, "mlx5_3", "9999", state="4: ACTIVE")
    hcas = infiniband.read_hcas(tmp_path)
    for hca in hcas:
        msgspec.convert(msgspec.to_builtins(hca), Hca)
    assert {h.name for h in hcas} == {"mlx5_0", "mlx5_1"}
    assert [h.rate_gbps for h in hcas] == [0.0, 0.0]


def test_node_without_infiniband_is_an_island(tmp_path: Path) -> None:
    assert infiniband.read_hcas(tmp_path / "absent") == ()
    inventory = discovery.discover(sim_gpus="1xl4-23g", infiniband_root=tmp_path / "absent")
    assert inventory.inventory.hcas == ()
    assert inventory.inventory.fabrics == ()


NDR = DERIVED / "sysfs-h100-cx7-ndr-x8" / "sys/class/infiniband"
DOWN = DERIVED / "sysfs-cx7-down-esc8000a" / "sys/class/infiniband"


@pytest.mark.parametrize(
    ("root", "hcas", "why"),
    [
        # The ESC8000A's four ConnectX-7, every port PORT_DOWN as recorded.
        (DOWN, ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"), "no port of mlx5_0, mlx5_1"),
        # One of the declared rails is gone (a dead card, a driver that did not load).
        (NDR, ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_10"), "HCA mlx5_10 not present"),
        # No RDMA adapter at all: before, this was advertised as "infiniband".
        ("absent", ("mlx5_0",), "HCA mlx5_0 not present"),
        # The NDR node's InfiniBand rail and its Ethernet bond: before, "infiniband".
        (NDR, ("mlx5_0", "mlx5_bond_0"), "mixes InfiniBand and RoCE"),
    ],
)
def test_a_fabric_that_cannot_carry_a_replica_is_not_advertised(
    root: Path | str, hcas: tuple[str, ...], why: str, tmp_path: Path
) -> None:
    found = discovery.discover(
        sim_gpus="8xh100-80g",
        infiniband_root=tmp_path / root if isinstance(root, str) else root,
        declared_fabrics=[("ib-pod-a", hcas)],
    )
    assert found.inventory.fabrics == ()
    (warning,) = found.warnings
    assert warning.startswith('fabric "ib-pod-a" is not advertised to the scheduler: ')
    assert why in warning


def test_declared_fabric_takes_its_kind_from_the_adapters() -> None:
    root = DERIVED / "sysfs-h100-cx7-ndr-x8" / "sys/class/infiniband"
    found = discovery.discover(
        sim_gpus="8xh100-80g",
        infiniband_root=root,
        declared_fabrics=[("ib-a", ("mlx5_0", "mlx5_1")), ("eth", ("mlx5_bond_0",))],
    )
    assert [(f.name, f.kind) for f in found.inventory.fabrics] == [
        ("ib-a", "infiniband"),
        ("eth", "roce"),
    ]


# --------------------------------------------------------------------------- simulated


def test_simulated_spec() -> None:
    gpus = simulated.parse_spec("8xh100-80g,2xl40s-45g")
    assert len(gpus) == 10
    assert [g.index for g in gpus] == list(range(10))
    assert {g.gpu_class for g in gpus[:8]} == {"h100-80g"}
    assert {g.nvlink_domain for g in gpus[:8]} == {0}
    assert {(g.gpu_class, g.compute_capability, g.nvlink_domain) for g in gpus[8:]} == {
        ("l40s-45g", "8.9", 1)
    }
    assert len({g.uuid for g in gpus}) == 10


@pytest.mark.parametrize("spec", ["", "8h100", "0xh100-80g", "8xh100-80", "x", "8xh100-80g,,"])
def test_bad_simulated_spec_says_the_form(spec: str) -> None:
    with pytest.raises(simulated.SimSpecError, match=r"8xh100-80g|1-64"):
        simulated.parse_spec(spec)


def test_a_simulated_spec_past_the_gpus_a_node_may_report_is_refused() -> None:
    # 5 x 64 GPUs passed `llmgw up`'s check; their indices (to 319) are past what a
    # node's events may carry (MAX_GPUS), so the agent could not register the node.
    with pytest.raises(simulated.SimSpecError, match=f"at most {MAX_GPUS}"):
        simulated.parse_spec(",".join(["64xh100-80g"] * 5))
    assert len(simulated.parse_spec(",".join(["64xh100-80g"] * 4))) == MAX_GPUS


def test_a_long_simulated_spec_is_read_as_one_not_a_path() -> None:
    # Too long for a file name: Path.is_file raised ENAMETOOLONG, a traceback from
    # `llmgw agent inventory --sim-gpus` and from the agent's start.
    long = ",".join(["1xh100-80g"] * 300)
    with pytest.raises(simulated.SimSpecError, match=f"at most {MAX_GPUS}"):
        simulated.load(long)
    assert len(simulated.load(",".join(["1xh100-80g"] * 200)).gpus) == 200


def test_simulated_inventory_file(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(
        "gpus:\n"
        "  - {index: 0, uuid: GPU-a, name: NVIDIA A100-SXM4-80GB, gpu_class: a100-80g,\n"
        "     memory_mib: 81920, compute_capability: '8.0', ecc_uncorrected: 1}\n"
        "hcas:\n  - {name: mlx5_0, link_layer: Ethernet}\n"
    )
    found = discovery.discover(sim_gpus=str(path), declared_fabrics=[("r", ("mlx5_0",))])
    assert found.inventory.gpus[0].ecc_uncorrected == 1
    assert found.inventory.fabrics[0].kind == "roce"
    path.write_text("gpus: 3\n")
    with pytest.raises(simulated.SimSpecError, match="expected `gpus:`"):
        simulated.load(str(path))


def _hca_port(name: str, port: int, state: str, link_layer: str) -> Hca:
    return Hca(name=name, port=port, state=state, rate_gbps=200.0, link_layer=link_layer)


def test_a_dual_port_adapter_counts_by_the_ports_that_are_up() -> None:
    """A VPI card with one port up and the other down (or cabled to another network): the
    fabric is usable, of the kind of the port up; the down port neither blocks it nor mixes
    kinds into it."""
    ib_up_eth_down = (
        _hca_port("mlx5_0", 1, "ACTIVE", "InfiniBand"),
        _hca_port("mlx5_0", 2, "DOWN", "Ethernet"),
    )
    eth_up_ib_down = (
        _hca_port("mlx5_1", 1, "DOWN", "InfiniBand"),
        _hca_port("mlx5_1", 2, "ACTIVE", "Ethernet"),
    )
    found = discovery.fabrics(
        [("ib", ("mlx5_0",)), ("eth", ("mlx5_1",))], ib_up_eth_down + eth_up_ib_down
    )
    assert [(f.name, f.kind) for f in found] == [("ib", "infiniband"), ("eth", "roce")]


def test_a_port_state_is_read_whatever_its_case() -> None:
    hcas = (_hca_port("mlx5_0", 1, "Active", "InfiniBand"),)
    assert discovery.fabric_problem(("mlx5_0",), hcas) is None


def test_sysfs_ports_in_numeric_order_with_what_missing_files_mean(tmp_path: Path) -> None:
    """An adapter folder without ports is skipped, not a crash of the heartbeat's refresh;
    a port without link_layer is InfiniBand (older kernels); one without state is not up."""
    (tmp_path / "mlx5_9").mkdir()  # no ports folder (a half-removed device)
    for port in ("10", "2", "1"):
        _port(tmp_path, "mlx5_0", port, state="4: ACTIVE", link_layer="Ethernet")
    _port(tmp_path, "mlx5_1", "1", state="4: ACTIVE")
    _port(tmp_path, "mlx5_2", "1", link_layer="InfiniBand")
    hcas = infiniband.read_hcas(tmp_path)
    assert [(h.name, h.port) for h in hcas] == [
        ("mlx5_0", 1), ("mlx5_0", 2), ("mlx5_0", 10), ("mlx5_1", 1), ("mlx5_2", 1),
    ]  # fmt: skip
    assert hcas[3].kind == "infiniband"
    assert hcas[4].state == "UNKNOWN"
    assert discovery.fabric_problem(("mlx5_2",), hcas) == "no port of mlx5_2 is ACTIVE"


def test_simulated_gpus_without_adapters_leave_the_adapters_to_sysfs(tmp_path: Path) -> None:
    spec = discovery.discover(sim_gpus="1xl4-23g", infiniband_root=tmp_path / "absent")
    assert not spec.hcas_simulated  # the refresh re-reads sysfs
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(
        "gpus: []\nhcas:\n  - {name: mlx5_0, port: 1, state: ACTIVE, rate_gbps: 400,"
        " link_layer: InfiniBand}\n"
    )
    from_file = discovery.discover(sim_gpus=str(inventory), infiniband_root=tmp_path / "absent")
    assert from_file.hcas_simulated
    assert [h.name for h in from_file.inventory.hcas] == ["mlx5_0"]


def _components(size: int, edges: set[tuple[int, int]]) -> dict[int, frozenset[int]]:
    """Each GPU's NVLink island, by plain reachability over links printed either way."""
    reach = {g: {g} for g in range(size)}
    for _ in range(size):
        for a, b in edges:
            merged = reach[a] | reach[b]
            for g in merged:
                reach[g] = merged
    return {g: frozenset(reach[g]) for g in range(size)}


@given(
    st.integers(1, 6).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from(["NV4", "NV18", "SYS", "PIX", "X"]), min_size=n, max_size=n),
            min_size=n,
            max_size=n,
        )
    )
)
def test_topology_domains_are_the_islands_of_the_links_printed(cells: list[list[str]]) -> None:
    """A link printed on one side of the matrix only still joins both GPUs, a GPU's own cell
    is never a link, and the islands are numbered by their lowest GPU."""
    size = len(cells)
    header = "\t" + "\t".join(f"GPU{i}" for i in range(size)) + "\tCPU Affinity\n"
    rows = "".join(f"GPU{i}\t" + "\t".join(row) + "\t0-127\n" for i, row in enumerate(cells))
    edges = {
        (i, j)
        for i, row in enumerate(cells)
        for j, cell in enumerate(row)
        if cell.startswith("NV") and i != j
    }
    islands = _components(size, edges)
    got = smi.parse_topology(header + rows)
    assert set(got) == set(range(size))
    for gpu in range(size):
        if len(islands[gpu]) == 1:
            assert got[gpu] is None
        else:
            assert {g for g in range(size) if got[g] == got[gpu]} == islands[gpu]
    numbered = sorted({min(island) for island in islands.values() if len(island) > 1})
    assert [got[first] for first in numbered] == list(range(len(numbered)))


def test_gpus_come_sorted_by_index_with_a_capability_only_when_there_is_one() -> None:
    query = "index, uuid, name, memory.total [MiB], compute_cap\n"
    query += "1, GPU-1, NVIDIA H100 80GB HBM3, 81559, 9.0\n"
    query += "0, GPU-0, NVIDIA H100 80GB HBM3, 81559, [N/A]\n"
    gpus = smi.gpus_from_smi(query)
    assert [(g.index, g.uuid, g.compute_capability) for g in gpus] == [
        (0, "GPU-0", ""),
        (1, "GPU-1", "9.0"),
    ]


def test_nvidia_smi_output_one_byte_past_the_bound_is_refused() -> None:
    just_over = (sys.executable, "-c", "import sys; sys.stdout.write('x' * 1001)")
    with pytest.raises(smi.SmiError, match="printed more than 1000 bytes"):
        smi.run(just_over, max_bytes=1000)
    at_bound = (sys.executable, "-c", "import sys; sys.stdout.write('x' * 1000)")
    assert smi.run(at_bound, max_bytes=1000) == "x" * 1000


def test_an_nvidia_smi_that_hangs_is_killed_not_waited_for(tmp_path: Path) -> None:
    """Past its timeout the command is killed: waiting for a hung driver call would hold the
    agent's discovery (and its heartbeat's health refresh) for as long as the hang."""
    hang = (sys.executable, "-c", "import time; time.sleep(120)")
    began = time.monotonic()
    with pytest.raises(smi.SmiError, match="did not answer"):
        smi.run(hang, timeout_s=0.5)
    assert time.monotonic() - began < 60  # generous: the command sleeps 120 s


def test_a_simulated_group_of_one_gpu_has_no_nvlink_and_a_missing_file_says_so(
    tmp_path: Path,
) -> None:
    gpus = simulated.parse_spec("1xl4-23g,2xh100-80g")
    assert [g.nvlink_domain for g in gpus] == [None, 1, 1]
    missing = tmp_path / "fleet.yaml"
    with pytest.raises(simulated.SimSpecError) as refused:
        simulated.load(str(missing))
    assert str(missing) in str(refused.value)
    assert "COUNTxCLASS" not in str(refused.value)


def test_an_adapter_removed_while_it_is_read_is_left_out_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver reload (rmmod mlx5_ib) takes an adapter's sysfs folder away between the
    listing and the read of its ports: the heartbeat's fabric refresh raised
    FileNotFoundError, which ended the agent. The adapters still there are read."""
    _port(tmp_path, "mlx5_0", "1", state="4: ACTIVE", link_layer="InfiniBand")
    _port(tmp_path, "mlx5_1", "1", state="4: ACTIVE", link_layer="InfiniBand")
    gone = tmp_path / "mlx5_0" / "ports"
    listing = Path.iterdir

    def vanishing(self: Path) -> Any:
        if self == gone:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", vanishing)
    assert [h.name for h in infiniband.read_hcas(tmp_path)] == ["mlx5_1"]
