"""Secrets taken out of text before a client or a log line gets it. Pure.

`without_key`: an engine's key out of what the engine wrote. A router presents each
engine its own key (`Authorization: Bearer <key>`); an engine, or a proxy in front of it,
that echoes its request's headers in an error would otherwise hand the key to the
router's client. Every occurrence goes, in any letter case and in the forms an echo
plausibly writes it (as is, percent-encoded, escaped in HTML, quoted as Python bytes, in
JSON with any of its characters escaped: the text is searched as it is, never decoded,
so a body that does not hold the key is left as it came), and so does a key cut short by
a bound on what was read or quoted (its first `FRAGMENT` characters or more): each
becomes `KEY_MARK`. Text is cut to size only after the key is out, so no cut leaves a
part of it.

`shown_url`: a URL as a message may quote it, the password of its userinfo (or a lone
token) as `***`, also when it is too malformed for urllib to read; `without_url_secret`
takes that secret out of an error about the URL.
"""

from __future__ import annotations

import functools
import html
import re
from urllib.parse import quote, unquote

KEY_MARK = "[engine key]"
"""What an engine's key is replaced with."""
FRAGMENT = 8
"""The shortest start of a key taken out where the key was cut short (a shorter key
goes only whole): a few characters are no use to anyone, and this many of a random key
never occur by chance."""
PASSWORD_MARK = "***"
MOST_FOUND = 100
"""The places of one form of a key looked at in one text; from the next one on the text
goes whole. An answer that repeats the key that often says nothing else, and a key that
repeats its own first characters (one a node made up) would make each place cost its
length."""


def without_key(text: str, key: str) -> str:
    """`text` with every occurrence of `key` (and of its start, cut short) as `KEY_MARK`."""
    return without_secret(text, key, KEY_MARK)


def without_secret(text: str, secret: str, mark: str) -> str:
    """`text` with every occurrence of `secret` (and of its start, cut short) as `mark`."""
    if not secret:
        return text
    spans = sorted(span for form in _forms(secret) for span in _occurrences(text, form))
    if not spans:
        return text
    out: list[str] = []
    done = 0  # where the text not yet copied begins
    for start, end in spans:
        if start >= done:
            out += (text[done:start], mark)
        done = max(done, end)
    out.append(text[done:])
    return "".join(out)


def engine_words(data: bytes, key: str, most: int) -> str:
    """An engine's bytes as text for a message: without `key`, then cut to `most`
    characters."""
    return without_key(data.decode("utf-8", "replace"), key)[:most]


def bytes_without_key(data: bytes, key: str) -> bytes:
    """`data`, in whatever encoding, with `key` out as `without_key` takes it; the other
    bytes as they were."""
    if not key:
        return data
    text = data.decode("utf-8", "surrogateescape")
    clean = without_key(text, key)
    return data if clean == text else clean.encode("utf-8", "surrogateescape")


def _forms(key: str) -> set[tuple[str, ...]]:
    """A secret as an echo may write it: each form as the patterns of its characters, one
    after another. JSON may write any of the key's characters as an escape (`\\u0073`,
    `\\/`), each its own way, so that form is one pattern a key character."""
    # JSON's own writings of the key (json.dumps, with or without ASCII) are the JSON form's.
    written = {
        key,
        quote(key.encode("utf-8", "surrogatepass"), safe=""),
        html.escape(key),
        repr(key.encode("utf-8", "surrogatepass"))[2:-1],
    }
    return {tuple(map(re.escape, form)) for form in written} | {tuple(map(_in_json, key))}


_JSON_SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f",
               "\n": "\\n", "\r": "\\r", "\t": "\\t"}  # fmt: skip
"""The characters JSON may also escape by a letter (`\\n`), as those escapes."""


