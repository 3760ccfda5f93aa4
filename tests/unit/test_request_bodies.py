"""What the router reads of a request body and what it sends on (llmgw.router.requests):
fields a client may not send as they are refused with a message, fields of one API are
not read of another's, and the body rewritten for an engine keeps its tenant's salt."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.router import requests

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "p"}


@pytest.mark.parametrize(
    ("kind", "extra", "field"),
    [
        ("chat", {"max_tokens": -1}, "max_tokens"),
        ("chat", {"max_completion_tokens": -5}, "max_completion_tokens"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"n": -2}, "n"),
        ("completions", {"max_tokens": -1}, "max_tokens"),
        ("completions", {"best_of": 0}, "best_of"),
        ("messages", {"max_tokens": -1}, "max_tokens"),
        ("responses", {"max_output_tokens": -1}, "max_output_tokens"),
    ],
)
def test_a_maximum_below_zero_or_no_answers_at_all_is_a_bad_request(
    kind: requests.Kind, extra: dict[str, int], field: str
) -> None:
    """A negative maximum would make a key's token hold negative (its limit credited, not
    spent); `n: 0` asks for nothing: each is the client's 400, naming the field."""
    body = msgspec.json.encode({**(COMPLETION if kind == "completions" else CHAT), **extra})
    with pytest.raises(requests.BadRequest, match=field):
        requests.parse(kind, body, want_text=False)


@given(
    salt=st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.lists(st.text(max_size=3), max_size=2) | st.dictionaries(st.text(max_size=3), st.none()),
    kind=st.sampled_from(["chat", "completions", "embeddings", "messages", "responses"]),
)  # fmt: skip
def test_a_salt_is_read_only_as_a_non_empty_string(salt: object, kind: requests.Kind) -> None:
    """vLLM refuses an empty `cache_salt`; another type is none: a prompt is keyed for
    routing by a salt only when the engine keys it by that salt too."""
    data = {**CHAT, "prompt": "p", "input": "i", "cache_salt": salt}
    parsed = requests.parse(kind, msgspec.json.encode(data), want_text=False)
    assert parsed.cache_salt == (salt if isinstance(salt, str) and salt else None)


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2], [3]], [], [{"x": 1}]])
def test_a_prompt_of_token_ids_has_no_text_to_route_on(prompt: list[object]) -> None:
    parsed = requests.parse(
        "completions", msgspec.json.encode({**COMPLETION, "prompt": prompt}), want_text=True
    )
    assert parsed.text == ""
    batch = requests.parse(
        "completions", msgspec.json.encode({**COMPLETION, "prompt": ["a", 1]}), want_text=True
    )
    assert batch.text == "a"


@pytest.mark.parametrize("kind", ["rerank", "score", "tokenize", "detokenize", "count_tokens"])
def test_an_api_that_generates_nothing_neither_streams_nor_holds_tokens(
    kind: requests.Kind,
) -> None:
    """`stream` and `max_tokens` sent to a pooling or token-count API (a chat body reused)
    are not its own: its answer is one JSON body, its cost its input's."""
    body = msgspec.json.encode({**CHAT, "stream": True, "max_tokens": 500})
    parsed = requests.parse(kind, body, want_text=False)
    assert (parsed.stream, parsed.max_out) == (False, 0)
    streamed = requests.parse("messages", body, want_text=False)
    assert (streamed.stream, streamed.max_out) == (True, 500)


@given(
    salt=st.sampled_from(["llmgw1-abc", requests.UNCACHED]),
    spaces=st.sampled_from([b"", b" \n"]),
    client_salt=st.none() | st.text(min_size=1, max_size=5),
)
def test_a_tenants_salt_is_set_when_only_the_usage_chunk_is_asked_for_too(
    salt: requests.Salting, spaces: bytes, client_salt: str | None
) -> None:
    """The usual streamed request (no stream_options of its own, no rename) still gets its
    tenant's salt, or the engine's cache turned off: never the client's salt or none."""
    data = {**CHAT, "stream": True}
    if client_salt is not None:
        data["cache_salt"] = client_salt
    body = msgspec.json.encode(data) + spaces
    parsed = requests.parse("chat", body, want_text=False)
    sent = requests.rewrite(
        body, model=None, include_usage=True, has_options=parsed.has_options, salt=salt
    )
    out = msgspec.json.decode(sent)
    assert out["stream_options"] == {"include_usage": True}
    if isinstance(salt, str):
        assert out["cache_salt"] == salt
    else:
        assert "cache_salt" not in out
        assert out["cache_prompt"] is False


