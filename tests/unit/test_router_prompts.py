"""The router tokenizes prompts as the engine does (llmgw.router.prompts): a Hugging Face
tokenizer (trained here, in-process) with its chat template, and the sim's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from llmgw.core import kvblocks, simtokens
from llmgw.core.profile import ModelProfile
from llmgw.router import prompts
from llmgw.router.requests import Parsed, parse

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "[UNK]"])
    corpus = ["You are a careful assistant who answers briefly.", "What is two and two?"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
        )
    )
    return folder


def chat_body(*messages: tuple[str, str]) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    ).encode()


def test_chat_prompts_are_rendered_by_the_template_then_tokenized(tokenizer_dir: Path) -> None:
    profile = ModelProfile(name="m", engine="vllm", tokenizer=str(tokenizer_dir))
    found = prompts.for_profile(profile)
    assert isinstance(found, prompts.HfPrompts)
    parsed = parse(
        "chat", chat_body(("system", "You are careful."), ("user", "Two?")), want_text=True
    )
    ids = found.ids(parsed)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rendered = "<s><|system|>You are careful.</s><|user|>Two?</s><|assistant|>"
    assert list(ids or []) == tok.encode(rendered, add_special_tokens=False).ids
    # The keys an agent computes from the engine's BlockStored token ids are the router's.
    assert kvblocks.block_keys(list(ids or []), 4) == kvblocks.block_keys(
        tok.encode(rendered, add_special_tokens=False).ids, 4
    )


def test_a_shared_system_prompt_gives_shared_leading_keys(tokenizer_dir: Path) -> None:
    found = prompts.HfPrompts.load(tokenizer_dir)
    system = ("system", "You are a careful assistant who answers briefly. " * 4)
    a = found.ids(parse("chat", chat_body(system, ("user", "What is two?")), want_text=True))
    b = found.ids(parse("chat", chat_body(system, ("user", "And three?")), want_text=True))
    ka, kb = kvblocks.block_keys(list(a or []), 4), kvblocks.block_keys(list(b or []), 4)
    shared = next(i for i, (x, y) in enumerate(zip(ka, kb, strict=False)) if x != y)
    assert shared >= 8  # the system prompt's blocks


def test_no_usable_tokenizer_means_no_prediction(tmp_path: Path) -> None:
    assert prompts.for_profile(ModelProfile(name="m", engine="vllm", model="org/remote")) is None
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")
    assert (
        prompts.for_profile(ModelProfile(name="m2", engine="vllm", tokenizer=str(tmp_path))) is None
    )
    with pytest.raises(prompts.TokenizerFilesError, match=r"no tokenizer\.json"):
        prompts.HfPrompts.load(tmp_path / "missing")


@pytest.mark.parametrize(
    "config",
    ["[]", '"text"', '{"chat_template": [1]}', '{"bos_token": ["a"], "chat_template": [{}]}',
     '{"chat_template": [{"name": "default", "template": 5}]}', "[" * 100_000, "\udcff",
     json.dumps({"chat_template": "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}"})],
)  # fmt: skip
def test_a_tokenizer_config_of_any_shape_is_loaded_or_refused(
    tmp_path: Path, tokenizer_dir: Path, config: str
) -> None:
    # Valid JSON that is no mapping ended HfPrompts.load in an AttributeError (JSON nested
    # thousands deep in a RecursionError), which for_profile let through on every request
    # of the model, since only a TokenizerFilesError is remembered.
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes(config.encode("utf-8", "surrogateescape"))
    try:
        found = prompts.HfPrompts.load(tmp_path)
    except prompts.TokenizerFilesError:
        return
    assert found.ids(parse("chat", chat_body(("user", "u")), want_text=True)) is None


def test_a_template_that_refuses_the_messages_predicts_nothing(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": strict}))
    found = prompts.HfPrompts.load(tmp_path)
    assert found.ids(parse("chat", chat_body(("system", "s")), want_text=True)) is None
    assert found.ids(parse("chat", chat_body(("user", "u")), want_text=True))


def test_sim_models_are_tokenized_as_the_sim_does() -> None:
    found = prompts.for_profile(ModelProfile(name="s", engine="sim"))
    parsed = parse("chat", chat_body(("user", "Hello there!")), want_text=True)
    expected = simtokens.token_ids(
        simtokens.tokenize(simtokens.render_chat([("user", "Hello there!")]))
    )
    assert found is not None
    assert list(found.ids(parsed) or []) == expected


# --------------------------------------------------------------- long prompts, bounded work

WORDS = st.sampled_from(
    ["You", " are", " a", " careful", " assistant", " two", " and", "?", " ", "\n", "é", "."]
)
SIM_TEXT = st.text(alphabet=st.sampled_from("ab1 \n\t?.é-_"), max_size=600)
MESSAGES = st.lists(
    st.tuples(
        st.sampled_from(["system", "user", "assistant"]), st.lists(WORDS, max_size=300).map("".join)
    ),
    min_size=1,
    max_size=5,
)


def whole_ids(found: prompts.Prompts, parsed: Parsed) -> list[int]:
    return list(found.ids(parsed, 10**9) or [])


def chat_parsed(messages: list[tuple[str, str]]) -> Parsed:
    return parse("chat", chat_body(*messages), want_text=True)


def completion_parsed(text: str) -> Parsed:
    return parse("completions", json.dumps({"model": "m", "prompt": text}).encode(), want_text=True)


def both_shapes(messages: list[tuple[str, str]]) -> tuple[Parsed, Parsed]:
    """The messages as a chat, and their text as a completion's prompt."""
    return chat_parsed(messages), completion_parsed("".join(c for _, c in messages))


