"""Secrets out of text (llmgw.core.redaction): an engine's key out of what the engine wrote,
a URL's password out of a message that quotes the URL, wherever they are placed."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from llmgw.core.redaction import (
    FRAGMENT,
    KEY_MARK,
    PASSWORD_MARK,
    _in_json,
    bytes_without_key,
    engine_words,
    shown_url,
    without_key,
    without_url_secret,
)

URLSAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
keys = st.text(URLSAFE, min_size=1, max_size=64)
"""Keys as the agent makes them (`secrets.token_urlsafe`), of any length."""
any_keys = st.text(st.characters(exclude_characters="\x00"), min_size=1, max_size=64)
"""Keys of any characters but NUL (which stands for a mark where a test looks)."""


def found(needle: str, text: str) -> bool:
    """Whether `needle` is in `text`, in any letter case."""
    return re.search(re.escape(needle), text, re.IGNORECASE) is not None


def unmarked(text: str, mark: str = KEY_MARK) -> str:
    """`text` with its marks as NUL: a key found there is in what was left, not made of a
    mark's letters."""
    return text.replace(mark, "\x00")


@given(before=st.text(), key=any_keys, after=st.text(), times=st.integers(1, 3))
@example(before="a", key="aaaaaaaaab", after="", times=1)  # the key's start, repeated first
@example(before="", key="e", after="", times=1)  # a key that a mark contains
def test_the_key_never_survives_wherever_it_is(
    before: str, key: str, after: str, times: int
) -> None:
    text = before + (key + after) * times
    out = without_key(text, key)
    assert not found(key, unmarked(out))
    assert KEY_MARK in out


ENCODINGS: dict[str, Callable[[str], str]] = {
    "as is": lambda k: k,
    "upper case": str.upper,
    "lower case": str.lower,
    "in JSON": lambda k: json.dumps(k)[1:-1],
    "in JSON, not ASCII": lambda k: json.dumps(k, ensure_ascii=False)[1:-1],
    "percent-encoded": lambda k: quote(k.encode("utf-8", "surrogatepass"), safe=""),
    "in HTML": html.escape,
    "as Python bytes": lambda k: repr(k.encode())[2:-1],
    "after Bearer": lambda k: f"Bearer {k}",
}


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
@given(
    before=st.text(),
    key=st.text(st.characters(codec="ascii", exclude_characters="\x00"), min_size=1),
    after=st.text(),
)
def test_the_key_as_an_echo_writes_it_never_survives(
    encoding: str, before: str, key: str, after: str
) -> None:
    written = ENCODINGS[encoding](key)
    out = without_key(before + written + after, key)
    assert not found(key, unmarked(out))
    assert not found(written.removeprefix("Bearer "), unmarked(out))


@given(
    before=st.text(max_size=40),
    padding=st.integers(0, 320),
    key=st.text(URLSAFE, min_size=FRAGMENT, max_size=64),
    after=st.text(max_size=40),
    most=st.integers(0, 400),
)
def test_a_cut_comes_after_the_key_is_out_so_no_part_of_it_is_left(
    before: str, padding: int, key: str, after: str, most: int
) -> None:
    """Wherever the key lies against the cut (the 300 characters of an engine's 5xx that a
    client is told), not even its start is left. (A mark's parts hold a space, which no
    key here does.)"""
    data = (before + "." * padding + f"Authorization: Bearer {key}" + after).encode()
    out = engine_words(data, key, most)
    assert len(out) <= most
    assert not found(key[:FRAGMENT], out)


@given(before=st.text(max_size=40), key=st.text(URLSAFE, min_size=FRAGMENT), cut=st.integers(0))
def test_a_key_cut_short_before_it_came_goes_from_its_first_characters(
    before: str, key: str, cut: int
) -> None:
    """Text the router did not cut (an engine's quote of a malformed line, a bounded read)
    may end inside the key: its start goes too, from `FRAGMENT` characters on."""
    part = key[: FRAGMENT + cut % (len(key) - FRAGMENT + 1)]
    out = without_key(f"{before}'{part}'", key)
    assert not found(part, unmarked(out))


