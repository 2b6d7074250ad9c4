"""Grammar matchers for structured outputs (llguidance): one compiled grammar per distinct
grammar, one matcher per constrained request, and the token masks the sampler applies.

A constrained request's matcher, from its admission to its end:

    add_request    a copy of its grammar's compiled matcher (`GrammarCache`, keyed by the grammar
                   string), advanced over the output a resumed (migrated) request already has:
                   the last `output_offset` tokens of its prompt
    each step      the runner asks `token_masks` for the request's rows of the step's mask: one
                   row for a plain step; for a verify step one row per draft position and the
                   bonus position, the matcher advanced along the drafts, then rolled back
    a kept token   advances it (`Request.append_output`), the prefill worker's first token
                   included on the decode side; a preempted request keeps its output and so its
                   matcher, and recomputes its KV only
    drafts         the tokens the grammar forces next are drafts for free (they replace a
                   proposer's drafts that do not begin with them); one-hot drafts (n-gram) are
                   cut at the first token the grammar refuses: the verifier would reject it for
                   sure and sample from the masked target instead. Sampled drafts (a draft
                   model) are verified as they are: the masked target gives a refused draft
                   probability 0, so it is rejected, exactly.

When the grammar is complete only EOS is allowed, so the request stops on EOS. A matcher in an
error state (it cannot happen for tokens sampled under its own masks) allows EOS only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from tandem.structured import StructuredOutput

if TYPE_CHECKING:  # imported on a grammar's first use: engines without one never load it
    import llguidance

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine, least recently used dropped


class GrammarMatcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = tuple(eos_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance over a kept token; False (and an error state) if the grammar refuses it."""
        return bool(self.matcher.consume_token(token_id))

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the first, the grammar accepts in a row."""
        return int(self.matcher.validate_tokens(list(token_ids)))

    def drafts(
        self, token_ids: list[int], probs: Tensor | None, k: int
    ) -> tuple[list[int], Tensor | None]:
        """A proposer's drafts (`probs` None: one-hot) as this request verifies them: the tokens
        the grammar forces next replace drafts that do not begin with them (free drafts: the
        verifier keeps each with its target probability, 1 where the mask allows only it); then
        one-hot drafts are cut at the first token the grammar refuses. At most k tokens."""
        forced = list(self.matcher.compute_ff_tokens())[:k]
        if forced and token_ids[: len(forced)] != forced:
            token_ids, probs = forced, None
        if probs is None:
            token_ids = token_ids[: self.valid_prefix(token_ids)]
        return token_ids, probs

    def fill_rows(self, bitmask: Tensor, first_row: int, draft_token_ids: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(drafts) of `bitmask` ([rows, words] int32): what
        the grammar allows after each prefix of the drafts. Rows after a refused draft copy the
        row of the refusal (the verifier stops there, any distribution will do)."""
        valid = self.valid_prefix(draft_token_ids)
        for i in range(len(draft_token_ids) + 1):
            if i > valid:
                bitmask[first_row + i] = bitmask[first_row + valid]
                continue
            if self.matcher.is_error():
                words = bitmask[first_row + i].numpy().view(np.uint32)  # the row, unsigned
                words[:] = 0
                for eos in self.eos_token_ids:
                    words[eos // 32] |= np.uint32(1 << (eos % 32))
            else:
                row = bitmask[first_row + i]  # contiguous int32 words
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if i < valid:
                self.matcher.consume_token(draft_token_ids[i])
        self.matcher.rollback(valid)


class GrammarCache:
    """Compiles each distinct grammar once against the model's tokenizer (built on first use)
    and hands out matchers for it."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        return llguidance.LLTokenizer(
            self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
        )

    def matcher(
        self, structured: StructuredOutput, output_token_ids: Sequence[int]
    ) -> GrammarMatcher:
        """A fresh matcher advanced over `output_token_ids`; ValueError names the request field
        when the grammar does not compile or refuses that output."""
        key = structured.grammar
        compiled = self._compiled.get(key)
        if compiled is None:
            import llguidance

            compiled = llguidance.LLMatcher(self.tokenizer, key, log_level=0)
            if compiled.is_error():
                raise ValueError(f"{structured.source}: {compiled.get_error()}")
            self._compiled[key] = compiled
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        matcher = GrammarMatcher(compiled.deep_copy(), self.eos_token_ids)
        for i, token_id in enumerate(output_token_ids):
            if not matcher.accept(token_id):
                raise ValueError(
                    f"{structured.source}: output token {token_id} at position {i} does not "
                    "match the grammar"
                )
        return matcher


def token_masks(
    rows: Sequence[tuple[GrammarMatcher | None, Sequence[int]]],
    vocab_size: int,
    device: torch.device,
) -> Tensor | None:
    """The tokens each sampled row may take: [num_rows, vocab_size] bool, or None when no request
    is constrained. `rows` holds per request its matcher (None: free) and its drafts; a request
    has 1 + len(drafts) rows, in order."""
    if all(m is None for m, _ in rows):
        return None
    num_rows = sum(1 + len(drafts) for _, drafts in rows)
    bitmask = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    row = 0
    for matcher, drafts in rows:
        if matcher is not None:
            matcher.fill_rows(bitmask, row, drafts)
        row += 1 + len(drafts)
    # numpy unpacks bits about 100x faster than torch's shifts on CPU (tandem bench grammar).
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool).to(device)
