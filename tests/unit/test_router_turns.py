"""The Messages and Responses APIs' conversations, read as a chat's turns for prefix affinity.

A body of either API is keyed by the (role, text) turns its engine renders: the same turns
as a chat's give the same text, the same text index hashes (salted alike under
`tenancy.cache_isolation`) and the same tokens (the sim's, as its engine counts them). Any
other body is routed as before: reading it never raises, and yields no more text than it
holds.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import routing, simtokens
from llmgw.core.prefix import ChatHashes, PrefixIndex
from llmgw.core.profile import ModelProfile
from llmgw.core.simtokens import token_ids
from llmgw.router import prompts, requests, turns
from llmgw.router.kvroute import KvRouting, salted_hashes
from llmgw.sim import apis as sim_apis
from llmgw.sim.config import SimConfig

TEXT = st.text(alphabet=st.sampled_from('ab1 \n\t?.é-_<|>"\\'), max_size=400)
ROLES = st.sampled_from(["user", "assistant"])
TURNS = st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=6)
SIM = prompts.for_profile(ModelProfile(name="m", engine="sim"))
SIM_CFG = SimConfig(served_model_names=("m",), max_model_len=1_000_000)


@st.composite
def text_blocks(
    draw: st.DrawFn, text: str, kind: str, others: list[dict[str, Any]], cut: bool = False
) -> Any:
    """`text` as a string, or as a block of type `kind` (cut into several when `cut`: for
    a text whose blocks the engine concatenates) with blocks of `others` (which hold no
    text of the prompt) around it. An empty text is a string: a message of no text is
    another prompt (the Messages API leaves it out, `test_router_content_parts`)."""
    if draw(st.booleans()) or not text:
        return text
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=3))) if cut else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    blocks: list[dict[str, Any]] = []
    for piece in pieces:
        blocks += draw(st.lists(st.sampled_from(others), max_size=2)) if others else []
        blocks.append({"type": kind, "text": piece})
    return blocks


MESSAGE_OTHERS = [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    {"type": "tool_use", "id": "t1", "name": "f", "input": {"text": "not the prompt's"}},
    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r"}]},
    {"type": "thinking", "thinking": "hmm", "signature": "s"},
]
RESPONSE_OTHERS = [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]
RESPONSE_ITEMS = [
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "not the prompt's"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
]


@st.composite
def messages_body(
    draw: st.DrawFn, system: str, turns: list[tuple[str, str]], others: bool = True
) -> bytes:
    """A Messages API body of `system` (none when empty) and `turns`."""
    blocks = MESSAGE_OTHERS if others else []
    doc: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [
        {"role": role, "content": draw(text_blocks(text, "text", blocks))} for role, text in turns
    ]}  # fmt: skip
    if system:
        doc["system"] = draw(text_blocks(system, "text", [], cut=True))
    return msgspec.json.encode(doc)


@st.composite
def responses_body(
    draw: st.DrawFn, system: str, turns: list[tuple[str, str]], others: bool = True
) -> bytes:
    """A Responses API body of `system` as its instructions (none when empty) and `turns`."""
    doc: dict[str, Any] = {"model": "m"}
    if system:
        doc["instructions"] = system
    if len(turns) == 1 and turns[0][0] == "user" and draw(st.booleans()):
        doc["input"] = turns[0][1]
    else:
        items: list[Any] = []
        for role, text in turns:
            items += draw(st.lists(st.sampled_from(RESPONSE_ITEMS), max_size=1)) if others else []
            kind = "output_text" if role == "assistant" else "input_text"
            item = {"role": role, "content": draw(text_blocks(
                text, kind, RESPONSE_OTHERS if others else []))}  # fmt: skip
            items.append(item | ({"type": "message"} if draw(st.booleans()) else {}))
        doc["input"] = items
    return msgspec.json.encode(doc)


BODIES = {"messages": messages_body, "responses": responses_body}


def chat_body(system: str, turns: list[tuple[str, str]]) -> bytes:
    said = [("system", system)] if system else []
    return msgspec.json.encode(
        {"model": "m", "messages": [{"role": r, "content": t} for r, t in [*said, *turns]]}
    )


@settings(max_examples=300)
@given(kind=st.sampled_from(["messages", "responses"]), system=TEXT, turns=TURNS,
       salt=st.sampled_from([None, "team-t1", "team-t2"]), data=st.data())  # fmt: skip
def test_a_conversation_is_keyed_as_the_chat_of_the_same_turns(
    kind: requests.Kind, system: str, turns: list[tuple[str, str]], salt: str | None,
    data: st.DataObject,
) -> None:  # fmt: skip
    body = data.draw(BODIES[kind](system, turns))
    got = requests.parse(kind, body, want_text=True)
    chat = requests.parse("chat", chat_body(system, turns), want_text=True)
    assert got.chat == chat.chat
    assert got.text == chat.text
    hashes = [salted_hashes(ChatHashes().hashes(p.chat, p.text, 16, 64), salt) for p in (got, chat)]
    assert hashes[0] == hashes[1]
    assert SIM is not None
    assert list(SIM.ids(got) or []) == list(SIM.ids(chat) or [])


@settings(max_examples=200)
@given(kind=st.sampled_from(["messages", "responses"]), system=TEXT, turns=TURNS,
       data=st.data())  # fmt: skip
def test_the_router_keys_a_conversation_as_the_sim_engine_tokenizes_it(
    kind: requests.Kind, system: str, turns: list[tuple[str, str]], data: st.DataObject
) -> None:
    """The cache plan's tokens are the engine's own prompt: the sim counts them so."""
    body = data.draw(BODIES[kind](system, turns, others=False))
    prepare = sim_apis.prepare_messages if kind == "messages" else sim_apis.prepare_responses
    engine = token_ids(prepare(body, SIM_CFG).prompt)
    assert SIM is not None
    assert list(SIM.ids(requests.parse(kind, body, want_text=True)) or []) == engine


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["type", "role", "text", "content"]), inner, max_size=4)
    ),
    max_leaves=20,
)
TEXTISH = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["text", "input_text", "output_text", "image"]) | JSON,
        "role": ROLES | st.sampled_from(["system", "developer", "tool"]) | JSON,
        "text": TEXT | JSON,
        "content": TEXT | JSON,
    },
)
MEMBER = JSON | TEXT | st.lists(TEXTISH | JSON, max_size=5)
MEMBERS = ["system", "messages", "instructions", "input", "previous_response_id"]


@settings(max_examples=400)
@given(kind=st.sampled_from(["messages", "responses"]),
       members=st.dictionaries(st.sampled_from(MEMBERS), MEMBER, max_size=5))  # fmt: skip
def test_any_body_is_read_bounded_deterministic_and_routed_as_before_without_text(
    kind: requests.Kind, members: dict[str, Any]
) -> None:
    body = msgspec.json.encode({"model": "m", **members})
    got = requests.parse(kind, body, want_text=True)
    assert requests.parse(kind, body, want_text=True) == got
    assert len(got.text) <= len(body)
    assert got.text == "".join(f"{role}\n{text}\n" for role, text in got.chat)
    assert len(turns.chat_text(turns.worked_out(got.sglang_chat))) <= len(body)
    unread = requests.parse(kind, body, want_text=False)
    assert (unread.text, unread.chat, unread.sglang_chat) == ("", (), ())
    assert msgspec.structs.replace(got, text="", chat=(), sglang_chat=()) == unread


def test_a_responses_body_continuing_a_stored_one_has_no_turns() -> None:
    """Its prompt begins with what the engine stored of the earlier response: unseen."""
    doc = {"model": "m", "instructions": "be brief", "input": "and then?"}
    assert requests.parse("responses", msgspec.json.encode(doc), want_text=True).chat
    for member in ("previous_response_id", "conversation", "prompt"):
        body = msgspec.json.encode(doc | {member: "resp_1"})
        assert requests.parse("responses", body, want_text=True).chat == (), member


@given(
    hashes=st.lists(st.binary(min_size=8, max_size=8), min_size=1, max_size=8, unique=True),
    salts=st.lists(st.text(max_size=12), min_size=2, max_size=2, unique=True),
)
def test_a_salted_prompt_matches_only_prompts_of_its_own_salt(
    hashes: list[bytes], salts: list[str]
) -> None:
    """One tenant's prompts must not be found in the text index under another's salt (nor
    unsalted): a match would route by, and time-leak, another tenant's cache."""
    index = PrefixIndex()
    index.record(salted_hashes(hashes, salts[0]), "e")
    assert index.match(salted_hashes(hashes, salts[0])) == {"e": len(hashes)}
    assert index.match(salted_hashes(hashes, salts[1])) == {}
    assert index.match(salted_hashes(hashes, None)) == {}
    assert salted_hashes(hashes, None) == hashes


