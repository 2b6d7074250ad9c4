"""Batched sampling of one token per request from the logits of one engine step.

The stages are separate functions because speculative decoding needs the processed distribution:
`apply_penalties` (logit bias, repetition/presence/frequency, min_tokens, a structured output's
token mask)
-> `processed_probs` (temperature,
top-k, top-p, min-p; greedy rows one-hot) -> `sample_from_probs` (exponential race). `Sampler`
chains them and adds logprobs of the raw model distribution. A `SamplingBatch` holds only the
tensors some request in the step needs: an all-greedy batch without penalties costs one argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams


def request_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The generator a seeded request owns for its whole life; None for unseeded requests.

    Reseed it with `seed_for_position` before each draw: the noise for output position i then
    depends only on (seed, i), so a seeded request samples the same tokens whether it was
    preempted and recomputed, or prefilled on one worker and decoded on another.
    """
    return None if seed is None else torch.Generator(device).manual_seed(seed)


def seed_for_position(seed: int, position: int) -> int:
    """A 64-bit seed for the draw of output token `position` of a request seeded with `seed`."""
    return (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling inputs of the requests sampled in one step, one row each; None = not needed."""

    num_reqs: int
    all_greedy: bool
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # (row, its request's generator)
    greedy: Tensor | None  # [num_reqs] bool; None unless greedy and random rows mix
    temperature: Tensor | None  # [num_reqs, 1]; 1.0 on greedy rows; None = all 1.0
    top_k: Tensor | None  # [num_reqs] long; 0 = disabled
    max_top_k: int
    top_p: Tensor | None  # [num_reqs, 1]
    min_p: Tensor | None  # [num_reqs, 1]
    repetition_penalty: Tensor | None  # [num_reqs, 1]
    presence_penalty: Tensor | None  # [num_reqs, 1]
    frequency_penalty: Tensor | None  # [num_reqs, 1]
    prompt_mask: Tensor | None  # [num_reqs, vocab] bool; only with repetition_penalty
    output_counts: Tensor | None  # [num_reqs, vocab] float
    banned: tuple[Tensor, Tensor] | None  # ([num_banned] rows, [num_banned] token ids)
    logit_bias: tuple[Tensor, Tensor, Tensor] | None  # ([n] rows, [n] token ids, [n] biases)
    allowed: Tensor | None  # [num_reqs, vocab] bool: what each row's grammar allows next
    num_logprobs: tuple[int | None, ...]  # per row, as requested
    max_num_logprobs: int | None  # None: no row wants logprobs

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
        allowed: Tensor | None = None,
    ) -> SamplingBatch:
        """One row per request; `generators` from `request_generator`, histories as token ids,
        `allowed` from `tandem.engine.grammar.token_masks` (None: no row is constrained)."""
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)

        def column(values: list[float]) -> Tensor:  # [num_reqs, 1]
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        def sampled_column(values: list[float], neutral: float) -> Tensor | None:
            # Greedy rows stay neutral (their distribution becomes a one-hot); all neutral: None.
            values = [neutral if g else v for v, g in zip(values, greedy, strict=True)]
            return column(values) if any(v != neutral for v in values) else None

        ks = [
            0 if g or p.top_k >= vocab_size else max(p.top_k, 0)
            for p, g in zip(params, greedy, strict=True)
        ]

        repetition = [p.repetition_penalty != 1.0 for p in params]
        openai = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        output_counts = prompt_mask = None
        if any(repetition) or any(openai):
            # Rows without penalties contribute no history: their neutral penalties ignore it.
            # A resumed request's output began `output_offset` tokens before its prompt's end.
            outputs = [
                (*prompt[len(prompt) - p.output_offset :], *ids) if r or o else ()
                for p, prompt, ids, r, o in zip(
                    params, prompt_ids, output_ids, repetition, openai, strict=True
                )
            ]
            output_counts = _token_counts(outputs, vocab_size, device).float()
        if any(repetition):
            prompts = [ids if r else () for ids, r in zip(prompt_ids, repetition, strict=True)]
            prompt_mask = _token_counts(prompts, vocab_size, device) > 0

        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, (p, output) in enumerate(zip(params, output_ids, strict=True)):
            if len(output) < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                banned_rows += [row] * len(stop_ids)
                banned_ids += sorted(stop_ids)
        banned = None
        if banned_rows:
            banned = (
                torch.tensor(banned_rows, dtype=torch.long, device=device),
                torch.tensor(banned_ids, dtype=torch.long, device=device),
            )

        bias_rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
        logit_bias = None
        if bias_rows:
            pairs = [pair for p in params for pair in p.logit_bias]
            logit_bias = (
                torch.tensor(bias_rows, dtype=torch.long, device=device),
                torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device),
                torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device),
            )

        num_logprobs = tuple(p.logprobs for p in params)
        requested = [n for n in num_logprobs if n is not None]
        return cls(
            num_reqs=len(params),
            all_greedy=all_greedy,
            seeded_rows=tuple(
                (row, g)
                for row, (g, is_greedy) in enumerate(zip(generators, greedy, strict=True))
                if g is not None and not is_greedy
            ),
            greedy=torch.tensor(greedy, device=device) if any(greedy) and not all_greedy else None,
            temperature=sampled_column([p.temperature for p in params], 1.0),
            top_k=torch.tensor(ks, device=device) if any(ks) else None,
            max_top_k=max(ks, default=0),
            top_p=sampled_column([p.top_p for p in params], 1.0),
            min_p=sampled_column([p.min_p for p in params], 0.0),
            repetition_penalty=(
                column([p.repetition_penalty for p in params]) if any(repetition) else None
            ),
            presence_penalty=column([p.presence_penalty for p in params]) if any(openai) else None,
            frequency_penalty=column([p.frequency_penalty for p in params])
            if any(openai)
            else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned=banned,
            logit_bias=logit_bias,
            allowed=allowed,
            num_logprobs=num_logprobs,
            max_num_logprobs=min(max(requested), vocab_size) if requested else None,
        )


def _token_counts(
    histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """How often each token occurs in each history: [len(histories), vocab_size] long."""
    num_rows = len(histories)
    lengths = torch.tensor([len(h) for h in histories], device=device)  # [num_rows]
    ids = torch.tensor(
        list(itertools.chain.from_iterable(histories)), dtype=torch.long, device=device
    )
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)  # [num_ids]
    counts = torch.bincount(rows * vocab_size + ids, minlength=num_rows * vocab_size)
    return counts.view(num_rows, vocab_size)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Logit bias (OpenAI; first, as vLLM adds it), repetition (HF), presence/frequency (OpenAI)
    penalties, min_tokens suppression, and the structured outputs' masks (greedy rows then take
    the best allowed token).

    logits: [num_reqs, vocab]; returns a new tensor, or `logits` itself when nothing applies.
    """
    if batch.logit_bias is not None:
        rows, token_ids, biases = batch.logit_bias
        logits = logits.index_put((rows, token_ids), biases.to(logits.dtype), accumulate=True)
    if batch.repetition_penalty is not None:
        assert batch.prompt_mask is not None and batch.output_counts is not None
        seen = batch.prompt_mask | (batch.output_counts > 0)  # [num_reqs, vocab]
        rp = batch.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if batch.presence_penalty is not None:
        assert batch.frequency_penalty is not None and batch.output_counts is not None
        counts = batch.output_counts
        logits = logits - batch.frequency_penalty * counts - batch.presence_penalty * (counts > 0)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, logits.new_tensor(float("-inf")))
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, float("-inf"))
    return logits


