"""The bounds of every number, string and collection a writer puts into an event.

Every field of every event and nested Struct (llmgw/core/events/, inventory.py,
profile.py) is declared with one of these types, so a message outside them fails in
`events.decode` with DecodeError: readers count, log and skip it, and nothing after
decoding (the fold, the digest, snapshots, the admin API, `ctl`) ever meets, say, a
GPU with 2**70 MiB of memory. The bounds are generous for any real fleet and small
enough that every arithmetic and encoding step downstream stays exact: integers fit
in 53 bits (exact as JSON numbers in any language, and in msgpack), floats are finite.

Pure: type aliases, and `clip` for text a decision composes.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

MAX_COUNTER = 2**53
"""Sequences, generations, epochs, error counters: exact as a float, far beyond any log."""
MAX_GPU_INDEX = 255
MAX_GPUS = MAX_GPU_INDEX + 1
"""GPUs of one node (NVML numbers them 0..N-1; the largest machines have 16-64)."""
MAX_MEMORY_MIB = 2**24
"""16 TiB of memory on one GPU: two orders of magnitude above today's largest."""
MAX_PORT = 65535
MAX_PID = 2**22
"""Linux's largest pid_max (PID_MAX_LIMIT)."""
MAX_TIME = 2.0**34
"""UNIX seconds up to the year 2514."""
MAX_SECONDS = 10.0**7
"""A duration (grace, timeout, deadline): about 115 days."""
MAX_SHARDS = 1024
"""Shards in one message: one replica over this many nodes, or what one node runs."""
MAX_LIST = 256
"""HCAs, fabrics, aliases, fallbacks, engine arguments and similar lists."""
MAX_ENV = 256
"""Environment variables of a model."""
MAX_LOG_LINES = 1000
MAX_LINE = 64 * 1024
"""The agent reads at most 64 KiB per 256 lines of an engine's output for a tail."""
MAX_NAME = 256
"""Node, replica, model, operator and leader names; ids; classes; addresses."""
MAX_TEXT = 16 * 1024
"""Free text: reasons, errors, paths, URLs, engine arguments, environment values. A
decision quoting one (a reason naming a shard's error) is clipped to it (`clip`)."""
MAX_HCA_NAME = 63
"""An RDMA adapter's name: Linux's IB_DEVICE_NAME_MAX is 64 bytes with the final NUL."""
MAX_MESSAGE = 1024 * 1024
"""The most one message of the log may hold (the stream's max_msg_size)."""
MAX_PROFILE_BYTES = MAX_MESSAGE - 64 * 1024
"""A model profile as JSON. A shard's StartShard carries most of it (engine_args, env,
aliases, model) plus what placement adds: NCCL_IB_HCA (at most MAX_TEXT), the head's
address and fabric, the envelope. What is left under MAX_MESSAGE holds those."""
MAX_PARALLEL = 4096
MAX_REPLICAS = 100_000
MAX_MODEL_LEN = 2**30

Counter: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNTER)]
Version: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=1000)]
GpuIndex: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPU_INDEX)]
MemoryMib: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_MEMORY_MIB)]
Port: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT)]
Pid: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_PID)]
ShardIndex: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_SHARDS - 1)]
SmallInt: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=MAX_LIST)]
# Lower bounds of the profile's sizes stay wide: catalog.problems explains a zero or a
# negative value in words, where a decode error would only name the field.
Parallel: TypeAlias = Annotated[int, msgspec.Meta(ge=-MAX_PARALLEL, le=MAX_PARALLEL)]
Replicas: TypeAlias = Annotated[int, msgspec.Meta(ge=-MAX_REPLICAS, le=MAX_REPLICAS)]
ModelLen: TypeAlias = Annotated[int, msgspec.Meta(ge=-MAX_MODEL_LEN, le=MAX_MODEL_LEN)]

Time: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIME)]
Seconds: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
SignedSeconds: TypeAlias = Annotated[float, msgspec.Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)]
"""A duration catalog.problems checks for sign (and explains)."""
Rate: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=10.0**7)]
"""Link rate in Gb/s."""

Name: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
WHOLE_END = r"$(?!\n)"
"""The end of a pattern that matches a whole value: msgspec searches with Python's `re`, whose
`$` also matches before a final newline ("abc\n" passed `^[a-z]*$`); the look-ahead (which
JSON Schema's regular expressions read the same) refuses it."""
EngineKey: TypeAlias = Annotated[
    str, msgspec.Meta(max_length=MAX_NAME, pattern="^[!-~]*" + WHOLE_END)
]
"""A key an engine requires, which routers send in a request's head: visible ASCII only (a
node's agent makes them URL-safe), since any other character cannot be written in an HTTP
header and would fail every request to the engine."""
Line: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_LINE)]
HCA_NAME = f"^[A-Za-z0-9_.:-]{{1,{MAX_HCA_NAME}}}" + WHOLE_END
HcaName: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_HCA_NAME, pattern=HCA_NAME)]
"""An RDMA adapter as Linux names it (mlx5_0, rocep1s0f0, irdma0). A multi-node shard's
NCCL_IB_HCA lists its node's adapters on the fabric: MAX_LIST of these, joined, fit in
MAX_TEXT, and JSON writes them without escapes, so its StartShard stays readable."""
HcaNames: TypeAlias = Annotated[tuple[HcaName, ...], msgspec.Meta(max_length=MAX_LIST)]

Names: TypeAlias = Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_LIST)]
Args: TypeAlias = Annotated[tuple[Text, ...], msgspec.Meta(max_length=MAX_LIST)]
GpuIndices: TypeAlias = Annotated[tuple[GpuIndex, ...], msgspec.Meta(max_length=MAX_GPUS)]
LogTail: TypeAlias = Annotated[tuple[Line, ...], msgspec.Meta(max_length=MAX_LOG_LINES)]
Env: TypeAlias = Annotated[dict[Name, Text], msgspec.Meta(max_length=MAX_ENV)]


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """`text` cut to `limit` characters (with an ellipsis when cut): for text a decision
    composes from what it read, so that the decision itself stays within its bounds."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
