"""A node floods `llmgw-signals` with its largest valid reports, on a real nats-server.

What one node's certificate can do to the readers of the load reports: publish reports
of 1 MiB (the stream's largest message) on its own subject as fast as the server takes
them. The control plane reads them on the connection that also holds its lease and its
log, so the server must never be made to close that connection; and the reports of
everyone else must not be pushed out of the stream by one subject's flood. The log's own
readers are held to the same: a node may store anything below its log subjects.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from llmgw import bus
from llmgw.core import loadreport, subjects
from tests.harness import TestNatsServer, connect_as, signed_headers, wait_for
from tests.integration.test_attestations import CountingVerifier

pytestmark = pytest.mark.slow

MIB = 1024 * 1024


@pytest.fixture
async def control(nats_server: TestNatsServer) -> AsyncIterator[bus.BusClient]:
    """A control plane's connection, the streams provisioned: the readers' side."""
    nc = await connect_as(nats_server, "control", "c1")
    await bus.provision(nc.jetstream())
    yield nc
    await bus.close(nc)


def largest_report() -> bytes:
    """A valid report just under the stream's 1 MiB limit (with its signature headers)."""
    endpoints = tuple(
        loadreport.EndpointLoad(endpoint=f"e{i:011d}", model=f"m{i % 2000:04d}", queue=1.5)
        for i in range(19_000)
    )
    data = loadreport.encode(loadreport.LoadReport(ts=time.time(), endpoints=endpoints))
    assert 0.8 * MIB < len(data) < MIB - 4096
    return data


def flood(
    server: TestNatsServer, node: str, count: int, done: threading.Event, *, junk: bool = False
) -> None:
    """Publish `count` messages of about 1 MiB as `node`, from a thread of its own (the
    writer goes on while the reader's event loop is busy): its largest reports, signed, on
    its report subject; or with `junk`, bytes no reader accepts below its log subjects."""

    async def run() -> None:
        nc = await connect_as(server, "node", node)
        if junk:
            subject, data = subjects.node_event(node, "junk"), b"x" * 1_000_000
        else:
            subject, data = subjects.node_signals(node), largest_report()
        try:
            for i in range(count):
                headers = None if junk else signed_headers(nc, subject, data, secrets.token_hex(12))
                await nc.publish(subject, data, headers=headers)
                if i % 8 == 7:
                    await nc.flush(timeout=30)
            await nc.flush(timeout=30)
        finally:
            await bus.close(nc)
            done.set()

    asyncio.run(run())


async def all_reports(
    control: bus.BusClient, **options: Any
) -> tuple[bus.SignalsReader, list[bus.Record]]:
    """Every report the stream holds, read once from the start, and the reader."""
    got: list[bus.Record] = []
    reader = bus.SignalsReader(control, since=0.0, follow=False, name="t", **options)
    async with reader:
        async for batch in reader.batches():
            got.extend(batch)
    return reader, got


async def stored(control: bus.BusClient, count: int) -> None:
    """Wait until `llmgw-signals` holds `count` messages: reports and a node's messages go
    without an acknowledgement, and a reader that starts before they are stored ends
    without them."""

    async def holds() -> bool:
        info = await control.jetstream().stream_info(subjects.SIGNALS_STREAM)
        return info.state.messages == count

    await wait_for(holds, 30, f"{count} messages stored in llmgw-signals")


async def read_through_a_flood(
    server: TestNatsServer, control: bus.BusClient, reader: bus.Reader, *, junk: bool
) -> None:
    """`reader` follows while a node floods 160 MiB and its process is busy for 4 s (as a
    control plane deciding, or folding a snapshot): the server must not close its
    connection as a slow consumer, and it reads on after the flood."""
    done = threading.Event()
    async with reader:

        async def consume() -> None:
            async for _batch in reader.batches():
                pass

        consumer = asyncio.create_task(consume())
        await wait_for(lambda: reader._request_open, 10, "the reader's first pull request")
        writer = threading.Thread(
            target=flood, args=(server, "evil", 160, done), kwargs={"junk": junk}
        )
        writer.start()
        time.sleep(4.0)  # noqa: ASYNC251 (the event loop held on purpose)
        await wait_for(done.is_set, 120, "the flood to end")
        await asyncio.to_thread(writer.join)
        await wait_for(lambda: reader.last_seq >= 160, 60, "the reader to read past the flood")
        consumer.cancel()
    log = server.log_tail(200)
    assert "Slow Consumer" not in log, log
    assert control.stats["reconnects"] == 0


