"""The checks a router without keys makes of web pages (llmgw.router.browsers), and the
settings that let some in (auth.allowed_origins, auth.allowed_hosts)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.router import browsers
from llmgw.router.browsers import BrowserGuard
from llmgw.router.config import AuthConfig, RouterConfig, validate

ALLOWED = AuthConfig(allow_anonymous=True, allowed_origins=("https://app.example",),
                     allowed_hosts=("llm.example.internal",))  # fmt: skip
OPEN = AuthConfig(allow_anonymous=True)


@given(st.text(max_size=300).filter(lambda o: o != "https://app.example"))
def test_any_origin_not_listed_is_refused(origin: str) -> None:
    for guard in (BrowserGuard(ALLOWED, "127.0.0.1"), BrowserGuard(OPEN, "0.0.0.0")):
        refused = guard.refusal({"Origin": origin, "Host": "127.0.0.1:8080"})
        assert refused is not None
        assert (refused.status, refused.code) == (403, "origin_not_allowed")
        assert len(refused.message) < 400  # quotes a bounded part of what was sent


def test_an_origin_of_escapes_is_quoted_within_bounds() -> None:
    # Each control character is quoted as four (\\x00): the quote is cut, not the bound.
    refused = browsers.origin_refused("\x00" * 100)
    assert len(refused.message) < 400
    assert "\\x00" in refused.message


def test_a_listed_origin_and_no_origin_are_served() -> None:
    guard = BrowserGuard(ALLOWED, "127.0.0.1")
    assert guard.refusal({"Origin": "https://app.example", "Host": "localhost:1"}) is None
    assert guard.refusal({"Host": "127.0.0.1:8080"}) is None
    assert guard.refusal({}) is None  # no Host: an HTTP/1.0 client, no browser


@given(st.text(max_size=40))
def test_host_is_checked_on_loopback_and_where_names_are_listed(host: str) -> None:
    loopback = BrowserGuard(OPEN, "127.0.0.1")
    listed = BrowserGuard(ALLOWED, "0.0.0.0")
    wildcard = BrowserGuard(OPEN, "0.0.0.0")
    assert wildcard.refusal({"Host": host}) is None  # its names are not known
    for guard in (loopback, listed):
        refused = guard.refusal({"Host": host})
        assert (refused is None) == guard.host_allowed(host)
        if refused is not None:
            assert (refused.status, refused.code) == (403, "host_not_allowed")


@pytest.mark.parametrize(
    ("host", "served"),
    [("llm.example.internal", True), ("LLM.Example.Internal:8080", True),
     ("127.0.0.1:8080", True), ("[::1]:8080", True), ("llm.example.internal.evil", False),
     ("evil.llm.example.internal", False), ("llm.example.internal:x", False),
     ("localhost:8080", True), ("localhost.evil.example", False),
     ("localhost.evil.example:8080", False), ("127.0.0.1.evil.example", False)],
)  # fmt: skip
def test_listed_names_with_any_port_in_any_case(host: str, served: bool) -> None:
    guard = BrowserGuard(ALLOWED, "127.0.0.1")
    # Asked again: a Host refused once is not remembered as good.
    for _ in range(2):
        assert (guard.refusal({"Host": host}) is None) is served


def test_the_hosts_remembered_are_bounded() -> None:
    guard = BrowserGuard(OPEN, "127.0.0.1")
    for port in range(browsers.MAX_KNOWN_HOSTS * 2):
        assert guard.refusal({"Host": f"127.0.0.1:{port}"}) is None
    assert len(guard.known_hosts) == browsers.MAX_KNOWN_HOSTS
    assert guard.refusal({"Host": "evil.example:1"}) is not None
    assert "evil.example:1" not in guard.known_hosts


def _problems(**auth: object) -> list[str]:
    return validate(RouterConfig(auth=AuthConfig(allow_anonymous=True, **auth)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("origin", "said"),
    [("null", "sandboxed frames"), ("https://app.example/", "'https://app.example'"),
     ("HTTPS://App.Example:443", "'https://app.example'"), ("app.example", "no origin"),
     ("https://app.example/ui", "no origin"), ("https://u@app.example", "no origin"),
     ("*", "no origin"), ("https://a b.example", "no origin"),
     ("https://bücher.example", "'https://xn--bcher-kva.example'")],
)  # fmt: skip
def test_an_origin_no_browser_sends_is_a_config_problem(origin: str, said: str) -> None:
    (problem,) = _problems(allowed_origins=(origin,))
    assert "auth.allowed_origins[0]" in problem
    assert said in problem


@pytest.mark.parametrize("name", ["llm.example.internal:8080", "*.example", "*", "::1", "",
                                  "https://llm.example", "a b"])  # fmt: skip
def test_a_host_entry_that_is_no_name_is_a_config_problem(name: str) -> None:
    (problem,) = _problems(allowed_hosts=(name,))
    assert "auth.allowed_hosts[0]" in problem


def test_origins_and_names_as_written_are_taken() -> None:
    origins = ("https://app.example", "http://127.0.0.1:3000", "chrome-extension://abcdefgh")
    names = ("LLM.example.internal", "[fe80::1]", "10.0.0.5")
    assert _problems(allowed_origins=origins, allowed_hosts=names) == []
