"""SamplingParams validation: every error names its field; prompt checks name id and position."""

import math

import pytest

from tandem.sampling_params import SamplingParams, validate_prompt_token_ids

VOCAB = 100


def test_defaults_are_valid_and_vllm_shaped() -> None:
    params = SamplingParams()
    params.validate(VOCAB)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    assert not params.greedy
    assert params.stop_strings == ()


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_zero_temperature_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy


def test_stop_accepts_one_string_or_several() -> None:
    assert SamplingParams(stop="\n").stop_strings == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")


@pytest.mark.parametrize("top_k", [-1, 0, 1, 5, VOCAB, 10 * VOCAB])
@pytest.mark.parametrize("logprobs", [None, 0, 20])
def test_boundary_values_are_valid(top_k: int, logprobs: int | None) -> None:
    SamplingParams(
        temperature=0.0,
        top_k=top_k,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=1e-3,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        stop_token_ids=[0, VOCAB - 1],
        max_tokens=3,
        min_tokens=3,
        logprobs=logprobs,
        seed=2**64 - 1,
    ).validate(VOCAB)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("temperature", -0.5, "temperature must be >= 0 and finite, got -0.5"),
        ("temperature", math.nan, "temperature must be >= 0 and finite, got nan"),
        ("temperature", math.inf, "temperature must be >= 0 and finite, got inf"),
        ("top_k", -2, "top_k must be -1, 0 or in [1, 2147483647], got -2"),
        ("top_k", 2**31, f"top_k must be -1, 0 or in [1, 2147483647], got {2**31}"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_p", math.nan, "top_p must be in (0, 1], got nan"),
        ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
        ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0 and finite, got 0.0"),
        ("repetition_penalty", math.inf, "repetition_penalty must be > 0 and finite, got inf"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -2.1, "frequency_penalty must be in [-2, 2], got -2.1"),
        ("frequency_penalty", math.nan, "frequency_penalty must be in [-2, 2], got nan"),
        ("seed", 2**64, f"seed must be in [-2**63, 2**64), got {2**64}"),
        ("stop", ["ok", ""], "stop must not contain empty strings"),
        ("stop_token_ids", [3, VOCAB], f"stop_token_ids must be in [0, {VOCAB}), got {VOCAB}"),
        ("stop_token_ids", [-1], f"stop_token_ids must be in [0, {VOCAB}), got -1"),
        ("min_tokens", -1, "min_tokens must be in [0, max_tokens=16], got -1"),
        ("min_tokens", 17, "min_tokens must be in [0, max_tokens=16], got 17"),
        ("logprobs", -1, "logprobs must be in [0, 20], got -1"),
        ("logprobs", 21, "logprobs must be in [0, 20], got 21"),
        ("output_offset", -1, "output_offset must be >= 0, got -1"),
    ],
)
def test_each_error_names_its_field_and_range(field: str, value: object, message: str) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError) as excinfo:
        params.validate(VOCAB)
    assert str(excinfo.value) == message
    assert str(excinfo.value).startswith(field)


def test_valid_prompt_passes() -> None:
    validate_prompt_token_ids([0, 5, VOCAB - 1], VOCAB, max_model_len=10, max_tokens=7)


@pytest.mark.parametrize(
    ("token_ids", "max_model_len", "max_tokens", "message"),
    [
        ([], 10, 1, "prompt must contain at least one token"),
        ([1, 2, VOCAB, 3], 10, 1, f"prompt token id {VOCAB} at position 2 is outside [0, {VOCAB})"),
        ([-4], 10, 1, f"prompt token id -4 at position 0 is outside [0, {VOCAB})"),
        ([1] * 10, 10, 1, "prompt has 10 tokens; the context holds max_model_len=10"),
        (
            [1] * 8,
            10,
            3,
            "prompt has 8 tokens and max_tokens=3; together they exceed max_model_len=10",
        ),
    ],
)
def test_invalid_prompts(
    token_ids: list[int], max_model_len: int, max_tokens: int, message: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        validate_prompt_token_ids(token_ids, VOCAB, max_model_len, max_tokens)
    assert str(excinfo.value) == message
