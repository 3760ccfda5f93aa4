"""What identities cost: issuing certificates, rendering the authorization for a large fleet,
nats-server reloading it, and a client's mutual-TLS connect.

    .venv/bin/python tests/bench/bench_pki.py [--identities 1000] [--connects 50]

Prints one line per figure. Bounded: one nats-server, `--identities` certificates, a fixed
number of connects; about 10 s on this machine with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import nats

from llmgw import bus, natsconf, natsd
from llmgw.pki.ca import CertificateAuthority
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir, utcnow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=1000)
    parser.add_argument("--connects", type=int, default=50)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        certs = CertDir(root / "certs")
        now = utcnow()
        ca = CertificateAuthority.create(now=now)
        certs.save_ca(ca)
        certs.save_server(ca.issue_server(["127.0.0.1", "localhost"], now=now))
        ids = [Identity("node", f"node-{i:05d}") for i in range(args.identities)]
        ids += [Identity("router", "router-1"), Identity("control", "control-1")]
        t = time.perf_counter()
        for identity in ids:
            certs.save_client(identity, ca.issue_client(identity, now=now))
        issue_s = time.perf_counter() - t
        print(f"issue: {len(ids) / issue_s:,.0f} client certificates/s (EC P-256, written 0600)")

        t = time.perf_counter()
        path = certs.write_authorization(root / "authorization.conf")
        render_s = time.perf_counter() - t
        size = path.stat().st_size
        print(
            f"render: {len(ids)} identities in {render_s * 1000:.0f} ms, "
            f"{size / 1024:.0f} KiB of authorization ({size / len(ids):.0f} B per identity)"
        )

        port = natsd.free_port()
        cfg = natsconf.ServerConfig(
            store_dir=root / "js",
            cert_file=certs.server_cert,
            key_file=certs.server_key,
            ca_file=certs.ca_cert,
            authorization_file=Path("authorization.conf"),
            port=port,
            http_port=None,
        )
        (root / "nats.conf").write_text(natsconf.render_config(cfg))
        server = natsd.NatsServer(root / "nats.conf", port=port, log_path=root / "nats.log")
        t = time.perf_counter()
        server.start()
        print(f"start: nats-server ready in {(time.perf_counter() - t) * 1000:.0f} ms")
        try:
            reloads = []
            for _ in range(5):
                t = time.perf_counter()
                server.reload()
                reloads.append(time.perf_counter() - t)
            print(
                f"reload: {statistics.median(reloads) * 1000:.0f} ms median of 5 "
                f"(SIGHUP until the server logs it applied {len(ids)} users)"
            )
            asyncio.run(connects(server.url, certs, ids[0], args.connects))
        finally:
            server.stop()


async def connects(url: str, certs: CertDir, identity: Identity, n: int) -> None:
    # asyncio warns on every TLS close of nats-py's transport ("returning true from
    # eof_received() has no effect when using ssl"): harmless, and it would bury the figures.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    ctx = certs.client_context(identity)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        nc = await nats.connect(url, tls=ctx, inbox_prefix=identity.inbox_prefix)
        await nc.flush()
        times.append(time.perf_counter() - t)
        await bus.close(nc)
    times.sort()
    print(
        f"connect: mTLS + verify_and_map + first PONG, median {statistics.median(times) * 1000:.1f}"
        f" ms, p90 {times[int(0.9 * (n - 1))] * 1000:.1f} ms over {n} connects"
    )


if __name__ == "__main__":
    main()