def check_beginning(found: prompts.Prompts, parsed: Parsed, max_chars: int) -> bool:
    """Whether `found`'s tokens of `parsed` cut at `max_chars` begin its tokens of the
    whole prompt (or there are none to make: an empty prompt); True if they were all."""
    whole = whole_ids(type(found)() if isinstance(found, prompts.SimPrompts) else found, parsed)
    got = found.tokens(parsed, max_chars)
    if got is None:
        assert not parsed.text
        assert not whole
        return True
    assert got.ids == whole[: len(got.ids)]
    assert got.estimate >= len(got.ids)
    return got.ids == whole


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=MESSAGES, max_chars=st.integers(1, 2500))
@example(messages=[("system", "?"), ("system", "")], max_chars=1)  # an empty one after the cut
def test_a_cut_prompts_tokens_are_the_whole_prompts_first_tokens(
    tokenizer_dir: Path, messages: list[tuple[str, str]], max_chars: int
) -> None:
    """What the router keys of a prompt longer than `max_chars` is the beginning of what
    the engine's tokenizer makes of the whole prompt: a cache match predicted on it is one
    the engine can have. Not cut, it is the whole."""
    found = prompts.HfPrompts.load(tokenizer_dir)
    fits = sum(len(c) for _, c in messages) <= max_chars
    for parsed in both_shapes(messages):
        assert check_beginning(found, parsed, max_chars) or not fits


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.tuples(st.sampled_from(["system", "user"]), SIM_TEXT), min_size=1,
                      max_size=5),
    max_chars=st.integers(1, 2000),
)  # fmt: skip
def test_a_cut_sim_prompts_tokens_are_the_whole_prompts_first_tokens(
    messages: list[tuple[str, str]], max_chars: int
) -> None:
    """The same for the sim's tokenizer, on any text: its tokens of a cut text are the
    whole text's but the last, so nothing more is left out."""
    found = prompts.SimPrompts()
    chat, completion = both_shapes(messages)
    framed = simtokens.render_chat(messages)
    for parsed, text in ((chat, framed), (completion, completion.text)):
        whole = check_beginning(found, parsed, max_chars)
        got = found.ids(parsed, max_chars)
        assert len(got or []) >= len(simtokens.tokenize(text[:max_chars])) - 1
        if len(text) - (len(simtokens.GENERATION_PROMPT) if parsed.chat else 0) <= max_chars:
            assert whole


