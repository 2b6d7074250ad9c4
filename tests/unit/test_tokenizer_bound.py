"""The router refuses a prompt from its length alone (`Tokenizer.surely_longer`) only where that
is sound: a byte-level BPE, whose every token covers at most its vocabulary's longest entry of
characters. Where a token can cover more, or characters can vanish before the model sees them,
there is no bound and every prompt is encoded. Small tokenizers trained here, in memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import AddedToken, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from tandem.tokenizer import Tokenizer

CORPUS = ["hello world, " * 40, "a cluster serves requests while its parts fail. " * 40]


def byte_level() -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def with_swallowing_token() -> Backend:
    backend = byte_level()
    backend.add_special_tokens([AddedToken("<|end|>", lstrip=True, rstrip=True)])
    return backend


def whitespace_split() -> Backend:
    backend = Backend(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"], show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def stripped() -> Backend:
    backend = byte_level()
    backend.normalizer = normalizers.Sequence([normalizers.Strip(), normalizers.NFC()])
    return backend


def load(tmp_path: Path, make: Callable[[], Backend]) -> Tokenizer:
    make().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    return Tokenizer(tmp_path)


def test_a_byte_level_bpe_is_bounded_by_its_longest_entry(tmp_path: Path) -> None:
    tokenizer = load(tmp_path, byte_level)
    longest = tokenizer.max_token_chars
    assert longest is not None and longest > 1
    densest = max(
        (tokenizer.decode([i]) for i in range(tokenizer.backend.get_vocab_size())), key=len
    )
    for text in [*CORPUS, densest * 200, "naïve café 🙂 " * 100]:
        n = len(tokenizer.encode(text))
        assert not tokenizer.surely_longer(text, n)  # never refuses a text that fits
    text = "x" * 1000
    assert tokenizer.surely_longer(text, 1000 // longest - 1)


@pytest.mark.parametrize(
    "make", [with_swallowing_token, whitespace_split, stripped], ids=lambda f: f.__name__
)
def test_no_bound_where_a_token_may_cover_more_or_characters_vanish(
    tmp_path: Path, make: Callable[[], Backend]
) -> None:
    tokenizer = load(tmp_path, make)
    assert tokenizer.max_token_chars is None
    text = "  <|end|>  " * 200 if make is with_swallowing_token else "   " * 2000
    assert not tokenizer.surely_longer(text, 1)
    longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))
    assert len(tokenizer.encode(text)) < len(text) / longest  # so a bound would be wrong
