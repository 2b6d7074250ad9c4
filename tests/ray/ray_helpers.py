"""What the Ray cluster tests share: the offline engine's greedy tokens, one greedy request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.sampling_params import SamplingParams
from tandem.v1 import api_pb2, api_pb2_grpc


def greedy_reference(
    model: Path, engine: dict[str, Any], prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The single-device engine's greedy tokens for `prompts`."""
    core = EngineCore(EngineConfig.create(str(model), **engine))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while core.has_unfinished():
        core.step()
    return [r.output_token_ids for r in reqs]


def generate(stub: api_pb2_grpc.TandemStub, prompt: list[int], max_tokens: int,
             timeout: float = 30.0) -> tuple[list[int], api_pb2.GenerateResponse]:  # fmt: skip
    """A greedy request's tokens and its last message (with the timings)."""
    request = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=prompt),
        sampling=api_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    tokens: list[int] = []
    last = api_pb2.GenerateResponse()
    for msg in stub.Generate(request, timeout=timeout):
        tokens.extend(msg.token_ids)
        last = msg
    return tokens, last
