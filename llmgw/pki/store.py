"""Where an llmgw PKI lives on disk, and how its files are written.

A certificate directory (`nats/certs/` by default) holds:

    ca.pem  ca-key.pem              the private CA
    server.pem  server-key.pem      the NATS server's certificate
    <kind>/<name>.pem  <name>-key.pem   one client identity each (node, router, operator, control)

The client certificates present in the directory *are* the list of identities the rendered
NATS authorization admits: issuing one adds a user, deleting its files (and re-rendering)
removes it. Used by `llmgw ctl cert`, `llmgw up` and the test harness.

Private keys are created with mode 0600 from the first byte (never chmod-ed afterwards,
which would leave a window where another user could read them), and an existing key is
never replaced unless the caller passes `force`.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from llmgw.pki import authorization, tls
from llmgw.pki.ca import CertificateAuthority, Issued, PkiInputError
from llmgw.pki.identity import KINDS, Identity

DEFAULT_DIR = Path("nats/certs")


class KeyExistsError(PkiInputError):
    """Refusal to overwrite an existing private key without --force."""


def write_private(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write a private key readable only by its owner; refuse to replace one unless `force`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not force:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyExistsError(
                f"{path} already exists and was left as it is: pass --force to replace it "
                "with a new key"
            ) from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    _replace(path, data, 0o600)


def write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, data, 0o644)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` atomically: a reader never sees half a file, and the new file has
    `mode` from its first byte."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class CertDir:
    """The files of one PKI under `root`."""

    root: Path = DEFAULT_DIR

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca-key.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server-key.pem"

    def cert(self, identity: Identity) -> Path:
        return self.root / identity.kind / f"{identity.name}.pem"

    def key(self, identity: Identity) -> Path:
        return self.root / identity.kind / f"{identity.name}-key.pem"

    def load_ca(self) -> CertificateAuthority:
        try:
            return CertificateAuthority.load(self.ca_cert.read_bytes(), self.ca_key.read_bytes())
        except FileNotFoundError:
            raise PkiInputError(
                f"no CA in {self.root}: run `llmgw ctl cert init` first "
                "(or pass --dir where the CA lives)"
            ) from None

    def save_ca(self, ca: CertificateAuthority, *, force: bool = False) -> None:
        # The key first: if it is refused, the existing certificate stays consistent with it.
        write_private(self.ca_key, ca.key_pem, force=force)
        write_public(self.ca_cert, ca.cert_pem)

    def save_server(self, issued: Issued, *, force: bool = False) -> None:
        write_private(self.server_key, issued.key_pem, force=force)
        write_public(self.server_cert, issued.cert_pem)

    def save_client(self, identity: Identity, issued: Issued, *, force: bool = False) -> None:
        write_private(self.key(identity), issued.key_pem, force=force)
        write_public(self.cert(identity), issued.cert_pem)

    def identities(self) -> list[Identity]:
        """Every client identity with a certificate here, sorted by kind then name."""
        out: list[Identity] = []
        for kind in KINDS:
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for path in sorted(folder.glob("*.pem")):
                if path.name.endswith("-key.pem"):
                    continue
                try:
                    out.append(Identity(kind, path.stem))
                except ValueError:
                    # A stray file whose name is not a valid identity is not a user; skip it
                    # rather than fail the whole rendering.
                    continue
        return out

    @property
    def authorization_file(self) -> Path:
        """Where the rendered authorization goes by default: beside the certs folder, where
        nats/llmgw.conf includes it."""
        return self.root.parent / "authorization.conf"

    def write_authorization(self, path: Path | None = None) -> Path:
        """Render the authorization for every identity with a certificate here."""
        target = self.authorization_file if path is None else path
        text = authorization.render(self.identities(), source=str(self.root))
        write_public(target, text.encode())
        return target

    def client_context(self, identity: Identity) -> ssl.SSLContext:
        return tls.client_context(
            ca_file=self.ca_cert, cert_file=self.cert(identity), key_file=self.key(identity)
        )


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def expires(path: Path) -> dt.datetime:
    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