@given(text=st.text(), key=keys)
def test_text_without_the_key_is_unchanged(text: str, key: str) -> None:
    assume(not found(key[:FRAGMENT], text))
    assert without_key(text, key) == text
    assert without_key(text, "") == text


def test_the_useful_part_of_an_error_stays() -> None:
    key = "eK3y-Zq4_8xR2pL0vT9mW1nB6cY5dF7gH3jK0sA2uQ"
    body = (
        "This model's maximum context length is 4096 tokens. However, you requested 9000"
        f" tokens. {{'authorization': 'Bearer {key}', 'host': 'engine:8000'}}"
    )
    assert without_key(body, key) == (
        "This model's maximum context length is 4096 tokens. However, you requested 9000"
        " tokens. {'authorization': 'Bearer [engine key]', 'host': 'engine:8000'}"
    )


@given(before=st.binary(), key=keys, after=st.binary())
def test_bytes_lose_the_key_and_keep_every_other_byte(
    before: bytes, key: str, after: bytes
) -> None:
    out = bytes_without_key(before + key.encode() + after, key)
    assert not found(key, unmarked(out.decode("utf-8", "replace")))
    assume(not found(key[:FRAGMENT], before.decode("utf-8", "replace")))
    assume(not found(key[:FRAGMENT], after.decode("utf-8", "replace")))
    assert bytes_without_key(before + after, key) == before + after


# ---------------------------------------------------------------------------- URLs

userinfo_text = st.text(st.characters(exclude_characters="/@\x00"), min_size=1)
"""A password or token: anything but `/` (which ends the authority) and `@`."""
users = st.text(st.characters(exclude_characters=":/@"))
hosts = st.text(st.characters(exclude_characters="/@"))
rests = st.one_of(st.just(""), st.text().map(lambda t: "/" + t))
"""Nothing, or a path (which may hold `@`, `//` or anything else)."""
schemes = st.sampled_from(["http://", "https://", "tls://", "tcp://", "//"])


@given(scheme=schemes, user=users, password=userinfo_text, host=hosts, rest=rests)
@example(scheme="http://", user="user", password="secret", host="[::1:8000", rest="/")
@example(scheme="https://", user="u", password="p@ss:word#1?", host="h", rest="/a@b")
def test_a_urls_password_never_survives(
    scheme: str, user: str, password: str, host: str, rest: str
) -> None:
    url = f"{scheme}{user}:{password}@{host}{rest}"
    assert shown_url(url) == f"{scheme}{user}:{PASSWORD_MARK}@{host}{rest}"


@given(scheme=schemes, token=st.text(st.characters(exclude_characters=":/@"), min_size=1),
       host=hosts, rest=rests)  # fmt: skip
def test_a_lone_token_never_survives(scheme: str, token: str, host: str, rest: str) -> None:
    assert shown_url(f"{scheme}{token}@{host}{rest}") == f"{scheme}{PASSWORD_MARK}@{host}{rest}"


@given(user=users, password=userinfo_text, host=hosts, rest=rests)
@example(user="user", password="secret", host="engine:8000", rest="//path@x")
def test_without_its_scheme_a_urls_password_never_survives_either(
    user: str, password: str, host: str, rest: str
) -> None:
    """A URL's scheme left out (`user:secret@engine:8000`): the userinfo is the text's
    start. (A path with `//` in it may lose a part that looks like userinfo too.)"""
    shown = shown_url(f"{user}:{password}@{host}{rest}")
    assert shown.startswith(f"{user}:{PASSWORD_MARK}@{host}")


def test_a_url_too_malformed_for_urllib_loses_its_password_too() -> None:
    url = "http://user:secret@[::1:8000/v1"
    with pytest.raises(ValueError, match="IPv6"):
        urlsplit(url)
    assert shown_url(url) == "http://user:***@[::1:8000/v1"


