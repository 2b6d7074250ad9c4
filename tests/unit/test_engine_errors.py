"""Bad input is refused with a ValueError naming the field and its allowed range, before any KV
is allocated: the cache and the scheduler look exactly as they did before the call."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm import LLM
from tandem.sampling_params import SamplingParams

VOCAB = 256
MAX_MODEL_LEN = 64
OK_PROMPT = [5, 6, 7, 8]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> EngineCore:
    config = EngineConfig.create(
        str(tiny_llama_path), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN
    )
    return EngineCore(config)


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN)


def assert_untouched(engine: EngineCore) -> None:
    """No request queued, no block taken, and a step finds nothing to do."""
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.parked
    assert not engine.has_unfinished()
    assert engine.step() == []


BAD_REQUESTS = {
    "prompt-fills-context": (
        list(range(MAX_MODEL_LEN)),
        SamplingParams(),
        r"64 tokens; the context holds max_model_len=64",
    ),
    "prompt-plus-max-tokens-exceed-context": (
        list(range(60)),
        SamplingParams(max_tokens=5),
        r"max_tokens=5; together they exceed max_model_len=64",
    ),
    "empty-prompt": ([], SamplingParams(), r"at least one token"),
    "max-tokens-zero": (OK_PROMPT, SamplingParams(max_tokens=0), r"max_tokens must be >= 1"),
    "max-tokens-negative": (OK_PROMPT, SamplingParams(max_tokens=-3), r"max_tokens must be >= 1"),
    "temperature-negative": (
        OK_PROMPT,
        SamplingParams(temperature=-0.1),
        r"temperature must be >= 0 and finite",
    ),
    "temperature-nan": (
        OK_PROMPT,
        SamplingParams(temperature=math.nan),
        r"temperature must be >= 0 and finite, got nan",
    ),
    "temperature-inf": (
        OK_PROMPT,
        SamplingParams(temperature=math.inf),
        r"temperature must be >= 0 and finite",
    ),
    "top-p-zero": (OK_PROMPT, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top-p-above-one": (OK_PROMPT, SamplingParams(top_p=1.01), r"top_p must be in \(0, 1\]"),
    "top-p-negative": (OK_PROMPT, SamplingParams(top_p=-0.5), r"top_p must be in \(0, 1\]"),
    "top-p-nan": (OK_PROMPT, SamplingParams(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    "token-id-negative": (
        [5, -1, 7],
        SamplingParams(),
        r"prompt token id -1 at position 1 is outside \[0, 256\)",
    ),
    "token-id-past-vocab": (
        [5, 6, VOCAB],
        SamplingParams(),
        r"prompt token id 256 at position 2 is outside \[0, 256\)",
    ),
    "stop-token-id-past-vocab": (
        OK_PROMPT,
        SamplingParams(stop_token_ids=[VOCAB + 1]),
        r"stop_token_ids must be in \[0, 256\)",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_before_any_kv(engine: EngineCore, name: str) -> None:
    prompt, params, message = BAD_REQUESTS[name]
    with pytest.raises(ValueError, match=message):
        engine.add_request(f"bad-{name}", prompt, params)
    assert_untouched(engine)


def test_request_larger_than_the_whole_cache_is_refused(tiny_llama_path: Path) -> None:
    config = EngineConfig.create(str(tiny_llama_path), num_blocks=4, block_size=4)
    small = EngineCore(config)
    with pytest.raises(ValueError, match=r"need 5 KV blocks; the cache has 4"):
        small.add_request("r", list(range(10)), SamplingParams(max_tokens=10))
    assert_untouched(small)


def test_duplicate_request_id_is_refused(engine: EngineCore) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = engine.add_request("dup", OK_PROMPT, params)
    with pytest.raises(ValueError, match=r"request_id 'dup' is already in use"):
        engine.add_request("dup", [9, 9], params)
    assert list(engine.scheduler.requests) == ["dup"]
    assert list(engine.scheduler.waiting) == [first]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    while engine.has_unfinished():
        engine.step()
    assert first.prompt_token_ids == OK_PROMPT and first.status.finished
    assert_untouched(engine)
    engine.add_request("dup", OK_PROMPT, params)  # a finished request's id is free again
    engine.abort("dup")
    assert_untouched(engine)


@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/model/dir", "weights.gguf"])
def test_unknown_model_lists_the_accepted_forms(name: str, tmp_path: Path) -> None:
    accepted = (
        r"catalogue name \(smollm2-135m\), a Hugging Face directory with config\.json, "
        r"or a \.gguf file"
    )
    with pytest.raises(ValueError, match=accepted):
        EngineCore(EngineConfig.create(name))
    with pytest.raises(ValueError, match=accepted):
        LLM(name)
    with pytest.raises(ValueError, match=accepted):
        LLM(str(tmp_path))  # a directory without config.json


def test_unknown_engine_option_is_named(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown engine option 'max_num_seq'"):
        LLM(str(tiny_llama_path), max_num_seq=4)


def test_generate_with_one_bad_prompt_queues_nothing(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match=r"prompt token id 300 at position 0"):
        llm.generate([[1, 2, 3], "hello", [300, 4], [5, 6]], params)
    assert_untouched(llm.engine)
    too_long = "x" * MAX_MODEL_LEN
    with pytest.raises(ValueError, match=r"max_model_len=64"):
        llm.generate(["hello", too_long], params)
    assert_untouched(llm.engine)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        llm.generate(["hello", "world"], [params, SamplingParams(top_p=2.0)])
    assert_untouched(llm.engine)
    with pytest.raises(ValueError, match=r"got 1 SamplingParams for 2 prompts"):
        llm.generate(["hello", "world"], [params])
    assert_untouched(llm.engine)

    # The engine still serves: the next batch runs alone, nothing of the failed ones mixed in.
    outputs = llm.generate(["hello", [5, 6]], params)
    assert [o.prompt_token_ids for o in outputs] == [llm.encode("hello"), [5, 6]]
    assert all(o.finished and len(o.token_ids) <= 3 for o in outputs)
    assert_untouched(llm.engine)


def test_without_max_tokens_a_request_runs_to_what_the_cache_holds(tiny_llama_path: Path) -> None:
    config = EngineConfig.create(str(tiny_llama_path), num_blocks=4, block_size=4)
    small = EngineCore(config)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    req = small.add_request("r", list(range(10)), params)
    while small.has_unfinished():
        small.step()
    assert small.max_sequence_len == 16  # 4 blocks of 4: below the model's context
    assert len(req.output_token_ids) == 6 and req.status.name == "FINISHED_LENGTH"
    assert_untouched(small)
