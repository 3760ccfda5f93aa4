"""`ctl status` says plainly when nobody leads, instead of naming the last elected leader."""

from __future__ import annotations

from llmgw.ctl.leadership import LeaseSeen, leader_status

NOW = 1_800_000_000.0


def status(lease: LeaseSeen | None, **kw: object) -> dict[str, object]:
    args: dict[str, object] = {"leader": "control-a", "epoch": 7, "elected_at": NOW - 60}
    args.update(kw)
    return leader_status(lease, now=NOW, **args)  # type: ignore[arg-type]


def test_the_holder_that_the_log_elected_leads() -> None:
    out = status(LeaseSeen(holder="control-a", epoch=7, written=NOW - 1, ttl_s=10))
    assert out["state"] == "leading"
    assert out["holder"] == "control-a"
    assert out["since"] == NOW - 60
    assert str(out["text"]).startswith("leader control-a (epoch 7) since 2027-01-15T07:59:00.000Z")


def test_no_lease_key_is_no_leader() -> None:
    out = status(None)
    assert out["state"] == "none"
    assert str(out["text"]).startswith("NO LEADER: the lease is free")
    assert "last elected leader is control-a (epoch 7, at 2027-" in str(out["text"])


def test_a_released_lease_says_since_when() -> None:
    out = status(LeaseSeen(written=NOW - 30, released=True))
    assert out["state"] == "none"
    assert out["since"] == NOW - 30
    assert "NO LEADER: the lease was released at 2027-" in str(out["text"])


def test_a_lease_past_its_ttl_is_expired() -> None:
    out = status(LeaseSeen(holder="control-a", epoch=7, written=NOW - 30, ttl_s=10))
    assert out["state"] == "none"
    assert out["since"] == NOW - 20
    assert "the lease of control-a expired at" in str(out["text"])


def test_a_holder_other_than_the_logs_leader_is_reported() -> None:
    out = status(LeaseSeen(holder="control-b", epoch=8, written=NOW - 1, ttl_s=10))
    assert out["state"] == "unannounced"
    assert out["holder"] == "control-b"
    text = str(out["text"])
    assert text.startswith("NO LEADER in the log: control-b holds the lease (epoch 8)")
    assert "control-a (epoch 7" in text
    # The same name at another epoch (a restart that has not announced itself yet) too.
    again = status(LeaseSeen(holder="control-a", epoch=9, written=NOW - 1, ttl_s=10))
    assert again["state"] == "unannounced"


def test_an_empty_log() -> None:
    out = status(None, leader="", epoch=0, elected_at=None)
    assert out["text"] == (
        "NO LEADER: the lease is free (never taken, or expired); "
        "no leader was ever elected in the log"
    )


def test_a_lease_is_expired_from_the_moment_its_ttl_ends() -> None:
    out = status(LeaseSeen(holder="control-a", epoch=7, written=NOW - 10, ttl_s=10))
    assert out["state"] == "none"
    assert out["since"] == NOW


def test_another_holder_at_the_logs_epoch_is_not_the_leader() -> None:
    # Whoever holds the lease must be the one the log elected, whatever epoch it gives.
    out = status(LeaseSeen(holder="control-b", epoch=7, written=NOW - 1, ttl_s=10))
    assert out["state"] == "unannounced"
    assert out["holder"] == "control-b"


def test_a_lease_naming_no_holder_is_no_leader() -> None:
    out = status(LeaseSeen(holder="", epoch=7, written=NOW - 1, ttl_s=10))
    assert out["state"] == "none"
    assert out["holder"] is None
    assert str(out["text"]).startswith("NO LEADER: the lease is free")