def test_the_usage_chunk_is_added_to_the_stream_options_a_client_sent() -> None:
    options = {"include_usage": False, "continuous_usage_stats": True}
    body = msgspec.json.encode({**CHAT, "stream": True, "stream_options": options})
    parsed = requests.parse("chat", body, want_text=False)
    out = requests.rewrite(body, model=None, include_usage=True, has_options=parsed.has_options)
    assert msgspec.json.decode(out)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }


@pytest.mark.parametrize(
    ("text", "lone"),
    [
        ("\\udfff", "\\udfff"),
        ("\\udbff\\udfff\\ud800x", "\\ud800"),
        ("\\ud800x\\udc00", "\\ud800"),
        ("\\ud800 \\udfff", "\\ud800"),
    ],
)
def test_a_lone_half_of_either_kind_is_named_wherever_it_stands(text: str, lone: str) -> None:
    """The last second half (U+DFFF) is one; a first half whose second does not follow it
    at once is lone too."""
    body = ('{"model": "m", "messages": [{"role": "user", "content": "' + text + '"}]}').encode()
    with pytest.raises(requests.BadRequest) as refused:
        requests.parse("chat", body, want_text=True)
    assert f"the escape {lone} at byte {body.rindex(lone.encode())} is a lone UTF-16" in str(
        refused.value
    )


def test_a_body_cut_right_after_a_first_half_is_called_truncated() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800'
    with pytest.raises(requests.BadRequest) as refused:
        requests.parse("chat", body, want_text=True)
    assert "truncated" in str(refused.value)
    assert "lone" not in str(refused.value)


@pytest.mark.parametrize(
    ("status", "atype"),
    [(500, "api_error"), (502, "api_error"), (400, "invalid_request_error"),
     (422, "invalid_request_error"), (429, "rate_limit_error"), (529, "overloaded_error")],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["messages", "count_tokens"])
def test_anthropics_apis_errors_are_typed_in_its_words(
    kind: requests.Kind, status: int, atype: str
) -> None:
    doc = msgspec.json.decode(requests.api_error_body(kind, status, "why", "x", "code"))
    assert doc == {
        "type": "error",
        "error": {"type": atype, "message": "why", "param": None, "code": "code"},
    }
    openai = msgspec.json.decode(requests.api_error_body("chat", status, "why", "x", "code"))
    assert openai["error"]["type"] == "x"


def test_a_messages_streams_output_tokens_are_counted_from_its_delta_only() -> None:
    """`message_start` says the prompt's tokens and an output count that `message_delta`
    says again, in full: counted once."""
    start = {"type": "message_start",
             "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}}  # fmt: skip
    usage = requests.usage_of(msgspec.json.encode(start))
    assert usage is not None
    assert usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (10, 0)
    delta = {"type": "message_delta", "usage": {"output_tokens": 7}}
    later = requests.usage_of(msgspec.json.encode(delta))
    assert later is not None
    assert later.usage is not None
    assert (later.usage.prompt_tokens, later.usage.completion_tokens) == (0, 7)


def test_a_client_that_declines_the_usage_chunk_is_not_sent_one() -> None:
    """The router asks every stream's usage of the engine for its accounting; it passes the
    usage chunk on only to a client that asked for it."""
    for include, wanted in ((False, False), (True, True)):
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": include}}
        parsed = requests.parse("chat", msgspec.json.encode(body), want_text=False)
        assert (parsed.wants_usage, parsed.has_options) == (wanted, True)


@pytest.mark.parametrize("given_input", [["a", "b"], [[1, 2]], []])
def test_a_batch_of_embedding_inputs_has_no_text_to_route_on(given_input: list[object]) -> None:
    body = msgspec.json.encode({"model": "m", "input": given_input})
    assert requests.parse("embeddings", body, want_text=True).text == ""
    one = msgspec.json.encode({"model": "m", "input": "a"})
    assert requests.parse("embeddings", one, want_text=True).text == "a"