async def test_a_node_flooding_its_reports_does_not_get_the_readers_connection_closed(
    nats_server: TestNatsServer, control: bus.BusClient
) -> None:
    reader = bus.SignalsReader(control, name="t")
    await read_through_a_flood(nats_server, control, reader, junk=False)


async def test_a_node_flooding_its_reports_does_not_push_out_anyone_elses(
    nats_server: TestNatsServer, control: bus.BusClient
) -> None:
    router = await connect_as(nats_server, "router", "r1")
    try:
        report = loadreport.LoadReport(ts=time.time(), models=(
            loadreport.ModelTraffic(model="m", requests=7),))  # fmt: skip
        await bus.SignalsPublisher(router, "r1").publish(report)
        await router.flush()
        # More than the stream holds (64 MiB), on the node's one subject.
        await asyncio.to_thread(flood, nats_server, "evil", 80, threading.Event())
        _, got = await all_reports(control)
        by_subject = {r.subject: bus.signals.report_of(r) for r in got}
        assert by_subject[subjects.router_signals("r1", 0)].models[0].requests == 7
        assert subjects.node_signals("evil") in by_subject  # its latest is kept
    finally:
        await bus.close(router)


async def test_a_report_larger_than_a_readers_byte_bound_is_still_read(
    nats_server: TestNatsServer, control: bus.BusClient
) -> None:
    router = await connect_as(nats_server, "router", "r1")
    try:
        models = tuple(loadreport.ModelTraffic(model=f"m{i}", requests=i) for i in range(500))
        await bus.SignalsPublisher(router, "r1").publish(
            loadreport.LoadReport(ts=time.time(), models=models)
        )
        await router.flush()
        await stored(control, 1)
        _, [record] = await all_reports(control, max_bytes=1024)
        assert record.size > 4 * 1024
        assert len(bus.signals.report_of(record).models) == 500
    finally:
        await bus.close(router)


async def test_a_routers_messages_on_subjects_of_its_own_making_cost_no_signature_check(
    nats_server: TestNatsServer, control: bus.BusClient
) -> None:
    # A router may publish on any subject below `llmgw.signals.router.<its name>.`: messages
    # on new ones each cost every reader a signature check, none of them a report's.
    router = await connect_as(nats_server, "router", "evil")
    junk = 20_000
    try:
        for i in range(junk):
            await router.publish(f"llmgw.signals.router.evil.x{i}", b"x")
        report = loadreport.LoadReport(ts=time.time(), models=(
            loadreport.ModelTraffic(model="m", requests=7),))  # fmt: skip
        await bus.SignalsPublisher(router, "evil").publish(report)
        await router.flush()
        await stored(control, junk + 1)
        verifier = CountingVerifier(nats_server.pki.verifier())
        reader, got = await all_reports(control, verifier=cast(Any, verifier))
        assert [r.subject for r in got] == [subjects.router_signals("evil", 0)]
        assert reader.undecodable == junk
        assert verifier.calls == 1  # the report's alone
        assert reader.refused == 0
        assert all(s.error == f"{s.subject} is not a load-report subject" for s in reader.skipped)
    finally:
        await bus.close(router)


async def test_a_node_flooding_its_own_log_subjects_does_not_get_the_log_readers_closed(
    nats_server: TestNatsServer, control: bus.BusClient
) -> None:
    # The same on the log: a node may write anything below llmgw.events.node.<its id>.,
    # stored whether or not any reader accepts it (its budget quarantines it, later).
    reader = bus.Reader(control, name="t")
    await read_through_a_flood(nats_server, control, reader, junk=True)
    assert reader.undecodable >= 160
