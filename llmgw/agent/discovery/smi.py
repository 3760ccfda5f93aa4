"""GPU discovery through the `nvidia-smi` command: the fallback when NVML fails.

Parsing is pure (text in, values out) so recorded outputs test it; `run` is
the thin shell that executes the real binary. The CSV parser reads the header
row instead of trusting the field order it asked for, so recorded outputs with
other field lists (and drivers that print units in values despite `nounits`)
parse the same way. Used by `llmgw.agent.discovery.discover_gpus`.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import selectors
import subprocess
import time
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.agent.discovery.memory import foreign_mib
from llmgw.core.inventory import Gpu, gpu_class

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "compute_cap",
    "ecc.errors.uncorrected.volatile.total",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "mig.mode.current",
)
# What every driver since the 2010s answers: the retry when an old driver rejects a field.
MINIMAL_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used")
APP_FIELDS = ("gpu_uuid", "pid", "used_memory")

QUERY_GPUS = ("nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,nounits")
QUERY_GPUS_MINIMAL = (
    "nvidia-smi",
    f"--query-gpu={','.join(MINIMAL_FIELDS)}",
    "--format=csv,nounits",
)
QUERY_APPS = ("nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,nounits")
TOPOLOGY = ("nvidia-smi", "topo", "-m")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_UNIT = re.compile(r"\s*\[[^\]]*\]$")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?")
# A GPU's column: ASCII digits, few enough for int() (it refuses 4,300 digits and more).
_GPU_CELL = re.compile(r"GPU([0-9]{1,3})")
_NOT_AVAILABLE = {"", "[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]"}


class SmiError(RuntimeError):
    """nvidia-smi could not be run or printed something this parser cannot use."""


def parse_csv(text: str) -> list[dict[str, str]]:
    """Rows of `--format=csv` output keyed by field name without its unit ("memory.total")."""
    try:
        rows = [
            r for r in csv.reader(io.StringIO(text, newline=""), skipinitialspace=True) if any(r)
        ]
    except csv.Error as exc:
        raise SmiError(f"nvidia-smi printed something that is not CSV: {exc}") from None
    if not rows:
        return []
    header = [_UNIT.sub("", cell.strip()) for cell in rows[0]]
    return [dict(zip(header, (cell.strip() for cell in row), strict=False)) for row in rows[1:]]


def _number(value: str | None) -> float | None:
    """'81559 MiB', '81559' and '9.0' read as numbers; '[N/A]' and garbage as None."""
    if value is None or value.strip().lower() in _NOT_AVAILABLE:
        return None
    match = _NUMBER.match(value.strip())
    return float(match.group(0)) if match else None


def _yes(value: str | None) -> bool:
    """'Yes' is set; 'No', '[N/A]' (boards without row remapping) and absence are not."""
    return (value or "").strip().lower() == "yes"


def parse_topology(text: str) -> dict[int, int | None]:
    """NVLink domain of each GPU from `nvidia-smi topo -m`: GPUs joined by NV# links share one.

    Domains are numbered 0, 1, ... in order of their lowest GPU index; a GPU with
    no NVLink peer has None (PCIe only), which is what placement must know to keep
    a tensor-parallel group off the slow path.
    """
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((line.split() for line in lines if re.search(r"\bGPU\d+\b", line)), None)
    if header is None:
        return {}
    columns = [int(cell[3:]) for cell in header if _GPU_CELL.fullmatch(cell)]
    links: dict[int, set[int]] = {gpu: set() for gpu in columns}
    for line in lines:
        cells = line.split()
        if not cells or not _GPU_CELL.fullmatch(cells[0]) or cells == header:
            continue
        row = int(cells[0][3:])
        if row not in links:
            continue
        for peer, link in zip(columns, cells[1 : 1 + len(columns)], strict=False):
            if re.fullmatch(r"NV\d+", link) and peer != row:
                links[row].add(peer)
                links[peer].add(row)
    return nvlink_domains(links)


def nvlink_domains(links: Mapping[int, Iterable[int]]) -> dict[int, int | None]:
    """Connected components of an NVLink adjacency map, numbered by lowest member."""
    domain: dict[int, int | None] = {}
    next_domain = 0
    for start in sorted(links):
        if start in domain:
            continue
        if not any(True for _ in links[start]):
            domain[start] = None
            continue
        stack, seen = [start], {start}
        while stack:
            gpu = stack.pop()
            for peer in links.get(gpu, ()):
                if peer not in seen:
                    seen.add(peer)
                    stack.append(peer)
        for gpu in seen:
            domain[gpu] = next_domain
        next_domain += 1
    return domain


def parse_apps(text: str) -> dict[str, list[tuple[int, int]]]:
    """`--query-compute-apps` output as {gpu uuid: [(pid, used MiB), ...]}."""
    out: dict[str, list[tuple[int, int]]] = {}
    for row in parse_csv(text):
        uuid, pid = row.get("gpu_uuid"), _number(row.get("pid"))
        # Asked for as `used_memory`, printed in the header as `used_gpu_memory [MiB]`.
        used = row.get("used_gpu_memory", row.get("used_memory"))
        mib = _number(used) or 0
        # 400 digits read as infinity, which int() refuses: a row of garbage, not a process.
        if not uuid or pid is None or not math.isfinite(pid + mib):
            continue
        # "[N/A]" where the driver may not say (vGPU, WDDM): the process still makes the
        # GPU busy, so it holds at least 1 MiB, as NVML's reading counts it.
        out.setdefault(uuid, []).append((int(pid), max(1, int(mib))))
    return out


def gpus_from_smi(
    query: str,
    apps: str = "",
    topology: str = "",
    *,
    own_pids: frozenset[int] = frozenset(),
    own_gpus: frozenset[int] = frozenset(),
) -> tuple[Gpu, ...]:
    """Build the GPUs from the three nvidia-smi outputs. Purely computational, no side effects.

    Memory held by a compute process whose pid is not one of the agent's engines
    (`own_pids`) counts as foreign: another tenant's job would make an engine
    fail its memory plan minutes into loading. So does `memory.used` that no
    listed process accounts for, except on the GPUs our engines hold (`own_gpus`):
    see `llmgw.agent.discovery.memory`.
    """
    domains = parse_topology(topology) if topology else {}
    by_uuid = parse_apps(apps) if apps else {}
    gpus: list[Gpu] = []
    for position, row in enumerate(parse_csv(query)):
        if _mig_enabled(row):
            continue
        try:
            gpu = _row_gpu(position, row, domains, by_uuid, own_pids, own_gpus)
            gpus.append(within_bounds(gpu))
        except (OverflowError, msgspec.ValidationError) as exc:
            # Not a crash of the agent (its health refresh expects SmiError) nor a GPU
            # that makes every reader refuse the node's registration.
            raise SmiError(
                f"nvidia-smi row {position} is out of range ({exc}): check its output "
                "(`nvidia-smi --query-gpu=index,name,memory.total --format=csv`)"
            ) from None
    return tuple(sorted(gpus, key=lambda g: g.index))


def within_bounds(gpu: Gpu) -> Gpu:
    """`gpu` if it fits the log's bounds (llmgw.core.limits), else msgspec.ValidationError:
    every reader refuses a NodeRegistered with one GPU out of them. Both readings (this
    module's and llmgw.agent.discovery.nvml's) pass each GPU through it."""
    return msgspec.convert(msgspec.to_builtins(gpu), Gpu)


def _row_gpu(
    position: int,
    row: dict[str, str],
    domains: Mapping[int, int | None],
    by_uuid: Mapping[str, list[tuple[int, int]]],
    own_pids: frozenset[int],
    own_gpus: frozenset[int],
) -> Gpu:
    """One `--query-gpu` row as a Gpu (not yet checked against the log's bounds)."""
    name = row.get("name", "").strip()
    memory = _number(row.get("memory.total"))
    if not name or memory is None:
        raise SmiError(
            f"nvidia-smi row {position} has no name or memory.total ({row!r}): "
            "check that the driver is loaded (`nvidia-smi` alone should list the GPUs)"
        )
    index_value = _number(row.get("index"))
    index = int(index_value) if index_value is not None else position
    uuid = row.get("uuid", "") or f"GPU-index-{index}"
    ecc = _number(row.get("ecc.errors.uncorrected.volatile.total"))
    cap = _number(row.get("compute_cap"))
    foreign = foreign_mib(
        used_mib=_number(row.get("memory.used")),
        processes=by_uuid.get(uuid, ()),
        own_pids=own_pids,
        ours=index in own_gpus,
    )
    return Gpu(
        index=index,
        uuid=uuid,
        name=name,
        gpu_class=gpu_class(name, memory),
        memory_mib=int(memory),
        compute_capability=row.get("compute_cap", "") if cap is not None else "",
        nvlink_domain=domains.get(index),
        ecc_uncorrected=int(ecc or 0),
        foreign_memory_mib=foreign,
        remap_pending=_yes(row.get("remapped_rows.pending")),
        remap_failed=_yes(row.get("remapped_rows.failure")),
    )


def _mig_enabled(row: dict[str, str]) -> bool:
    return row.get("mig.mode.current", "").strip().lower() == "enabled"


def mig_warnings(query: str) -> list[str]:
    """Why GPUs in MIG mode are left out: llmgw places whole GPUs by index, and a
    MIG-enabled GPU is reachable only through its MIG instances' UUIDs."""
    return [
        f"GPU {row.get('index', '?')} ({row.get('name', '?')}) has MIG enabled and is left out: "
        f"llmgw places whole GPUs; disable MIG (`nvidia-smi -i {row.get('index', 'N')} -mig 0`) "
        "to use it"
        for row in parse_csv(query)
        if _mig_enabled(row)
    ]


MAX_OUTPUT_BYTES = 4 * 1024 * 1024
"""The most nvidia-smi may print on one stream: the largest node's CSV is some KiB, and a
broken driver or wrapper printing without end must not fill the agent's memory."""


def run(
    argv: tuple[str, ...], *, timeout_s: float = 15.0, max_bytes: int = MAX_OUTPUT_BYTES
) -> str:
    """Run one nvidia-smi command and return its stdout, or raise SmiError saying why."""
    what = " ".join(argv)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise SmiError(
            f"{argv[0]} is not on PATH: install the NVIDIA driver utilities, "
            "or run with --sim-gpus on a machine without GPUs"
        ) from None
    except OSError as exc:  # not executable, or not a program: a broken driver install
        raise SmiError(
            f"{argv[0]} cannot be run ({exc.strerror or exc}): reinstall the NVIDIA driver "
            "utilities"
        ) from None
    with proc:
        try:
            stdout, stderr = _bounded_output(proc, time.monotonic() + timeout_s, max_bytes)
        except subprocess.TimeoutExpired:
            raise SmiError(
                f"{what} did not answer in {timeout_s:.0f} s: the driver may hang"
            ) from None
        except OverflowError:
            raise SmiError(
                f"{what} printed more than {max_bytes} bytes: check the driver"
            ) from None
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        # A negative status is a signal's (a crash, the OOM killer): what it printed is partial.
        how = (
            f"was killed by signal {-proc.returncode}"
            if proc.returncode < 0
            else f"exited with {proc.returncode}"
        )
        raise SmiError(f"{what} {how}: {_detail(stderr or stdout)}")
    return stdout


MAX_DETAIL = 500
"""The most of a failed command's output kept in its error: it goes to logs and to `llmgw
agent inventory`, and a broken wrapper may print megabytes."""


def _detail(text: str) -> str:
    """What a failed nvidia-smi said, in one line: the cause comes first and more may follow
    ("Failed to initialize NVML: Driver/library version mismatch" / "NVML library version:
    570.124"), so its first line is kept, with the last one of a longer output."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 3:
        lines = [lines[0], "...", lines[-1]]
    return " / ".join(lines)[:MAX_DETAIL] or "no output"


def _bounded_output(
    proc: subprocess.Popen[bytes], deadline: float, max_bytes: int
) -> tuple[str, str]:
    """`proc`'s stdout and stderr once it exits; TimeoutExpired past `deadline`,
    OverflowError as soon as one stream passes `max_bytes` (unlike communicate())."""
    assert proc.stdout is not None
    assert proc.stderr is not None
    got = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as streams:
        for fd in got:
            streams.register(fd, selectors.EVENT_READ)
        while streams.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            for key, _ in streams.select(left):
                chunk = os.read(key.fd, 64 * 1024)
                if not chunk:
                    streams.unregister(key.fd)
                got[key.fd] += chunk
                if len(got[key.fd]) > max_bytes:
                    raise OverflowError
    proc.wait(max(deadline - time.monotonic(), 0.0))
    out, err = (bytes(b).decode(errors="replace") for b in got.values())
    return out, err


def discover(
    *, own_pids: frozenset[int] = frozenset(), own_gpus: frozenset[int] = frozenset()
) -> tuple[tuple[Gpu, ...], list[str]]:
    """GPUs as nvidia-smi reports them, and warnings for the parts it could not read.

    The GPU list is required; the process list and the topology are not, but
    losing them is said out loud: without them foreign memory goes unseen and
    the scheduler loses the NVLink domains.
    """
    warnings: list[str] = []
    try:
        query = run(QUERY_GPUS)
    except SmiError as exc:
        # An old driver rejects fields it does not know (compute_cap came with 510);
        # the minimal query still lists the GPUs, without compute capability or ECC.
        query = run(QUERY_GPUS_MINIMAL)
        warnings.append(
            f"reduced GPU query (no compute capability, ECC, row remapping or MIG mode): {exc}"
        )
    warnings += mig_warnings(query)
    try:
        apps = run(QUERY_APPS)
    except SmiError as exc:
        apps = ""
        warnings.append(f"no process list, foreign GPU memory is seen only in memory.used: {exc}")
    try:
        topology = run(TOPOLOGY)
    except SmiError as exc:
        topology = ""
        warnings.append(f"no topology, NVLink domains unknown: {exc}")
    return gpus_from_smi(query, apps, topology, own_pids=own_pids, own_gpus=own_gpus), warnings
