"""Offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

Wraps an `EngineCore` with the tokenizer: prompts in (text, token ids or chat conversations),
detokenized outputs with stop strings and per-request metrics out, all at once or streamed. A
prompt with `SamplingParams(n=k)` gives k outputs (`index` 0 .. k-1, in order), computed from one
prefill of the prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from tandem.config import DEFAULT_MODEL, EngineConfig
from tandem.detokenizer import IncrementalDetokenizer
from tandem.engine.engine_core import EngineCore, RequestDelta
from tandem.engine.models.loader import load_tokenizer
from tandem.engine.request import Request, RequestStatus
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Conversation = Sequence[dict[str, str]]


@dataclass
class RequestMetrics:
    n_prompt: int
    n_out: int
    ttft: float | None  # first token time - arrival, seconds
    tpot: float | None  # (last - first token time) / (n_out - 1), only when n_out > 1
    e2e: float | None  # last token time - arrival
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    index: int = 0  # which of the prompt's n choices
    text: str = ""  # all text so far (streaming: see `delta`)
    delta: str = ""  # text added since the previous streamed output
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: prompt tokens 1, 2, ... (the first has none)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    metrics: RequestMetrics | None = None

    def snapshot(self) -> RequestOutput:
        """A copy that later steps leave alone (what `LLM.stream` hands out)."""
        return replace(
            self,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            prompt_logprobs=list(self.prompt_logprobs),
        )


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        **options: Any,
    ) -> None:
        config = EngineConfig.create(model, dtype=dtype, device=device, **options)
        self.engine = EngineCore(config)
        self.tokenizer = load_tokenizer(self.engine.model_path)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (also done at exit)."""
        self.engine.close()

    # -- prompts ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def apply_chat_template(self, conversation: Conversation) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=False
        )
        # The template already holds the special tokens.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (a prompt's n choices in
        index order)."""
        batch = (
            [cast(Prompt, prompts)] if _is_single(prompts) else list(cast(list[Prompt], prompts))
        )
        return self._run([self.encode(p) for p in batch], params)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        convs = [conversations] if _is_conversation(conversations) else list(conversations)
        return self._run([self.apply_chat_template(c) for c in convs], params)  # type: ignore[arg-type]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a snapshot of an output (of a choice, by `index`, when n > 1) after every step
        that added text to it or finished it. Closing the iterator early aborts the request, so
        it does not keep running inside the engine."""
        states = self._add([self.encode(prompt)], params)
        try:
            while not all(s.output.finished for s in states.values()):
                for state in self._step(states):
                    if state.output.delta or state.output.finished:
                        yield state.output.snapshot()
        finally:
            for state in states.values():
                if not state.output.finished:
                    self.engine.abort(state.request.request_id)

    def _run(
        self,
        token_ids: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        states = self._add(token_ids, params)
        while self.engine.has_unfinished():
            self._step(states)
        return [s.output for s in states.values()]

    def _add(
        self,
        token_ids: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> dict[str, _State]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_ids)} prompts")
        states: dict[str, _State] = {}
        try:
            for ids, p in zip(token_ids, params, strict=True):
                req = self.engine.add_request(str(next(self._ids)), ids, p)
                for choice in (req, *req.forks):
                    detok = IncrementalDetokenizer(
                        self.tokenizer,
                        ids,
                        p.stop_strings,
                        p.skip_special_tokens,
                        p.include_stop_str_in_output,
                    )
                    rid = choice.request_id
                    states[rid] = _State(choice, detok, RequestOutput(rid, ids, choice.index))
        except ValueError:
            for rid in states:  # a bad prompt in the batch: nothing of the batch stays queued
                self.engine.abort(rid)
            raise
        return states

    def _step(self, states: dict[str, _State]) -> list[_State]:
        """One engine step; the states it advanced."""
        advanced = []
        for delta in self.engine.step():
            state = states.get(delta.request.request_id)
            if state is not None:
                state.advance(delta, self.engine)
                advanced.append(state)
        return advanced


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
    )


def _is_conversation(conv: Any) -> bool:
    return isinstance(conv, Sequence) and bool(conv) and isinstance(conv[0], dict)


@dataclass
class _State:
    request: Request
    detok: IncrementalDetokenizer
    output: RequestOutput

    def advance(self, delta: RequestDelta, engine: EngineCore) -> None:
        out, req = self.output, self.request
        out.token_ids.extend(delta.new_token_ids)
        out.logprobs.extend(delta.logprobs)
        out.prompt_logprobs.extend(delta.prompt_logprobs)
        visible = [t for t in delta.new_token_ids if not _is_eos_stop(req, t)]
        self.detok.add(visible)
        if self.detok.stop_string is not None and not req.status.finished:
            engine.abort(req.request_id, RequestStatus.FINISHED_STOPPED)
        if self.detok.stop_string is not None:
            req.stop_reason = self.detok.stop_string
        finished = req.status.finished
        out.delta = self.detok.pop_text(finished)
        out.text += out.delta
        if finished:
            out.finished = True
            # A stop string in the last allowed token ends the request by "stop", not "length".
            out.finish_reason = "stop" if self.detok.stop_string is not None else req.status.value
            out.stop_reason = req.stop_reason
            out.metrics = _metrics(req)


def _is_eos_stop(req: Request, token: int) -> bool:
    """The stop token that ended the request is not part of its text."""
    return req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == token


def _metrics(req: Request) -> RequestMetrics:
    m = req.metrics
    n_out = len(req.output_token_ids)
    ttft = e2e = tpot = None
    if m.first_token_time is not None and m.last_token_time is not None:
        ttft = m.first_token_time - m.arrival_time
        e2e = m.last_token_time - m.arrival_time
        if n_out > 1:
            tpot = (m.last_token_time - m.first_token_time) / (n_out - 1)
    return RequestMetrics(
        req.num_prompt_tokens,
        n_out,
        ttft,
        tpot,
        e2e,
        m.num_preemptions,
        m.num_draft_tokens,
        m.num_accepted_tokens,
    )