def test_routers_break_ties_by_the_prompts_first_block_alike() -> None:
    ep = routing.EndpointState(id="e", url="u", models=frozenset({"m"}), ready=True)
    profile = ModelProfile(name="m", engine="sim")

    def tie_key(router: KvRouting, text: str) -> int:
        chat = (("user", text),)
        parsed = requests.Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                                 text=simtokens.render_chat(chat), chat=chat)  # fmt: skip
        plan = router.plan(parsed, profile, [ep], now=1.0)
        assert plan is not None
        return plan.tie_key

    long = "the same long system prompt " * 20
    one, other = tie_key(KvRouting(), long), tie_key(KvRouting(), long)
    assert one == other != 0
    assert tie_key(KvRouting(), "another prompt entirely " * 20) not in (0, one)


def _turns(kind: requests.Kind, doc: dict[str, Any]) -> requests.Turns:
    return requests.parse(kind, msgspec.json.encode({"model": "m", **doc}), want_text=True).chat


def test_null_members_are_absent_ones() -> None:
    """`system: null` or `previous_response_id: null` says nothing: the turns are read."""
    said = [{"role": "user", "content": "hi"}]
    assert _turns("messages", {"system": None, "messages": said}) == (("user", "hi"),)
    for stored in ("previous_response_id", "conversation", "prompt"):
        doc = {"instructions": None, "input": said, stored: None}
        assert _turns("responses", doc) == (("user", "hi"),), stored


def test_a_message_of_thinking_alone_is_rendered_as_an_empty_turn() -> None:
    """vLLM keeps a Messages API message of a thinking block (no text) as an empty turn."""
    said = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}]},
        {"role": "user", "content": "b"},
    ]
    assert _turns("messages", {"messages": said}) == (
        ("user", "a"),
        ("assistant", ""),
        ("user", "b"),
    )


def test_only_the_responses_apis_message_roles_and_instructions_given_are_turns() -> None:
    items = [{"role": "user", "content": "a"}, {"role": "tool", "content": "t"},
             {"type": "message", "role": "critic", "content": "c"}]  # fmt: skip
    assert _turns("responses", {"instructions": "", "input": items}) == (("user", "a"),)


def test_sglang_keeps_a_string_content_beside_a_message_of_parts() -> None:
    parts = [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]
    said = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    parsed = requests.parse(
        "chat", msgspec.json.encode({"model": "m", "messages": said}), want_text=True
    )
    assert parsed.chat == (("system", "be brief"), ("user", "x\ny"))
    assert parsed.sglang_chat == (("system", "be brief"), ("user", "x y"))
