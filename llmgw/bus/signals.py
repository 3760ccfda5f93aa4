"""The routers' load reports on NATS: routers publish `LoadReport`s, the leader reads them.

Each router process publishes a signed `llmgw.core.loadreport.LoadReport` every second
on `llmgw.signals.router.<its name>.w<worker>`, and each agent one of its engines' load on
`llmgw.signals.node.<its id>`, which only that router or node may publish
(llmgw.pki.authorization); the memory stream `llmgw-signals` keeps each subject's
latest for half a minute (llmgw.bus.provisioning). Fire and forget, as the KV updates: a
report lost is replaced by the next one a second later.

`SignalsReader` is a `Reader` over that stream, with the same consumer, order and
signature checks; its records carry a `LoadReport` in `event`, dated no later than the
server stored it (`loadreport.received`: a writer cannot date its way ahead of others).
"""

from __future__ import annotations

import time
from typing import Any, cast

from nats.aio.client import Client

from llmgw.bus.intake import Record
from llmgw.bus.kvlog import publish_signed, signer_for
from llmgw.bus.reader import Reader
from llmgw.core import loadreport, subjects
from llmgw.pki.signing import Signer

START_WINDOW_S = 5.0
"""How far back a SignalsReader starts: a few of every router's reports."""
PULL_MAX_BYTES = 4 * 1024 * 1024
"""What one of a SignalsReader's pull requests may bring: a few of the largest reports
(1 MiB), thousands of ordinary ones. Unbounded, a node publishing its largest reports as
fast as it could had the server push them onto the control plane's connection, which
also holds its lease and its log, faster than the control plane read them, until the
server closed it (a slow consumer), again and again: the leader lost its lease."""


class SignalsPublisher:
    """Signs and publishes one router process's load reports (or, with `node`, one agent's
    report of its engines' load)."""

    def __init__(
        self,
        nc: Client,
        router: str = "",
        worker: int = 0,
        *,
        node: str = "",
        signer: Signer | None = None,
    ) -> None:
        self._nc = nc
        self.subject = (
            subjects.node_signals(node) if node else subjects.router_signals(router, worker)
        )
        self.signer = signer_for(nc, signer, "load reports")
        self.sent = 0

    async def publish(self, report: loadreport.LoadReport) -> None:
        await publish_signed(self._nc, self.signer, self.subject, loadreport.encode(report))
        self.sent += 1


class SignalsReader(Reader):
    """Reads `llmgw-signals` from `START_WINDOW_S` ago (or `since`), then follows it."""

    def __init__(self, nc: Client, *, since: float | None = None, **options: Any) -> None:
        options.setdefault("name", "signals")
        options.setdefault("max_bytes", PULL_MAX_BYTES)
        super().__init__(
            nc,
            since=time.time() - START_WINDOW_S if since is None else since,
            subjects_filter=subjects.SIGNALS_SUBJECTS,
            stream=subjects.SIGNALS_STREAM,
            **options,
        )

    def _foreign(self, name: str) -> str | None:
        # Before the signature: a router may write any subject below its own, and a flood
        # of messages on new ones cost a reader a signature check each.
        if subjects.signals_owner(name) is None:
            return f"{name} is not a load-report subject"
        return None

    def _accept(
        self, seq: int, name: str, data: bytes, size: int, ttl: bytes | None, when: float
    ) -> None:
        try:
            report = loadreport.received(loadreport.decode(data), when)
        except ValueError as exc:
            self._skip(seq, name, when, str(exc), size=size)
            return
        # Records of this stream carry a LoadReport where the log's carry an event.
        self._buf.append(Record(seq, name, when, cast(Any, report), size))


def report_of(record: Record) -> loadreport.LoadReport:
    """The LoadReport a SignalsReader's record carries."""
    return cast(loadreport.LoadReport, record.event)
