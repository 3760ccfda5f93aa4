"""Router configuration: loading, env overrides and validation that says what to change."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from llmgw import config
from llmgw.router import config as rc


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.yaml"
    p.write_text(text)
    return p


GOOD = """
listen: {host: 127.0.0.1, port: 8080}
auth: {allow_anonymous: true}
models:
  - name: llama
    aliases: [llama-latest]
    fallbacks: [small]
    deadlines: {first_token_s: 5, idle_s: 2}
  - name: small
endpoints:
  - {id: a, url: "http://10.0.0.1:8000", models: [llama]}
  - {id: b, url: "http://10.0.0.2:8000", models: [llama, small]}
weights: {prefix: 0}
"""


def test_a_good_config_loads_with_env_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_ROUTER__LISTEN__PORT", "9001")
    monkeypatch.setenv("LLMGW_ROUTER__WEIGHTS__QUEUE", "3.5")
    cfg = rc.load(write(tmp_path, GOOD))
    assert cfg.listen.port == 9001
    assert cfg.weights.queue == 3.5
    assert cfg.weights.prefix == 0
    assert cfg.models[0].deadlines.first_token_s == 5
    assert set(rc.model_names(cfg)) == {"llama", "llama-latest", "small"}


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["endpoints"].append(dict(d["endpoints"][0])), "endpoint id 'a' is used twice"),
        (lambda d: d["models"][1].update(aliases=["llama"]), "shadows the model"),
        (lambda d: d["models"][1].update(aliases=["llama-latest"]), "claimed by both"),
        (lambda d: d["models"][0].update(fallbacks=["nope"]), "falls back to 'nope'"),
        (lambda d: d["endpoints"][0].update(models=["llama-latest"]), "not its alias"),
        (lambda d: d["endpoints"][0].update(url="10.0.0.1:8000"), "must look like http"),
        (lambda d: d.update(auth={}), "allow_anonymous: true"),
        (lambda d: d["models"][0]["deadlines"].update(idle_s=0), "deadlines.idle_s"),
        (lambda d: d.update(body_timeout_s=0), "body_timeout_s must be above 0"),
        (lambda d: d.update(cache={"max_prompt_chars": 10}), "max_prompt_chars must be at least"),
        (lambda d: d.update(max_answer_bytes=10), "max_answer_bytes must be at least 1024"),
        (lambda d: d.update(log={"servers": []}), "log.servers is empty"),
        (lambda d: d.update(log={"ca_file": "ca.pem"}), "log.cert_file is not set"),
        # Taken silently before: a negative weight prefers the endpoints it should avoid,
        # a negative open_s opens a breaker for no time at all.
        (lambda d: d.update(weights={"queue": -1}), "weights.queue must be 0 or more"),
        (lambda d: d.update(breaker={"open_s": -5}), "breaker.open_s must be 0 or more"),
        (lambda d: d.update(upstream_connections=-1), "upstream_connections must be 0 or more"),
    ],
)
def test_validation_refuses_and_says_what_to_change(
    tmp_path: Path, edit: object, expected: str
) -> None:
    import yaml

    data = yaml.safe_load(GOOD)
    edit(data)  # type: ignore[operator]
    with pytest.raises(config.ConfigError) as err:
        rc.load(write(tmp_path, yaml.safe_dump(data)))
    assert expected in str(err.value)
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://user:s3cret-pw@10.0.0.1:8000",
        "user:s3cret-pw@10.0.0.1:8000",
        "http://user:s3cret-pw@[::1:8000",  # urllib cannot read it
        "http://user:s3cret-pw@10.0.0.1:99999",  # urllib reads it, but not its port
        "http://user:s3cret-pw@10.0.0.1:port",
        "http://user:s3cret-pw@10.0.0.1:0",
    ],
)
def test_a_bad_endpoint_url_is_refused_and_quoted_without_its_password(
    tmp_path: Path, url: str
) -> None:
    """Before: the problem quoted the URL's password; a URL urllib cannot read raised
    ValueError out of the validation, and one with a port out of range was taken, to
    fail at the first request."""
    import yaml

    data = yaml.safe_load(GOOD)
    data["endpoints"][0]["url"] = url
    with pytest.raises(config.ConfigError) as err:
        rc.load(write(tmp_path, yaml.safe_dump(data)))
    said = str(err.value)
    assert "must look like http://host:port" in said
    assert "s3cret-pw" not in said
    assert "user:***@10.0.0.1" in said or "user:***@[::1:8000" in said


def test_unknown_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="lisen"):
        rc.load(write(tmp_path, GOOD + "lisen: {port: 1}\n"))


def test_config_round_trips_through_json() -> None:
    """Workers receive the config as JSON: it must survive the trip."""
    cfg = msgspec.convert(
        {"auth": {"allow_anonymous": True}, "models": [{"name": "m", "aliases": ["x"]}]},
        rc.RouterConfig,
    )
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=rc.RouterConfig) == cfg
