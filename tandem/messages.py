"""Translations between tandem.v1 messages and engine values, shared by the router and workers."""

from __future__ import annotations

import json
from dataclasses import replace

from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams, int64_seed
from tandem.structured import StructuredOutput
from tandem.v1 import api_pb2, worker_pb2

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

_LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")


def sampling_from_proto(msg: api_pb2.SamplingOptions) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; the caller validates the result."""
    kwargs: dict[str, object] = {}
    for name in ("max_tokens", "top_k", "seed", *_LOGPROB_FIELDS, *_FLOAT_FIELDS):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if not msg.HasField("max_tokens"):
        kwargs["max_tokens"] = None  # the rest of the model's context
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        structured_output=structured_from_proto(msg.structured_output),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        **kwargs,  # type: ignore[arg-type]
    )


def structured_from_proto(msg: api_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set; a JSON schema keeps its text as sent (`validate` parses it)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput.choice(list(msg.choice.choices), "structured_output")
    if kind == "json_schema":
        return StructuredOutput.json_schema(msg.json_schema, "structured_output")
    return StructuredOutput(kind, getattr(msg, kind))


def structured_to_proto(so: StructuredOutput) -> api_pb2.StructuredOutput:
    if so.kind == "json_object":
        return api_pb2.StructuredOutput(json_object=True)
    if so.kind == "choice":
        return api_pb2.StructuredOutput(choice=api_pb2.Choices(choices=json.loads(so.spec)))
    msg = api_pb2.StructuredOutput()
    setattr(msg, so.kind, so.spec)  # json_schema, regex or grammar: a string
    return msg


def worker_sampling(request: worker_pb2.WorkerRequest) -> SamplingParams:
    """A worker request's sampling parameters, with the output offset of a resumed request and
    its number of choices."""
    return replace(
        sampling_from_proto(request.sampling),
        output_offset=request.output_offset,
        n=max(request.n, 1),
    )


def sampling_to_proto(params: SamplingParams) -> api_pb2.SamplingOptions:
    msg = api_pb2.SamplingOptions(
        top_k=params.top_k,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
    )
    for name in _FLOAT_FIELDS:
        setattr(msg, name, getattr(params, name))
    if params.max_tokens is not None:  # unset: the rest of the model's context
        msg.max_tokens = params.max_tokens
    if params.seed is not None:
        msg.seed = int64_seed(params.seed)
    for name in _LOGPROB_FIELDS:
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> api_pb2.TokenLogprob:
    return api_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[
            api_pb2.TopLogprobEntry(token_id=t, logprob=p)
            for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ],
    )


def logprobs_from_proto(msg: api_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(
        msg.token_id,
        msg.logprob,
        msg.rank,
        tuple(t.token_id for t in msg.top),
        tuple(t.logprob for t in msg.top),
    )