class _Counting:
    """A tokenizer (or template) that records how much it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chars: list[int] = []
        self.messages: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.chars.append(len(text))
        return self.inner.encode(text, **kw)

    def render(self, messages: list[dict[str, str]], **kw: Any) -> str:
        self.messages.append(len(messages))
        return str(self.inner.render(messages=messages, **kw))


SENTENCE = " You are a careful assistant. What is two and two?"
HUGE = SENTENCE * (2_000_000 // len(SENTENCE))
"""2 MB of prompt: the router takes bodies of up to 8 MiB."""


def test_a_prompt_of_megabytes_is_tokenized_on_its_beginning_only(tokenizer_dir: Path) -> None:
    """A body of megabytes was tokenized whole on the router's loop (3.3 s for 6 MB, every
    other request waiting). Only `max_chars` characters reach the tokenizer, and a chat's
    first `MAX_MESSAGES` messages its template; the prompt's length is estimated."""
    found = prompts.HfPrompts.load(tokenizer_dir)
    tok, template = _Counting(found._tok), _Counting(found._template)
    found._tok, found._template = tok, template
    got = found.tokens(completion_parsed(HUGE), 4096)
    assert got is not None
    assert tok.chars == [4096]
    whole = len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(HUGE).ids)
    assert 0.95 * whole <= got.estimate <= 1.05 * whole
    # One message of megabytes, 200,000 short ones, and as many empty ones.
    for messages, rendered in (
        ([("user", HUGE)], 1),
        ([("user", SENTENCE)] * 200_000, 4096 // len(SENTENCE) + 1),
        ([("user", "")] * 200_000, prompts.MAX_MESSAGES),
    ):
        tok.chars.clear()
        template.messages.clear()
        got = found.tokens(chat_parsed(messages), 4096)
        assert got is not None
        assert got.ids
        assert template.messages == [rendered]
        assert tok.chars[0] <= 4096 + prompts.MAX_MESSAGES * len("<|assistant|></s>")


def test_the_sims_tokenizer_sees_a_long_prompts_beginning_only() -> None:
    sim = prompts.SimPrompts()
    counted: list[int] = []
    inner = sim.cache._tokenize

    def counting(text: str) -> list[int]:
        counted.append(len(text))
        return inner(text)

    sim.cache._tokenize = counting
    completion = completion_parsed(HUGE)
    for parsed in (completion, chat_parsed([("user", HUGE)]),
                   chat_parsed([("user", SENTENCE)] * 200_000)):  # fmt: skip
        counted.clear()
        got = sim.tokens(parsed, 4096)
        assert got is not None
        assert got.ids
        assert sum(counted) <= 4096
    got = sim.tokens(completion, 4096)
    assert got is not None
    whole = len(simtokens.tokenize(HUGE))
    assert 0.95 * whole <= got.estimate <= 1.05 * whole


@pytest.mark.parametrize(
    "messages",
    [
        [("user", "")] * 600,
        [("user", "What?")] * 2000,
        [("user", "ok")] * 600,
        [("system", SENTENCE * 40), ("user", SENTENCE * 200)],
    ],
)
def test_a_cut_chats_length_is_estimated_in_the_units_of_its_text(
    tokenizer_dir: Path, messages: list[tuple[str, str]]
) -> None:
    """The estimate scales the kept tokens by the chat's text (roles, contents, newlines)
    over the part of it they stand for: counting only the kept contents took 600 empty
    messages for 15,908,400 tokens (5,410), 2,000 x "What?" for 52,821 (24,010)."""
    parsed = chat_parsed(messages)
    hf = prompts.HfPrompts.load(tokenizer_dir)
    rendered = hf._template.render(
        messages=[{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    wholes = {
        "hf": len(tok.encode(rendered, add_special_tokens=False).ids),
        "sim": len(simtokens.tokenize(simtokens.render_chat(messages))),
    }
    for name, found in (("hf", hf), ("sim", prompts.SimPrompts())):
        whole = wholes[name]
        got = found.tokens(parsed, 1024)
        assert got is not None
        assert len(got.ids) < whole
        assert whole / 1.5 <= got.estimate <= whole * 1.5, (name, whole)


@pytest.mark.parametrize(
    ("engine", "joined"), [("vllm", "Two\nand two?"), ("sglang", "Two  and two?")]
)
def test_a_messages_parts_are_rendered_as_the_models_engine_joins_them(
    tokenizer_dir: Path, engine: Any, joined: str
) -> None:
    """vLLM joins a message's non-empty texts with a newline (`"\\n".join(texts)`); SGLang
    gives a text-only template its text parts' texts, empty ones too, with a space between
    two:

        new_msg["content"] = " ".join(text_parts) if text_parts else ""
    """
    parts = [{"type": "text", "text": t} for t in ("Two", "", "and two?")]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    found = prompts.for_profile(ModelProfile(name="m", engine=engine, tokenizer=str(tokenizer_dir)))
    assert isinstance(found, prompts.HfPrompts)
    ids = found.ids(parse("chat", json.dumps(body).encode(), want_text=True))
    as_string = parse("chat", chat_body(("user", joined)), want_text=True)
    assert list(ids or []) == list(found.ids(as_string) or [])


@pytest.mark.parametrize("kind", ["messages", "responses"])
@pytest.mark.parametrize(
    ("engine", "joined"), [("vllm", "Two\nand two?"), ("sglang", "Two  and two?")]
)
def test_a_messages_or_responses_body_is_rendered_as_the_models_engine_turns_it_into_a_chat(
    tokenizer_dir: Path, kind: str, engine: Any, joined: str
) -> None:
    """SGLang serves both APIs by turning the body into a chat of its own
    (`llmgw.router.sglang_turns`), whose parts reach the template joined as its chat's."""
    if kind == "messages":
        parts = [{"type": "text", "text": t} for t in ("Two", "", "and two?")]
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    else:
        parts = [{"type": "input_text", "text": t} for t in ("Two", "", "and two?")]
        body = {"model": "m", "input": [{"role": "user", "content": parts}]}
    found = prompts.for_profile(ModelProfile(name="m", engine=engine, tokenizer=str(tokenizer_dir)))
    assert isinstance(found, prompts.HfPrompts)
    ids = found.ids(parse(kind, json.dumps(body).encode(), want_text=True))  # type: ignore[arg-type]
    as_string = parse("chat", chat_body(("user", joined)), want_text=True)
    assert list(ids or []) == list(found.ids(as_string) or [])


def test_a_chat_gets_its_templates_bos_once_and_a_completion_the_tokenizers(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A tokenizer that adds a BOS of its own (a post-processor): the engines tokenize a
    rendered chat without it (its template wrote one) and a completion's prompt with it."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(tokenizer_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    found = prompts.HfPrompts.load(tmp_path)
    chat = list(found.ids(parse("chat", chat_body(("user", "Two?")), want_text=True)) or [])
    assert chat[0] == bos
    assert chat.count(bos) == 1
    completion = parse("completions", b'{"model": "m", "prompt": "Two?"}', want_text=True)
    assert list(found.ids(completion) or []) == tok.encode("Two?").ids
    assert (found.ids(completion) or [None])[0] == bos


def test_a_llama_server_models_claude_code_requests_are_one_prefix_of_tokens(
    tokenizer_dir: Path,
) -> None:
    """llama-server writes the billing header's `cch` as `fffff`: its model's tokens of two
    requests differing only there are equal; a vLLM model's differ."""
    bodies = [
        json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                    "system": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};\nbe brief"})
        for cch in ("a5145", "1c8b4")
    ]  # fmt: skip
    for engine, alike in (("llamacpp", True), ("vllm", False)):
        found = prompts.HfPrompts.load(tokenizer_dir, engine)
        ids = [list(found.ids(parse("messages", b.encode(), want_text=True)) or []) for b in bodies]
        assert ids[0]
        assert (ids[0] == ids[1]) is alike, engine
