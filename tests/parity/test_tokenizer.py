"""The router's torch-free tokenizer (tandem.tokenizer) against transformers on the real model.

The router tokenizes prompts and renders chat messages with it, the engine with transformers:
both must give the same token ids, text and chat prompt, or the two halves of a request disagree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tandem.tokenizer import load_tokenizer, tokenizer_dir

TEXTS = [
    "Hello world",
    "Hello world, naïve café 🙂\n  def f(x): return x",
    "  leading spaces and trailing  ",
    "中文和日本語のテキスト, русский текст, العربية",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567890 3.14159 -42 and tabs\tand\r\nCRLF",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, with émojis 🙂?"},
    ],
]


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> object:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir(smollm2_path)))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_encode_and_decode_match_transformers(
    smollm2_path: Path, reference: object, text: str, special: bool
) -> None:
    ours = load_tokenizer(smollm2_path)
    ids = ours.encode(text, add_special_tokens=special)
    assert ids == reference(text, add_special_tokens=special)["input_ids"]  # type: ignore[operator]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(  # type: ignore[attr-defined]
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2_path: Path, reference: object, messages: list[dict[str, str]], generation_prompt: bool
) -> None:
    rendered = load_tokenizer(smollm2_path).apply_chat_template(
        messages, add_generation_prompt=generation_prompt
    )
    assert rendered == reference.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )


def test_continue_final_message_and_tools_match_transformers(
    smollm2_path: Path, reference: object
) -> None:
    ours = load_tokenizer(smollm2_path)
    chat = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2, "}]
    assert ours.apply_chat_template(
        chat, False, continue_final_message=True
    ) == reference.apply_chat_template(  # type: ignore[attr-defined]
        chat, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    # A template that renders tools reads the same `tools` variable transformers passes.
    ours.chat_template = reference.chat_template = (  # type: ignore[attr-defined]
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    )
    ours._template = None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.renders_tools is False  # no `tool_calls` in it: tools go the Hermes way
    assert ours.apply_chat_template(chat, tools=tools) == reference.apply_chat_template(  # type: ignore[attr-defined]
        chat, tools=tools, tokenize=False
    )


def test_a_template_error_is_a_value_error(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.chat_template = "{{ raise_exception('only user turns') }}"
    tokenizer._template = None
    with pytest.raises(ValueError, match="only user turns"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("repeat", ["", "=", " ", "<|im_start|>", "densest"])
def test_surely_longer_never_refuses_a_text_that_fits(smollm2_path: Path, repeat: str) -> None:
    """The router refuses a prompt from its length alone only when it has more tokens: a text
    of n tokens is never `surely_longer` than n, down to the densest text there is (the token
    that covers the most characters, repeated)."""
    ours = load_tokenizer(smollm2_path)
    assert ours.max_token_chars is not None
    if repeat == "densest":
        vocab = ours.backend.get_vocab_size(with_added_tokens=True)
        repeat = max((ours.decode([i]) for i in range(vocab)), key=len)
    for text in [*TEXTS, repeat * 1000]:
        assert not ours.surely_longer(text, len(ours.encode(text)))
