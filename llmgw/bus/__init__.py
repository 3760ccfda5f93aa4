"""The NATS shell of llmgw: connect, provision the log, publish, replay, snapshots, lease.

Everything that touches JetStream goes through this package; everything above it
(control plane, agents, routers, `llmgw ctl`) deals in `llmgw.core.events` only.
The stream is `llmgw-events` (`llmgw.core.subjects.STREAM`); the engines' KV blocks go
through `llmgw-kv` (`KvPublisher`, `KvReader`: llmgw.bus.kvlog) and the routers' load reports
through `llmgw-signals` (`SignalsPublisher`, `SignalsReader`: llmgw.bus.signals); neither is
part of it.

How the control plane uses it (a sketch; `llmgw.control` owns the real loop):

    keys = bus.Keys.load(ca_file=ca, cert_file=cert, key_file=key)   # signs and verifies
    nc = await bus.connect(url, tls=ctx, identity=Identity("control", me), name=me, keys=keys)
    js = nc.jetstream()
    await bus.provision(js, replicas=3)
    lease = await bus.Lease.open(js, me, ttl_s=10)
    snap = await (await bus.SnapshotStore.open(js)).load()
    reader = bus.Reader(nc, after_seq=snap.seq if snap else 0)   # snapshot + tail, then live
    # fold every record; remember the last seq seen on llmgw.events.control.> as `last`
    if await lease.acquire():                                    # renew every lease.renew_every_s
        await bus.Publisher(js).publish(decision, fence=bus.Fence(CONTROL_EVENTS_ALL, last))

A fence names one subject filter: commands (`llmgw.cmd.>`) are outside
`llmgw.events.control.>`, so fence them on their own filter, or publish the
(fenced) decision first and its commands only once it was accepted.

NATS API subjects each role uses (the authorization must allow them; `<s>` is
`llmgw-events`, all under `$JS.API.`):
- every publisher: `STREAM.INFO.<s>` is not needed; publishing needs only the
  event subject and the identity's inbox (for the ack);
- a `Reader`: `CONSUMER.CREATE.<s>.<name>` (or `.<name>.<filter>` with a single
  filter), `CONSUMER.MSG.NEXT.<s>.<name>`, `CONSUMER.INFO.<s>.<name>`,
  `CONSUMER.DELETE.<s>.<name>`; consumer names are `<name>-<random>` (default
  `reader-...`), or exactly `consumer_name` (a node reads its commands through
  `cmd-<node>` with the single filter `llmgw.cmd.<node>`);
- the control plane also: `STREAM.INFO.*`, `STREAM.CREATE.*` (provisioning of
  `llmgw-events`, `llmgw-kv`, `KV_llmgw-lease`, `OBJ_llmgw-snapshots`), `$KV.llmgw-lease.>`,
  `DIRECT.GET.KV_llmgw-lease.>` / `STREAM.MSG.GET.KV_llmgw-lease`, `$O.llmgw-snapshots.>`
  and the consumer API on `OBJ_llmgw-snapshots` (listing snapshots), and
  `STREAM.MSG.DELETE.llmgw-events` (`delete_messages`: what no fold uses).
"""

from llmgw.bus.attestations import load as load_attestations
from llmgw.bus.connection import BusClient, backoff_delay, close, connect
from llmgw.bus.deletion import Deleted, delete_messages
from llmgw.bus.jetstream import JetStreamLog
from llmgw.bus.keys import Keys
from llmgw.bus.kvlog import KvPublisher, KvReader
from llmgw.bus.lease import Holder, Lease, LeaseLost
from llmgw.bus.ports import EventLog, LeasePort, LogReader, SnapshotPort
from llmgw.bus.provisioning import (
    LEASE_BUCKET,
    SNAPSHOT_BUCKET,
    ProvisionConflict,
    Provisioned,
    StreamSettings,
    provision,
)
from llmgw.bus.publisher import Fence, FenceRefused, Published, Publisher, PublishError
from llmgw.bus.reader import Reader, ReaderError, Record, Skipped, SkipSink
from llmgw.bus.signals import SignalsPublisher, SignalsReader
from llmgw.bus.snapshots import Snapshot, SnapshotStore
from llmgw.bus.tlsrefusal import Refusal, TlsRefused, refusal

__all__ = [
    "LEASE_BUCKET",
    "SNAPSHOT_BUCKET",
    "BusClient",
    "Deleted",
    "EventLog",
    "Fence",
    "FenceRefused",
    "Holder",
    "JetStreamLog",
    "Keys",
    "KvPublisher",
    "KvReader",
    "Lease",
    "LeaseLost",
    "LeasePort",
    "LogReader",
    "ProvisionConflict",
    "Provisioned",
    "PublishError",
    "Published",
    "Publisher",
    "Reader",
    "ReaderError",
    "Record",
    "Refusal",
    "SignalsPublisher",
    "SignalsReader",
    "SkipSink",
    "Skipped",
    "Snapshot",
    "SnapshotPort",
    "SnapshotStore",
    "StreamSettings",
    "TlsRefused",
    "backoff_delay",
    "close",
    "connect",
    "delete_messages",
    "load_attestations",
    "provision",
    "refusal",
]
