"""The front door's costs and accuracy, measured side by side on one machine in one run:

    .venv/bin/python -m tests.bench.bench_front_door            # ~2 minutes
    .venv/bin/python -m tests.bench.bench_front_door --quick    # a smoke run

1. **Keys' cost.** A real nats-server (mTLS) whose log holds `--keys` (10,000) tenant keys,
   three `llmgw sim` engines (zero latency, 16 tokens per answer), and three routers
   following the log: anonymous requests (keys off), a key without limits, and a key with a
   requests/s limit high enough never to refuse (its fleet-wide counter is still taken per
   lease). Each takes the same streamed chat load, in interleaved rounds; the figures are
   the router process's CPU time per request (from /proc) and TTFT p50.
2. **Limit accuracy** across 1, 2 and 4 routers: a key limited to `--rps` requests/s,
   hammered through all of them at once for `--seconds`; requests answered per second
   (min / mean / max) against the limit.
3. **Revocation latency**: a key is created, used on every router, revoked; the time from
   ctl's write to each router's first refusal, over `--revocations` keys (p50, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmgw import bus  # noqa: E402
from llmgw.core import events, tenancy  # noqa: E402
from llmgw.pki.identity import Identity  # noqa: E402
from llmgw.router import auth  # noqa: E402
from tests.harness import TestNatsServer, TestPki, connect_as  # noqa: E402
from tests.integration.router_kit import Router, Sim  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
FAILED: dict[int, int] = {}
Headers = Callable[[int], dict[str, str]]
"""Statuses other than 200 under load, by status (printed with the figures)."""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def feed(server: TestNatsServer, name: str) -> dict[str, Any]:
    server.pki.client_tls("router", name)
    identity = Identity("router", name)
    c = server.pki.certs
    return {"servers": [server.url], "name": name, "ca_file": str(c.ca_cert),
            "cert_file": str(c.cert(identity)), "key_file": str(c.key(identity))}  # fmt: skip


async def publish_keys(server: TestNatsServer, n: int, special: dict[str, Any]) -> dict[str, str]:
    """`n` filler keys and the named ones of `special` (name -> settings): their secrets."""
    op = await connect_as(server, "operator", "bench")
    secrets: dict[str, str] = {}
    try:
        pub = bus.Publisher(op.jetstream(), timeout_s=10.0)
        now = time.time()
        items = [(f"filler-{i}", {"requests_per_s": 100.0} if i % 2 else {}) for i in range(n)]
        items += list(special.items())
        for i in range(0, len(items), 500):
            batch = []
            for name, extra in items[i : i + 500]:
                secret = secrets[name] = auth.new_key()
                batch.append(events.KeyCreated(
                    id=f"k-{name}", ts=now, operator="bench",
                    key=tenancy.KeySettings(name=name, **extra), sha256=auth.digest(secret),
                ))  # fmt: skip
            await asyncio.gather(*(pub.publish(e) for e in batch))
    finally:
        await op.close()
    return secrets


async def until(check: Any, within_s: float) -> float:
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > within_s:
            raise RuntimeError("not within the time allowed")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True,
        "max_tokens": 16}  # fmt: skip


async def status(http: aiohttp.ClientSession, router: Router, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(router.url + "/v1/chat/completions", json=BODY, headers=headers) as r:
        await r.read()
        return r.status


def bearer(key: str | None) -> Headers:
    """The headers for request i: the same key on every request."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return lambda _: headers


async def load(
    http: aiohttp.ClientSession, router: Router, key: str | Headers | None, n: int,
    concurrency: int, body: dict[str, Any] | None = None,
) -> tuple[float, float]:  # fmt: skip
    """(router CPU seconds per request, TTFT p50) over `n` streamed requests.
    `key` is one API key for all of them, or a function giving request i's headers."""
    headers = key if callable(key) else bearer(key)
    ttfts: list[float] = []
    sent = 0

    async def one() -> None:
        nonlocal sent
        while sent < n:
            i, sent = sent, sent + 1
            t0 = time.perf_counter()
            async with http.post(router.url + "/v1/chat/completions", json=body or BODY,
                                 headers=headers(i)) as r:  # fmt: skip
                if r.status != 200:
                    FAILED[r.status] = FAILED.get(r.status, 0) + 1
                    print(f"  (a request answered {r.status}: {(await r.read())[:200]!r})")
                    continue
                await r.content.readany()
                ttfts.append(time.perf_counter() - t0)
                await r.read()

    before = cpu_s(router.proc.pid)
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return (cpu_s(router.proc.pid) - before) / n, statistics.median(ttfts)


