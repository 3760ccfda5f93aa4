"""The state directory of `llmgw up`: where every process of the embedded fleet keeps its files.

    <state>/nats/                private nats-server: CA and certificates, config, JetStream store
    <state>/control/control.yaml the control plane's config
    <state>/agents/<node>/       one agent's config (agent.yaml) and state (pid files, ledger,
                                 outbox, engine logs under its own layout)
    <state>/router/router.yaml   the router's config
    <state>/router/state/        what the router owes the fleet's budgets through an outage
    <state>/ctl.yaml             what `llmgw ctl` needs (LLMGW_CTL_CONFIG=<state>/ctl.yaml)
    <state>/logs/<process>.log   stdout and stderr of every process `up` started
    <state>/run/<process>.json   the pid files of those processes (with their fingerprints)
    <state>/run/up.lock          flocked by the running `llmgw up`: a second one refuses to
                                 share the directory (run/up.json says which pid holds it)

Everything survives a stop, so a second `up` on the same directory keeps the CA, the
certificates and the log (its history is what `llmgw ctl replay` shows); what does not
survive are processes, which the next `up` finds through the pid files and stops.
Used by `llmgw.up.running`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def certs(self) -> Path:
        return self.nats / "certs"

    @property
    def control_config(self) -> Path:
        return self.root / "control" / "control.yaml"

    def agent_dir(self, node: str) -> Path:
        return self.root / "agents" / node

    def agent_config(self, node: str) -> Path:
        return self.agent_dir(node) / "agent.yaml"

    def agent_state(self, node: str) -> Path:
        return self.agent_dir(node) / "state"

    @property
    def agents(self) -> Path:
        return self.root / "agents"

    @property
    def router_config(self) -> Path:
        return self.root / "router" / "router.yaml"

    @property
    def router_state(self) -> Path:
        return self.root / "router" / "state"

    @property
    def ctl_config(self) -> Path:
        return self.root / "ctl.yaml"

    @property
    def models_file(self) -> Path:
        """The demo catalog, declared with `llmgw ctl apply` once every node registered."""
        return self.root / "models.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    @property
    def run(self) -> Path:
        return self.root / "run"

    def pid_file(self, process: str) -> Path:
        return self.run / f"{process}.json"

    @property
    def up_pid_file(self) -> Path:
        return self.run / "up.json"

    def make(self) -> None:
        for folder in (self.root, self.nats, self.logs, self.run, self.agents):
            folder.mkdir(parents=True, exist_ok=True)
        self.control_config.parent.mkdir(parents=True, exist_ok=True)
        self.router_config.parent.mkdir(parents=True, exist_ok=True)
