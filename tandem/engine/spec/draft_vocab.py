"""A draft vocabulary: drafters score only the tokens the target emits most often (FR-Spec, Zhao
et al. 2025).

Medusa and EAGLE heads are small, but their logits come from the target's LM head: SmolLM2's is
49152 x 576, 113 MB in float32, read for every drafted position (9.8 ms of a ~21 ms decode step
at batch 1 on 2 CPU cores; its 8192 most frequent rows: 0.8 ms), and a small draft model's own
LM head is as large. So a drafter scores the first N tokens of a frequency ranking saved beside
it (`spec train` counts the tokens of its corpus into `draft_vocab.json`), and a token outside
them is never drafted. Exactness is untouched: the logits of the other tokens are -inf, so q is
0 there, and verification accepts or corrects every draft under q as before. Drafters without a
ranking (public checkpoints, layer-skip) score the whole vocabulary.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

from tandem.engine.models.linear import linear
from tandem.engine.tp.vocab import TargetVocab

VOCAB_FILE = "draft_vocab.json"

LMHead = Callable[[Tensor], Tensor]  # [n, hidden] -> [n, vocab] float32 logits


def save_ranking(out: Path, sequences: Iterable[Tensor]) -> None:
    """Rank the tokens of `sequences` by count (ties: the lower id first) into `out`."""
    counts: Counter[int] = Counter()
    for tokens in sequences:
        counts.update(tokens.tolist())
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    body = {"ranked_token_ids": ranked, "num_tokens_counted": sum(counts.values())}
    (out / VOCAB_FILE).write_text(json.dumps(body) + "\n")


def load_ranking(path: Path) -> list[int] | None:
    """The ranking saved with the drafter at `path`, or None; ValueError if it is not one."""
    file = path / VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ranked = [int(token) for token in json.loads(file.read_text())["ranked_token_ids"]]
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{file} is not a token ranking ({type(e).__name__}: {e})") from None
    return ranked


class DraftVocab:
    """A model's LM head restricted to `token_ids`; logits of the other tokens are -inf."""

    def __init__(self, token_ids: Iterable[int], model: TargetVocab) -> None:
        weight = model.lm_head_weight
        self.vocab_size = weight.shape[0]
        ids = sorted(set(token_ids))
        if not ids or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"a draft vocabulary needs token ids in [0, {self.vocab_size})")
        self.token_ids = torch.tensor(ids, dtype=torch.long, device=weight.device)
        self.weight = weight.detach()[self.token_ids].contiguous()

    def __len__(self) -> int:
        return len(self.token_ids)

    def __call__(self, hidden: Tensor) -> Tensor:
        shape = (hidden.shape[0], self.vocab_size)
        logits = torch.full(shape, float("-inf"), dtype=torch.float32, device=hidden.device)
        logits[:, self.token_ids] = linear(hidden, self.weight).float()
        return logits


def draft_lm_head(path: str | Path, size: int, model: TargetVocab) -> LMHead:
    """The LM head for the drafter saved at `path` (heads, or a draft model): `model`'s (the
    target's for heads, under tensor parallelism rank 0's whole copy of it) over the first `size`
    tokens of the ranking saved there, or the whole head (no ranking, `size` 0, or a ranking no
    shorter than the vocabulary)."""
    ranked = load_ranking(Path(path))
    if ranked is None or size == 0 or min(size, len(ranked)) >= model.lm_head_weight.shape[0]:
        return model.compute_logits
    try:
        return DraftVocab(ranked[:size], model)
    except ValueError as e:
        raise ValueError(f"{Path(path) / VOCAB_FILE}: {e}") from None
