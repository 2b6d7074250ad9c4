"""The relay from a decode worker to the client: D's token chunks become `Delta`s through an
incremental detokenizer (which also finds stop strings); the last one carries the usage and the
request's timings (TTFT, TPOT, end to end, and what the router noted on the way)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.detokenizer import IncrementalDetokenizer
from tandem.messages import logprobs_from_proto
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer
from tandem.v1 import worker_pb2 as wpb


@dataclass
class Delta:
    """One message to the client; the last one has `finish_reason` and `timings`."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: int | str | None = None
    timings: dict[str, Any] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first tokens, when asked for


class Relay:
    """One request's relay (one choice's, when it has n). `timings` is shared: the dispatch and
    the prefill write to it too (and the other choices' relays of one route); each final
    message carries a copy with the relay's own figures."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float,
        timings: dict[str, Any],
    ) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            params.stop_strings,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        self.prompt_tokens = len(prompt_token_ids)
        self.arrival = arrival  # monotonic
        self.timings = timings
        self.output_token_ids: list[int] = []  # all sent so far: a migrated request resumes after
        self.first_token_time: float | None = None
        self.finished = False  # the final message is out

    def delta(self, chunk: wpb.TokenChunk) -> Delta:
        """The client's message for one chunk: the final one if the chunk or a stop string
        ends the request."""
        if chunk.transfer_s:
            self.timings["transfer_s"] = chunk.transfer_s
        tokens = list(chunk.token_ids)
        self.detok.add(tokens)
        self.output_token_ids += tokens
        if self.first_token_time is None and tokens:
            self.first_token_time = time.monotonic()
        reason, stop_reason = self._finish(chunk.finish_reason or None, tokens)
        text = self.detok.pop_text(reason is not None)
        logprobs = [logprobs_from_proto(lp) for lp in chunk.logprobs]
        prompt_logprobs = [logprobs_from_proto(lp) for lp in chunk.prompt_logprobs] or None
        if reason is None:
            return Delta(tokens, text, logprobs, prompt_logprobs=prompt_logprobs)
        spec = {"draft_tokens": chunk.draft_tokens, "accepted_tokens": chunk.accepted_tokens}
        final = self.final(tokens, reason, text, logprobs, stop_reason, spec)
        final.prompt_logprobs = prompt_logprobs
        return final

    def _finish(self, reason: str | None, tokens: list[int]) -> tuple[str | None, int | str | None]:
        """Why the request ends here (None: it goes on), and the stop string or stop token."""
        if self.detok.stop_string is not None:
            return "stop", self.detok.stop_string
        if reason == "stop" and tokens:
            return reason, tokens[-1]
        return reason, None

    def final(
        self,
        tokens: list[int],
        reason: str,
        text: str = "",
        logprobs: list[TokenLogprobs] | None = None,
        stop_reason: int | str | None = None,
        spec: dict[str, int] | None = None,
    ) -> Delta:
        """The last message: usage, and the timings completed with TTFT, end to end, TPOT and
        the speculative decoding totals (`spec`)."""
        now = time.monotonic()
        ttft = (self.first_token_time or now) - self.arrival
        completion = len(self.output_token_ids)
        self.finished = True
        timings = {
            **self.timings,
            **(spec or {}),
            "ttft_s": ttft,
            "e2e_s": now - self.arrival,
            "tpot_s": (now - self.arrival - ttft) / (completion - 1) if completion > 1 else 0.0,
        }
        return Delta(
            tokens,
            text,
            logprobs or [],
            reason,
            self.prompt_tokens,
            completion,
            stop_reason,
            timings,
        )
