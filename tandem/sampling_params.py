"""Per-request sampling parameters (vLLM/OpenAI semantics) and request validation.

The router validates every request with `SamplingParams.validate` and
`validate_prompt_token_ids` before it reaches an engine; each error names the field and its range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tandem.structured import StructuredOutput

# A temperature below this samples greedily: dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
MAX_N = 128  # choices per request, as OpenAI allows
MAX_TOP_K = 2**31 - 1  # the wire's int32; any top_k from the vocabulary's size up keeps every token
CHOICE_SUFFIX = "/c"  # + the index: the request id of a request's choice i > 0
_INT64 = 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; immutable, shared by router, workers and engine."""

    max_tokens: int | None = 16  # None: the rest of the model's context (`resolved_for`)
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output
    presence_penalty: float = 0.0  # OpenAI semantics, over output only
    frequency_penalty: float = 0.0  # OpenAI semantics, over output only
    seed: int | None = None
    stop: str | Sequence[str] = ()  # one stop string or several; read through `stop_strings`
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens exist
    logprobs: int | None = None  # top-n logprobs per token; 0 = only the sampled token's
    # vLLM's prompt_logprobs: top-n logprobs of every prompt token after the first, in the raw
    # model distribution; such a prompt is computed whole (no prefix-cache hit: a cached
    # position has no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the text keeps the stop string it ends on
    # Output tokens generated before this request was resumed elsewhere (request migration):
    # the last `output_offset` prompt tokens. Seeded draws continue at that output position
    # and the presence/frequency penalties count them as output.
    output_offset: int = 0
    # Constrained decoding (JSON schema, regex, choice, grammar): every token, the first one
    # sampled on a prefill worker included, is masked to what the grammar allows next.
    structured_output: StructuredOutput | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before the penalties.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Choices (OpenAI's n): sequences sampled from one prompt, computed once; choice i is
    # sampled as if alone with `choice(i)`'s parameters (its seed is seed + i).
    n: int = 1

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` as a request of its own (n = 1, seed + index)."""
        return replace(self, n=1, seed=derived_seed(self.seed, index))

    def resolved_for(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """These parameters with a number for max_tokens: None becomes the room the context
        leaves after the prompt (at least 1, so that a prompt filling it fails validation as
        too long rather than max_tokens as too small)."""
        if self.max_tokens is not None:
            return self
        return replace(self, max_tokens=max(max_model_len - prompt_len, 1))

    @property
    def output_budget(self) -> int:
        """max_tokens, once `resolved_for` has given it a number (the router and the engine do
        before anything reads it)."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is not resolved against the model's context yet")
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first field outside its allowed range."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop must not contain empty strings")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {token_id}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {self.output_offset}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"logit_bias token ids must be in [0, {vocab_size}), got {token_id}"
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}"
                )
        if self.structured_output is not None:
            # The grammar decides where the output ends: EOS once it is complete, and only then.
            if self.min_tokens:
                raise ValueError("min_tokens must be 0 with a structured output")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a structured output")


def derived_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index` wrapped into int64 (the wire type), or None."""
    if seed is None or index == 0:
        return seed
    return int64_seed(seed + index)


def int64_seed(seed: int) -> int:
    """`seed` as the wire's int64: the same draws, which read a seed modulo 2**64 (a seed in
    [2**63, 2**64) travels as seed - 2**64)."""
    return (seed + _INT64 // 2) % _INT64 - _INT64 // 2


def choice_request_id(request_id: str, index: int) -> str:
    """The request id of choice `index` of `request_id`: its own for choice 0."""
    return f"{request_id}{CHOICE_SUFFIX}{index}" if index else request_id


def validate_prompt_token_ids(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, max_tokens: int
) -> None:
    """Raise ValueError unless the prompt is non-empty, in-vocabulary and leaves room to generate
    `max_tokens` tokens within `max_model_len`."""
    if not token_ids:
        raise ValueError("prompt must contain at least one token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        position, token_id = next(
            (i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size
        )
        raise ValueError(
            f"prompt token id {token_id} at position {position} is outside [0, {vocab_size})"
        )
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; the context holds max_model_len={max_model_len}"
        )
    if len(token_ids) + max_tokens > max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens and max_tokens={max_tokens}; together they exceed "
            f"max_model_len={max_model_len}"
        )