def processed_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The distribution each row samples from: [num_reqs, vocab] float32, rows sum to 1.

    logits: [num_reqs, vocab], penalties already applied. Greedy rows are a one-hot of the argmax.
    """
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    scaled = logits.float()  # [num_reqs, vocab]
    if batch.temperature is not None:
        scaled = scaled / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.max_top_k, batch.top_p)
    probs = scaled.softmax(dim=-1)
    if batch.min_p is not None:
        # min-p after top-k/top-p (HF order); renormalising does not move the p / p_max ratio.
        threshold = batch.min_p * probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if batch.greedy is not None:
        probs = torch.where(batch.greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: Tensor) -> Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)  # [num_reqs, vocab]


def _apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, max_top_k: int, top_p: Tensor | None
) -> Tensor:
    """Mask to -inf what top-k (ties at the k-th value kept) and then top-p (nucleus) exclude."""
    if top_p is None:
        assert top_k is not None
        # top-k alone needs no full sort: one topk gives every row's k-th largest value.
        top_values = logits.topk(max_top_k, dim=-1).values  # [num_reqs, max_top_k]
        kth = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))  # [num_reqs, 1]
        kth = kth.masked_fill(top_k.unsqueeze(1) == 0, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [num_reqs, vocab]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_reqs, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # A token is cut when the mass at or below it is <= 1 - p, i.e. the mass above it is >= p.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    cut = cumulative <= 1 - top_p
    cut[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def sample_from_probs(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """One token per row by the exponential race argmax(p / q), q ~ Exp(1): [num_reqs] long.

    Each seeded row draws q from its own generator, so its tokens depend only on its seed and
    its own logits, never on which other requests share the step; unseeded rows share one draw.
    """
    q = torch.empty_like(probs)  # [num_reqs, vocab]
    if len(batch.seeded_rows) < batch.num_reqs:
        q.exponential_()
    for row, generator in batch.seeded_rows:
        q[row].exponential_(generator=generator)
    # Exp(1) can draw 0, and 0 / 0 = nan would win the argmax for a masked token.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


@dataclass(frozen=True)
class LogprobsTensors:
    """Column 0 holds the sampled token, columns 1.. the top-n tokens, most likely first."""

    token_ids: Tensor  # [num_reqs, 1 + max_num_logprobs] long
    logprobs: Tensor  # [num_reqs, 1 + max_num_logprobs] float32
    ranks: Tensor  # [num_reqs] long

    def to_lists(self, num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Per request: its top-n as requested, or None where it asked for no logprobs."""
        ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [
            None
            if n is None
            else TokenLogprobs(
                token_id=ids[row][0],
                logprob=logprobs[row][0],
                rank=ranks[row],
                top_token_ids=tuple(ids[row][1 : n + 1]),
                top_logprobs=tuple(logprobs[row][1 : n + 1]),
            )
            for row, n in enumerate(num_logprobs)
        ]


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: int) -> LogprobsTensors:
    """logprobs: [num_reqs, vocab]; token_ids: [num_reqs] the sampled tokens."""
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_reqs, 1]
    ranks = (logprobs >= sampled).sum(dim=-1)  # [num_reqs]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [num_reqs, num_top]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled, top_logprobs], dim=1),
        ranks=ranks,
    )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: Tensor  # [num_reqs] long
    logprobs: LogprobsTensors | None  # None when no request asked for logprobs


class Sampler:
    """Penalties -> processed distribution -> one token per request, plus raw logprobs."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [num_reqs, vocab] from the model, one row per request sampled this step."""
        penalized = apply_penalties(logits, batch)
        if batch.all_greedy:
            token_ids = penalized.argmax(dim=-1)
        else:
            token_ids = sample_from_probs(processed_probs(penalized, batch), batch)
        logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)  # [num_reqs, vocab]
            logprobs = gather_logprobs(raw_logprobs, token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
