"""The inference core: paged KV cache, scheduler, runner, sampler, offline API (torch only)."""

from tandem.engine.llm import LLM, RequestOutput
from tandem.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
