"""The router tokenizes prompts as the engine does (llmgw.router.prompts): a Hugging Face
tokenizer (trained here, in-process) with its chat template, and the sim's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llmgw.core import kvblocks, simtokens
from llmgw.core.profile import ModelProfile
from llmgw.router import prompts
from llmgw.router.requests import parse

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
