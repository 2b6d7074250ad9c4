"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE).

Tokens are fed the way `LLM` feeds them: `add` then `pop_text(finished)` after every step, where a
found stop string finishes the request. Streaming must add up to the final text and the final text
must equal a full decode, cut before the stop string.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.detokenizer import IncrementalDetokenizer
from tandem.engine.models.loader import load_tokenizer

pytestmark = pytest.mark.slow

FOX = "The quick brown fox jumps over the lazy dog."
MIXED = "Café 🎉 naïve  résumé, 日本語 — ok!"
TEXTS = [
    "Café au lait, naïve résumé — ok",
    " Hello  there,\n  indented",  # leading and doubled spaces
    "Party 🎉🤖 time! 👩\u200d👩\u200d👧",  # 4-byte characters spread over 3 tokens each
    "日本語とFrançais",
    MIXED,
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(
    tokenizer: Any,
    prompt: list[int],
    token_ids: list[int],
    stop: tuple[str, ...] = (),
    chunk: int = 1,
    skip_special_tokens: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `chunk` tokens per step until the end or a stop string; return the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop, skip_special_tokens)
    deltas = []
    for start in range(0, len(token_ids), chunk):
        detok.add(token_ids[start : start + chunk])
        finished = detok.stop_string is not None or start + chunk >= len(token_ids)
        deltas.append(detok.pop_text(finished))
        assert "\ufffd" not in deltas[-1]
        if finished:
            break
    assert "".join(deltas) == detok.text
    return deltas, detok


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(
    tokenizer: Any, prompt: list[int], text: str, chunk: int
) -> None:
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    deltas, _ = stream(tokenizer, prompt, ids, chunk=chunk)
    assert "".join(deltas) == text


def test_a_character_is_emitted_only_once_complete(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, " 🎉")
    assert len(ids) == 3  # the emoji's 4 bytes spread over 3 tokens, the space in the first
    deltas, _ = stream(tokenizer, prompt, ids)
    assert deltas == ["", "", " 🎉"]


def test_leading_space_after_the_prompt_is_kept(tokenizer: Any, prompt: list[int]) -> None:
    deltas, _ = stream(tokenizer, prompt, encode(tokenizer, " Hello world"))
    assert deltas == [" Hello", " world"]


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_special_tokens(tokenizer: Any, prompt: list[int], skip: bool, expected: str) -> None:
    ids = [*encode(tokenizer, "Hi there"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    deltas, _ = stream(tokenizer, prompt, ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected


def test_stop_string_spanning_two_tokens(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, FOX)  # "The", " quick", " brown", ...
    deltas, detok = stream(tokenizer, prompt, ids, stop=("ick bro",))
    assert len(deltas) == 3  # found as soon as " brown" arrived
    assert (detok.text, detok.stop_string) == ("The qu", "ick bro")


def test_stop_string_at_the_very_start(tokenizer: Any, prompt: list[int]) -> None:
    deltas, detok = stream(tokenizer, prompt, encode(tokenizer, FOX), stop=("Th",))
    assert deltas == [""]
    assert (detok.text, detok.stop_string) == ("", "Th")


def test_earliest_stop_string_in_a_step_wins(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, FOX)
    _, detok = stream(tokenizer, prompt, ids, stop=("fox", "lazy", "quick"), chunk=len(ids))
    assert (detok.text, detok.stop_string) == ("The ", "quick")


def test_first_stop_string_to_complete_ends_the_stream(tokenizer: Any, prompt: list[int]) -> None:
    # "brown fox jumps" starts earlier but "fox" is complete two tokens sooner.
    stop = ("brown fox jumps", "fox")
    _, detok = stream(tokenizer, prompt, encode(tokenizer, FOX), stop=stop)
    assert (detok.text, detok.stop_string) == ("The quick brown ", "fox")


def test_multibyte_stop_string(tokenizer: Any, prompt: list[int]) -> None:
    _, detok = stream(tokenizer, prompt, encode(tokenizer, "Party 🎉🤖 time!"), stop=("🤖",))
    assert (detok.text, detok.stop_string) == ("Party 🎉", "🤖")


def test_held_back_text_is_flushed_when_finished(tokenizer: Any, prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=("zzz",))
    detok.add(encode(tokenizer, "Hello world"))
    assert detok.pop_text(finished=False) == "Hello wor"  # "ld" is held: len("zzz") - 1
    assert detok.pop_text(finished=True) == "ld"


@pytest.mark.parametrize("extra_stop", [(), ("#" * 12,)], ids=["one-stop", "long-hold-back"])
def test_streaming_never_emits_text_of_a_stop_string(
    tokenizer: Any, prompt: list[int], extra_stop: tuple[str, ...]
) -> None:
    """Every substring of MIXED as the stop string: the streamed deltas, read as they come, add
    up to the full decode cut before its first occurrence."""
    ids = encode(tokenizer, MIXED)
    stops = {MIXED[i : i + n] for n in (1, 2, 3, 5, 8) for i in range(len(MIXED) - n + 1)}
    for stop in sorted(stops):
        deltas, detok = stream(tokenizer, prompt, ids, stop=(stop, *extra_stop))
        expected = MIXED[: MIXED.index(stop)]
        assert "".join(deltas) == detok.text == expected, stop
        assert detok.stop_string == stop
