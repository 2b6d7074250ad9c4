"""N-gram (prompt lookup) proposer: drafts by copying what followed an earlier occurrence.

Input-grounded tasks (summarization, RAG, code edits) repeat spans of the prompt; when the last
n tokens of a request occurred before, the tokens that followed that occurrence are a cheap,
often-right guess for what comes next. Longer n-grams are tried first (fewer, surer matches);
among matches of one length the most recent wins, as generated text tends to repeat itself
locally. No model, no probabilities: the drafts are one-hot, which the verifier handles exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.engine.request import Request
from tandem.engine.spec.proposer import Draft, Proposer, StepHidden


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        return [Draft(self.lookup(req.all_token_ids, k)) for req, k in batch]

    def lookup(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: num_speculative_tokens) draft tokens to follow `token_ids`."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows over tokens[:-1] end before the last token, so the suffix itself is not
            # among them and every match has at least one token after it.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + k].tolist()
        return []