async def keys_cost(args: argparse.Namespace, server: TestNatsServer, sims: list[Sim],
                    tmp: Path) -> None:  # fmt: skip
    print(f"publishing {args.keys} keys ...", flush=True)
    secrets = await publish_keys(server, args.keys, {
        "plain": {}, "limited": {"requests_per_s": 1e6}})  # fmt: skip
    eps = {f"e{i}": s for i, s in enumerate(sims)}
    targets: dict[str, str | None] = {
        "keys off (anonymous)": None,
        "a key, 10k in the log": secrets["plain"],
        "a key with a fleet limit": secrets["limited"],
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    # The three loads take turns on one router process per round, which serves anonymous
    # requests and counts a request with a key as that key's (the same path as a router
    # that requires keys): two processes of the same router differ by several per cent in
    # CPU per request on this machine, more than what is measured here.
    feeds = [feed(server, f"cost-{i}") for i in range(args.rounds)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for rnd in range(args.rounds):
            router = Router.start(tmp, eps, feed=feeds[rnd], auth={"allow_anonymous": True})
            try:
                for key in targets.values():
                    await until(lambda r=router, k=key: _ok(http, r, k), 60)
                    await load(http, router, key, 300, args.concurrency)  # warm-up
                order = list(targets.items())
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                for name, key in order:
                    results[name].append(
                        await load(http, router, key, args.requests, args.concurrency)
                    )
            finally:
                router.stop()
    if FAILED:
        print(f"  failed requests by status: {FAILED}")
    base = statistics.median(c for c, _ in results["keys off (anonymous)"])
    print(f"\n1. keys' cost: {args.requests} streamed requests at {args.concurrency} "
          f"concurrent, the three in turn on one router per round, {args.rounds} rounds, "
          f"{args.keys} keys in the log (medians)")  # fmt: skip
    print(f"  {'target':<26} {'CPU/request':>12} {'vs off':>8} {'TTFT p50':>10}")
    for name, rows in results.items():
        c = statistics.median(x for x, _ in rows)
        t = statistics.median(y for _, y in rows)
        spread = f"({min(x for x, _ in rows) * 1e6:.0f}-{max(x for x, _ in rows) * 1e6:.0f})"
        print(f"  {name:<26} {c * 1e6:>9.0f} us {100 * (c / base - 1):>+7.1f}% {t * 1e3:>7.2f} ms"
              f"  {spread}")  # fmt: skip
    extra = await key_path_us()
    print(
        f"  in-process, what a key adds to a request's path: {extra['plain']:.1f} us"
        f" ({100 * extra['plain'] / (base * 1e6):.1f}% of {base * 1e6:.0f} us), with a fleet"
        f" limit {extra['limited']:.1f} us ({100 * extra['limited'] / (base * 1e6):.1f}%)"
    )


async def key_path_us(n: int = 200_000) -> dict[str, float]:
    """What the key adds per request in-process, in microseconds: authentication among
    10,000 keys, the model check, the quotas (a lease in hand), the key's metrics and
    usage; against an anonymous request's share of the same calls."""
    from llmgw.core import state
    from llmgw.core.profile import ModelProfile
    from llmgw.router import admission
    from llmgw.router.errors import Refusal
    from llmgw.router.metrics import Metrics
    from llmgw.router.quotas import Quotas
    from tests.unit.test_quotas import Store

    secrets = {f"k{i}": auth.new_key() for i in range(10_000)}
    log_keys = {
        name: state.KeyState(settings=tenancy.KeySettings(
            name=name, requests_per_s=1e6 if name == "k1" else None), sha256=auth.digest(s))
        for name, s in secrets.items()
    }  # fmt: skip
    keys = auth.merged(None, log_keys, 0.0)
    profile = ModelProfile(name="m", engine="sim")
    metrics, quotas = Metrics(), Quotas(Store())  # type: ignore[arg-type]

    async def run(header: str | None) -> float:
        anonymous = header is None
        p0 = admission.authenticate(keys, header, time.time(), anonymous)
        if isinstance(p0, auth.Principal) and p0.limited:
            await quotas.admit(p0, time.time(), time.monotonic())  # the first lease
        t0 = time.perf_counter()
        for _ in range(n):
            p = admission.authenticate(keys, header, time.time(), anonymous)
            assert not isinstance(p, Refusal)
            admission.admit(p, "m", profile)
            if p is not None:
                wall, mono = time.time(), time.monotonic()
                if p.limited and not quotas.admit_now(p, wall):
                    await quotas.admit(p, wall, mono)
                metrics.key_usage(p.name, p.settings.team, "m", 16, 16)
                quotas.usage.used(p, "m", 16, 16)
                metrics.key_request(p.name, p.settings.team, "m", 200)
                quotas.usage.request_done(p, "m")
        return (time.perf_counter() - t0) / n * 1e6

    off = await run(None)
    return {"plain": await run(f"Bearer {secrets['k0']}") - off,
            "limited": await run(f"Bearer {secrets['k1']}") - off}  # fmt: skip


async def _ok(http: aiohttp.ClientSession, router: Router, key: str | None) -> bool:
    try:
        got = await status(http, router, key)
    except aiohttp.ClientError:
        return False
    if got != 200 and os.environ.get("BENCH_DEBUG"):
        print("not yet", router.url, got, flush=True)
    return got == 200


class Tally:
    """Requests answered per second of [start, end), and those refused."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.ok: dict[int, int] = {}
        self.refused = 0

    async def hammer(self, http: aiohttp.ClientSession, r: Router, key: str) -> None:
        while time.time() < self.end:
            s = await status(http, r, key)
            done = time.time()
            if s == 200 and self.start <= done < self.end:
                self.ok[int(done)] = self.ok.get(int(done), 0) + 1
            elif s == 429:
                self.refused += 1


async def _refused(http: aiohttp.ClientSession, r: Router, key: str, t0: float) -> float:
    """Seconds from `t0` until `r` refuses `key`."""
    while True:
        if await status(http, r, key) != 200:
            return time.monotonic() - t0
        await asyncio.sleep(0.005)


async def accuracy(args: argparse.Namespace, server: TestNatsServer, sims: list[Sim],
                   tmp: Path) -> None:  # fmt: skip
    eps = {f"e{i}": s for i, s in enumerate(sims)}
    print(f"\n2. a key limited to {args.rps:g}/s, hammered through N routers for "
          f"{args.seconds} s (answered per second)")  # fmt: skip
    print(f"  {'routers':>7} {'min':>6} {'mean':>7} {'max':>6} {'refused':>8}")
    for n in (1, 2, 4):
        secret = (await publish_keys(server, 0, {f"acc{n}": {"requests_per_s": args.rps}}))[
            f"acc{n}"]  # fmt: skip
        # Every certificate first: each one reloads the server's authorization.
        feeds = [feed(server, f"a{n}-{i}") for i in range(n)]
        routers = [Router.start(tmp, eps, feed=f, auth={}) for f in feeds]
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                for r in routers:
                    await until(lambda r=r, k=secret: _ok(http, r, k), 30)
                start = int(time.time()) + 2
                tally = Tally(start, start + args.seconds)
                await asyncio.gather(*(tally.hammer(http, r, secret) for r in routers
                                       for _ in range(8)))  # fmt: skip
            per_s = [tally.ok.get(s, 0) for s in range(tally.start, tally.end)]
            print(f"  {n:>7} {min(per_s):>6} {statistics.mean(per_s):>7.1f} {max(per_s):>6} "
                  f"{tally.refused:>8}")  # fmt: skip
        finally:
            for r in routers:
                r.stop()


async def revocation(args: argparse.Namespace, server: TestNatsServer, sims: list[Sim],
                     tmp: Path) -> None:  # fmt: skip
    eps = {f"e{i}": s for i, s in enumerate(sims)}
    feeds = [feed(server, f"rv{i}") for i in range(3)]
    routers = [Router.start(tmp, eps, feed=f, auth={}) for f in feeds]
    op = await connect_as(server, "operator", "bench")
    took: list[float] = []
    try:
        pub = bus.Publisher(op.jetstream(), timeout_s=10.0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for i in range(args.revocations):
                name = f"rev{i}"
                secret = (await publish_keys(server, 0, {name: {}}))[name]
                for r in routers:
                    await until(lambda r=r, k=secret: _ok(http, r, k), 30)
                await pub.publish(events.KeyRevoked(id=f"rv-{name}", ts=time.time(),
                                                    operator="bench", name=name))  # fmt: skip
                t0 = time.monotonic()
                took += await asyncio.gather(*(_refused(http, r, secret, t0) for r in routers))
    finally:
        await op.close()
        for r in routers:
            r.stop()
    took.sort()
    p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
    print(f"\n3. revocation: {args.revocations} keys x 3 routers, from the write to each "
          f"router's first refusal: p50 {statistics.median(took) * 1e3:.0f} ms, p99 "
          f"{p99 * 1e3:.0f} ms, max {took[-1] * 1e3:.0f} ms")  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rps", type=float, default=50.0)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--revocations", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="cost,accuracy,revocation")
    args = ap.parse_args()
    if args.quick:
        args.keys, args.requests, args.rounds, args.seconds, args.revocations = 500, 300, 1, 3, 3
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-front-door-"))
    sims = [Sim.start("m") for _ in range(3)]
    server = TestNatsServer(TestPki(tmp / "pki"), tmp / "nats")
    server.root.mkdir(parents=True)
    try:
        server.start()
        control = await connect_as(server, "control", "c1")
        await bus.provision(control.jetstream())
        await control.close()
        for part in args.only.split(","):
            await {"cost": keys_cost, "accuracy": accuracy, "revocation": revocation}[part](
                args, server, sims, tmp)  # fmt: skip
    finally:
        server.close()
        for s in sims:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