@given(scheme=schemes, host=hosts, rest=rests)
@example(scheme="http://", host="10.0.0.5:8000", rest="/v1/a@b")
def test_a_url_without_credentials_is_unchanged(scheme: str, host: str, rest: str) -> None:
    assert shown_url(f"{scheme}{host}{rest}") == f"{scheme}{host}{rest}"


@given(st.text())
def test_text_without_an_at_sign_is_unchanged_and_marking_twice_is_marking_once(
    text: str,
) -> None:
    if "@" not in text:
        assert shown_url(text) == text
    assert shown_url(shown_url(text)) == shown_url(text)


@given(user=users, password=st.text(st.characters(exclude_characters="/@\x00"), min_size=4))
def test_an_error_about_a_url_loses_its_password_as_written_or_decoded(
    user: str, password: str
) -> None:
    encoded = quote(password.encode("utf-8", "surrogatepass"), safe="")
    url = f"http://{user}:{encoded}@collector:4318/v1/traces"
    error = f"InvalidURL: {url} and {password}"
    out = without_url_secret(error, url)
    assert not found(password, unmarked(out, PASSWORD_MARK))
    assert not found(encoded, unmarked(out, PASSWORD_MARK))
    assert without_url_secret(error, "http://collector:4318") == error


# ---------------------------------------------------------------------------- JSON escapes

JSON_LETTER_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f",
                       "\n": "\\n", "\r": "\\r", "\t": "\\t"}  # fmt: skip


def json_ways(c: str) -> list[str]:
    """Every way a JSON string may write `c`: as it is (where JSON allows), escaped by a
    letter, as `\\u` escapes (a UTF-16 pair above U+FFFF) in either case of hex."""
    units = c.encode("utf-16-be", "surrogatepass")
    escaped = "".join(f"\\u{units[i : i + 2].hex()}" for i in range(0, len(units), 2))
    ways = [escaped, escaped.upper().replace("\\U", "\\u")]
    if c in JSON_LETTER_ESCAPES:
        ways.append(JSON_LETTER_ESCAPES[c])
    if c not in '"\\' and ord(c) >= 0x20:
        ways.append(c)
    return ways


@st.composite
def in_json(draw: st.DrawFn, text: str) -> str:
    """`text` inside a JSON string, each character written one of its ways, drawn."""
    return "".join(draw(st.sampled_from(json_ways(c))) for c in text)


@given(data=st.data(), before=st.text(max_size=30), key=any_keys, after=st.text(max_size=30))
@example(data=None, before="", key="sk-live-0123456789", after="")
def test_the_key_written_with_json_escapes_never_survives(
    data: st.DataObject | None, before: str, key: str, after: str
) -> None:
    """An engine's 5xx may quote the key with its letters as JSON escapes (`\\u0073k-...`),
    some or all of them: however it is written, what is left never decodes to it."""
    if data is None:  # the example: every letter escaped
        written = "".join(json_ways(c)[0] for c in before + key + after)
    else:
        written = data.draw(in_json(before + key + after))
    body = '{"error": {"message": "' + written + '"}}'
    assert key in json.loads(body)["error"]["message"]
    out = without_key(body, key)
    try:
        doc = json.loads(out)
    except ValueError:
        return  # what does not decode does not decode to the key
    assert not any(found(key, unmarked(text)) for text in strings_of(doc))


def strings_of(doc: object) -> list[str]:
    """Every string of a decoded JSON document, its objects' names included."""
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for name, value in doc.items() for s in [name, *strings_of(value)]]
    if isinstance(doc, list):
        return [s for item in doc for s in strings_of(item)]
    return []


def test_an_error_with_an_escaped_key_stays_json_and_keeps_the_rest() -> None:
    key = "sk-live-0123456789"
    body = '{"error": "bad header \\u0073k-live-\\u0030123456789, see docs"}'
    assert json.loads(without_key(body, key)) == {"error": f"bad header {KEY_MARK}, see docs"}


