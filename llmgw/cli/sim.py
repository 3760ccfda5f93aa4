"""`llmgw sim`: run a simulated OpenAI-compatible engine.

Settings come from an optional YAML file (`--config`), then `LLMGW_SIM__*`
environment variables, then the flags given on the command line, in that order
of precedence (flags win). The agent's sim adapter and the tests use the flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import typer

from llmgw import config, logs
from llmgw.sim.config import SimConfig, StallAt


# long: one typer option per simulator setting and the dict they fill; _serve does the work
def command(
    host: str | None = typer.Option(None, "--host", help="Address to listen on [127.0.0.1]."),
    port: int | None = typer.Option(
        None, "--port", help="TCP port; 0 picks a free one, printed at start [8000]."
    ),
    served_model_name: list[str] | None = typer.Option(
        None,
        "--served-model-name",
        help="A model name to serve; repeat for aliases. The first one labels the metrics.",
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Longest prompt plus output, in tokens [4096]."
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", help="Tokens per KV-cache block [16]."
    ),
    num_blocks: int | None = typer.Option(
        None, "--num-blocks", help="KV-cache blocks in all [4096]."
    ),
    max_num_seqs: int | None = typer.Option(
        None, "--max-num-seqs", help="Largest batch; further requests wait [256]."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed of generated text [0]."),
    decode_base_ms: float | None = typer.Option(
        None, "--decode-base-ms", help="Fixed cost of every engine step, ms [0]."
    ),
    decode_per_seq_ms: float | None = typer.Option(
        None, "--decode-per-seq-ms", help="Added step cost per sequence in the batch, ms [0]."
    ),
    prefill_per_token_ms: float | None = typer.Option(
        None, "--prefill-per-token-ms", help="Prefill cost per uncached prompt token, ms [0]."
    ),
    eos_min_tokens: int | None = typer.Option(
        None, "--eos-min-tokens", help="Shortest natural output length, tokens [32]."
    ),
    eos_max_tokens: int | None = typer.Option(
        None, "--eos-max-tokens", help="Longest natural output length, tokens [512]."
    ),
    embedding_dim: int | None = typer.Option(
        None, "--embedding-dim", help="Length of embedding vectors [256]."
    ),
    stall_at: str | None = typer.Option(
        None, "--stall-at", help="Fault: stall at headers, first_token or mid_stream."
    ),
    stall_s: float | None = typer.Option(None, "--stall-s", help="Fault: stall length, s [3600]."),
    fail_status: int | None = typer.Option(
        None, "--fail-status", help="Fault: answer with this HTTP status."
    ),
    die_mid_stream: bool | None = typer.Option(
        None, "--die-mid-stream", help="Fault: reset the connection after --after-tokens tokens."
    ),
    after_tokens: int | None = typer.Option(
        None, "--after-tokens", help="Fault: tokens streamed before a mid-stream fault [1]."
    ),
    fault_count: int | None = typer.Option(
        None, "--fault-count", "--count", help="Fault: how many requests it hits (default: all)."
    ),
    shutdown_timeout_s: float | None = typer.Option(
        None, "--shutdown-timeout-s", help="On SIGTERM, grace for requests in flight, s [2]."
    ),
    load_s: float | None = typer.Option(
        None, "--load-s", help="Seconds before it listens, as weights loading take [0]."
    ),
    log_level: str | None = typer.Option(
        None,
        "--log-level",
        help="debug, info, warning, error or critical (default: info; warn and fatal too).",
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="LLMGW_SIM_API_KEY",
        show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1 and /sim (not /health, /metrics);"
        " prefer the environment variable: a command line is visible in `ps`.",
    ),
    kv_events_config: str | None = typer.Option(
        None,
        "--kv-events-config",
        help="vLLM's KV event publishing JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\'.',
    ),
    otlp_traces_endpoint: str | None = typer.Option(
        None,
        "--otlp-traces-endpoint",
        help="Export each request's span, continuing its traceparent as vLLM does, to this"
        " OTLP/HTTP collector (http://host:4318).",
    ),
    config_path: Path | None = typer.Option(
        None, "--config", help="YAML file of settings (see schemas/sim-config.schema.json)."
    ),
) -> None:
    """Run a simulated OpenAI-compatible engine (vLLM's behaviour and metrics, no GPU)."""
    if stall_at is not None and stall_at not in get_args(StallAt):
        typer.echo(
            f"llmgw sim: --stall-at {stall_at!r} is not a stall point: use "
            + ", ".join(get_args(StallAt)),
            err=True,
        )
        raise typer.Exit(2)
    kv_events: dict[str, Any] | None = None
    if kv_events_config is not None:
        try:
            kv_events = json.loads(kv_events_config)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
            typer.echo(f"llmgw sim: --kv-events-config is not JSON: {exc}", err=True)
            raise typer.Exit(2) from None
        if not isinstance(kv_events, dict):
            typer.echo("llmgw sim: --kv-events-config must be a JSON object", err=True)
            raise typer.Exit(2)
        if not kv_events.get("enable_kv_cache_events", False):
            kv_events = None  # vLLM publishes nothing unless enabled
    flags: dict[str, Any] = {
        "host": host,
        "port": port,
        "served_model_names": served_model_name or None,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        "eos_min_tokens": eos_min_tokens,
        "eos_max_tokens": eos_max_tokens,
        "embedding_dim": embedding_dim,
        "shutdown_timeout_s": shutdown_timeout_s,
        "load_s": load_s,
        "log_level": log_level,
        "api_key": api_key,
        "kv_events_config": kv_events,
        "otlp_traces_endpoint": otlp_traces_endpoint,
        "latency": {
            "decode_base_ms": decode_base_ms,
            "decode_per_seq_ms": decode_per_seq_ms,
            "prefill_per_token_ms": prefill_per_token_ms,
        },
        "faults": {
            "stall_at": stall_at,
            "stall_s": stall_s,
            "fail_status": fail_status,
            "die_mid_stream": die_mid_stream,
            "after_tokens": after_tokens,
            "count": fault_count,
        },
    }
    _serve(flags, config_path)


def _serve(flags: dict[str, Any], config_path: Path | None) -> None:
    """Load the settings (file, environment, the flags given), check them, and serve."""
    try:
        given = _given(flags)
        cfg = config.load(SimConfig, config_path, section="SIM", overrides=given)
    except config.ConfigError as exc:
        typer.echo(f"llmgw sim: {exc}", err=True)
        raise typer.Exit(2) from None
    problems = config.name_variables(cfg.problems(), "SIM", overrides=given)
    if problems:
        for problem in problems:
            typer.echo(f"llmgw sim: {problem}", err=True)
        raise typer.Exit(2)
    logs.setup(cfg.log_level)
    # Imported here: the server pulls in aiohttp and uvloop, which `llmgw --help` need not pay for.
    from llmgw import listeners
    from llmgw.sim import server

    try:
        server.run(cfg)
    except listeners.ListenError as exc:
        typer.echo(f"llmgw sim: {exc}", err=True)
        raise typer.Exit(2) from None


def _given(flags: dict[str, Any]) -> dict[str, Any]:
    """Only the flags actually given, so they override the file and environment
    without resetting what those set."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, dict):
            nested = _given(value)
            if nested:
                out[key] = nested
        elif value is not None:
            out[key] = value
    return out
