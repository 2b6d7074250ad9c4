"""tandem.messages: sampling options between proto and SamplingParams, unset fields included."""

from __future__ import annotations

from tandem.engine.sampler import seed_for_position
from tandem.messages import sampling_from_proto, sampling_to_proto
from tandem.sampling_params import SamplingParams
from tandem.structured import StructuredOutput
from tandem.v1 import api_pb2


def test_an_unset_max_tokens_is_the_rest_of_the_context_both_ways() -> None:
    assert sampling_from_proto(api_pb2.SamplingOptions()).max_tokens is None
    assert not sampling_to_proto(SamplingParams(max_tokens=None)).HasField("max_tokens")
    assert sampling_from_proto(sampling_to_proto(SamplingParams(max_tokens=7))).max_tokens == 7


def test_resolved_for_fills_only_an_unset_max_tokens() -> None:
    assert SamplingParams(max_tokens=None).resolved_for(10, 64).max_tokens == 54
    assert SamplingParams(max_tokens=5).resolved_for(10, 64).max_tokens == 5
    assert SamplingParams(max_tokens=None).resolved_for(64, 64).max_tokens == 1  # fails later


def test_every_structured_output_kind_round_trips() -> None:
    kinds = [
        StructuredOutput.json_schema({"type": "object", "properties": {"b": {}, "a": {}}}, "x"),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"\d+"),
        StructuredOutput.choice(["yes", 'no "way"'], "x"),
        StructuredOutput("grammar", 'start: "a"'),
    ]
    for so in kinds:
        back = sampling_from_proto(sampling_to_proto(SamplingParams(structured_output=so)))
        assert back.structured_output == so
    assert kinds[0].spec == '{"type":"object","properties":{"b":{},"a":{}}}'  # order kept
    assert sampling_from_proto(api_pb2.SamplingOptions()).structured_output is None


def test_logit_bias_round_trips() -> None:
    params = SamplingParams(logit_bias=((3, -100.0), (17, 2.5)))
    assert sampling_from_proto(sampling_to_proto(params)).logit_bias == params.logit_bias


def test_a_seed_of_64_bits_travels_as_int64_with_the_same_draws() -> None:
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)):
        sent = sampling_from_proto(sampling_to_proto(SamplingParams(seed=seed))).seed
        assert sent is not None and -(2**63) <= sent < 2**63
        assert all(seed_for_position(sent, p) == seed_for_position(seed, p) for p in range(3))