def test_a_5xx_cut_short_inside_its_json_loses_the_escaped_key_all_the_same() -> None:
    """The router reads the first 2 KiB of an engine's 5xx: a body cut there is no JSON to
    decode, and its escaped key must go all the same."""
    key = "sk-live-0123456789"
    escaped = "".join(f"\\u{ord(c):04X}" for c in key[:10]) + key[10:]
    data = ('{"detail": "upstream refused Authorization: Bearer ' + escaped + '", "trace').encode()
    said = engine_words(data, key, 300)
    assert said == '{"detail": "upstream refused Authorization: Bearer [engine key]", "trace'


VISIBLE_ASCII = "".join(map(chr, range(0x21, 0x7F)))
"""The characters of an engine's key (`limits.EngineKey`), which a node chooses."""
backslash_heavy_keys = st.text(st.sampled_from(["\\", "\\", "/", '"', "u", "a", "0"]) |
                               st.sampled_from(VISIBLE_ASCII), min_size=1, max_size=24)  # fmt: skip


def most_readings(key: str, text: str) -> int:
    """The most ways in which a start of `text` reads as a start of `key` in JSON, each
    character of the key matched by its JSON pattern: each way is a path the regex of the
    key may try before it finds the text is not the key."""
    patterns = [re.compile(_in_json(c), re.IGNORECASE) for c in key]
    ways = {0: 1}  # end of the text read so far -> the ways to read it
    most = 1
    for pattern in patterns:
        after: dict[int, int] = {}
        for start, n in ways.items():
            for end in range(start + 1, min(start + 12, len(text)) + 1):
                if pattern.fullmatch(text, start, end):
                    after[end] = after.get(end, 0) + n
        ways = after
        most = max(most, *ways.values(), 0)
    return most


@given(data=st.data(), key=backslash_heavy_keys)
@example(data=None, key="\\" * 3)
def test_a_text_reads_as_a_key_in_json_one_way_at_most(
    data: st.DataObject | None, key: str
) -> None:
    """A text, the key written in JSON, reads as the key's start one way at most: a text
    that several ways of reading nearly match (a run of backslashes, for a key of them)
    would make the regex try each, exponentially many, on the router's event loop."""
    written = "\\\\" * len(key) if data is None else data.draw(in_json(key))
    assert most_readings(key, written) == 1


def test_a_nodes_key_of_backslashes_is_read_one_way_and_its_start_found() -> None:
    """A node chooses its engine's key: 64 backslashes, its engine's answer a run of 63
    and another character, which is the key cut short."""
    key = "\\" * 64
    assert most_readings(key, "\\" * 63 + "#") == 1
    assert without_key("\\" * 63 + "#", key) == KEY_MARK + "#"


def test_a_key_cut_short_goes_to_where_it_was_cut() -> None:
    # Past its first FRAGMENT characters too: as they are, and as JSON escapes.
    key = "sk-live-0123456789abcdef"
    assert without_key("header 'sk-live-0123456789ab", key) == f"header '{KEY_MARK}"
    escaped = '"\\u0073k-live-\\u00301234567"'
    assert without_key(escaped, key) == f'"{KEY_MARK}"'


def test_a_key_repeated_past_the_places_looked_at_goes_with_the_rest() -> None:
    key = "sk-live-0123456789"
    out = without_key(" ".join([key] * 150) + " tail", key)
    assert not found(key[:FRAGMENT], unmarked(out))


def test_a_key_in_another_letter_case_and_in_json_escapes_never_survives() -> None:
    # Both at once: the escapes of the lower-case letters of an upper-case key.
    key = "SK-LIVE-ABCDEFGH"
    body = '{"error": "bad header \\u0073\\u006b-live-\\u0061bcdefgh"}'
    assert json.loads(without_key(body, key)) == {"error": f"bad header {KEY_MARK}"}