@functools.lru_cache(maxsize=1024)
def _in_json(c: str) -> str:
    """The pattern of `c` in a JSON string, in any letter case: as it is, escaped by a
    letter, or as `\\u` escapes (a UTF-16 pair above U+FFFF), in either case of hex.

    A backslash is never itself in a JSON string, only escaped: were it also taken as it
    is, a run of backslashes could be read as a key's backslashes in exponentially many
    ways (each one or two of them), which a regex tries one after another where the run
    is not the key: one answer of a node whose key is 40 backslashes held the router for
    seconds, of 60 for hours. Without it each of a key's characters reads a text one way
    at most. (The key as it is, backslashes and all, is a form of its own.)"""
    ways = set() if c == "\\" else {re.escape(c)}
    for letter in {c, c.lower(), c.upper()}:
        if len(letter) != 1:
            continue  # "ß".upper() is "SS": two characters, not one's escape
        if letter in _JSON_SHORT:
            ways.add(re.escape(_JSON_SHORT[letter]))
        utf16 = letter.encode("utf-16-be", "surrogatepass")
        ways.add("".join(f"\\\\u{utf16[i : i + 2].hex()}" for i in range(0, len(utf16), 2)))
    return "(?:" + "|".join(sorted(ways)) + ")"


def _occurrences(text: str, form: tuple[str, ...]) -> list[tuple[int, int]]:
    """Where `form`, or its start of at least `FRAGMENT` characters, is in `text`, in any
    letter case: at each place the longest, overlapping places included (a text that
    repeats the key's first letters must not hide where the key itself begins). Past
    `MOST_FOUND` places, the rest of the text goes whole."""
    head, whole = _patterns(form)
    spans: list[tuple[int, int]] = []
    found = head.search(text)
    while found is not None:
        start = found.start()
        if len(spans) == MOST_FOUND:
            spans.append((start, len(text)))
            break
        all_of_it = whole.match(text, start)
        spans.append((start, all_of_it.end() if all_of_it else _run_end(text, found, form)))
        found = head.search(text, start + 1)
    return spans


def _run_end(text: str, found: re.Match[str], form: tuple[str, ...]) -> int:
    """Where the run of `form` that `text` holds from `found` (its first `FRAGMENT`
    characters) ends: a character at a time, as a pattern of the whole form would compare
    them."""
    end = found.end()
    for part in form[FRAGMENT:]:
        more = _part(part).match(text, end)
        if more is None:
            break
        end = more.end()
    return end


@functools.lru_cache(maxsize=64)
def _patterns(form: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The patterns of `form`'s first `FRAGMENT` characters (a shorter form's all) and of
    the whole form, in any letter case."""
    return (
        re.compile("".join(form[:FRAGMENT]), re.IGNORECASE),
        re.compile("".join(form), re.IGNORECASE),
    )


@functools.lru_cache(maxsize=1024)
def _part(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


def shown_url(url: str) -> str:
    """`url` with the secret of its userinfo as `***`: `https://user:***@host/`, or
    `https://***@host/` for a lone token; unchanged without one."""
    for start, at in reversed(_userinfos(url)):  # the last first: the first's place holds
        user, colon, _ = url[start:at].partition(":")
        url = url[:start] + (f"{user}:{PASSWORD_MARK}" if colon else PASSWORD_MARK) + url[at:]
    return url


def without_url_secret(text: str, url: str) -> str:
    """`text` (an error about `url`, which may quote it in its own way) without the secret
    of `url`'s userinfo, as written or percent-decoded."""
    for start, at in _userinfos(url):
        user, colon, password = url[start:at].partition(":")
        secret = password if colon else user
        for form in (secret, unquote(secret, errors="surrogatepass")):
            text = without_secret(text, form, PASSWORD_MARK)
    return text


def _userinfos(url: str) -> list[tuple[int, int]]:
    """Where userinfo may be in `url`: each place's start and its `@`. It lies between
    `//` and the last `@` before the next `/`, as urllib reads it (which a URL too
    malformed to parse does not change); and, in a text whose scheme was left out,
    between its start and the last `@` before its first `/`. Both are taken: a malformed
    URL has no one right reading, and a secret goes in either."""
    places = []
    slash = url.find("/")
    at = url.rfind("@", 0, slash if slash >= 0 else len(url))
    if at >= 0:
        places.append((0, at))
    after = url.find("//")
    if after >= 0:
        slash = url.find("/", after + 2)
        at = url.rfind("@", after + 2, slash if slash >= 0 else len(url))
        if at >= 0:
            places.append((after + 2, at))
    return places
