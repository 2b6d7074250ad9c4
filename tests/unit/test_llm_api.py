"""The offline API (`LLM`) and the `tandem` CLI on the real SmolLM2-135M-Instruct model.

One `LLM` serves the whole module; outputs are short, so every test takes a fraction of a second.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tandem.engine
from tandem import hub
from tandem.cli import app
from tandem.engine import LLM, RequestOutput, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> LLM:
    return LLM(str(smollm2_path), memory_gib=0.25)


@pytest.fixture(scope="module")
def greedy_out(llm: LLM) -> RequestOutput:
    (out,) = llm.generate(PROMPT, GREEDY)
    return out


# --- prompts in, text out ---------------------------------------------------------------


def test_generate_a_string(llm: LLM, greedy_out: RequestOutput) -> None:
    out = greedy_out
    assert out.prompt_token_ids == llm.tokenizer(PROMPT)["input_ids"]
    assert len(out.token_ids) == 12
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "Paris" in out.text
    assert (out.finished, out.finish_reason, out.stop_reason) == (True, "length", None)


def test_generate_a_list_of_strings_keeps_prompt_order(llm: LLM, greedy_out: RequestOutput) -> None:
    prompts = ["Once upon a time", PROMPT, "def fibonacci(n):"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [llm.encode(p) for p in prompts]
    assert outs[1].token_ids == greedy_out.token_ids
    assert outs[0].token_ids == llm.generate(prompts[0], GREEDY)[0].token_ids
    assert len({o.request_id for o in outs}) == 3


def test_generate_token_ids(llm: LLM, greedy_out: RequestOutput) -> None:
    ids = llm.encode(PROMPT)
    (single,) = llm.generate(ids, GREEDY)
    assert single.token_ids == greedy_out.token_ids
    batch = llm.generate([ids, ids[:3]], GREEDY)
    assert [o.prompt_token_ids for o in batch] == [ids, ids[:3]]
    assert batch[0].token_ids == greedy_out.token_ids


def test_chat(llm: LLM) -> None:
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    (out,) = llm.chat(conv, params)
    ids = llm.apply_chat_template(conv)
    assert out.prompt_token_ids == ids
    template = llm.tokenizer.decode(ids)
    assert template.count("<|im_start|>") == 3  # system, user, assistant
    assert template.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.text
    other = [{"role": "user", "content": "Name a color."}]
    both = llm.chat([conv, other], params)
    assert [o.prompt_token_ids for o in both] == [ids, llm.apply_chat_template(other)]
    assert both[0].token_ids == out.token_ids


def test_chat_ends_at_end_of_turn(llm: LLM) -> None:
    conv = [{"role": "user", "content": "Reply with one word: what color is the sky?"}]
    (out,) = llm.chat(conv, SamplingParams(max_tokens=32, temperature=0.0))
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (out.finish_reason, out.stop_reason) == ("stop", eos)
    assert out.token_ids[-1] == eos  # in the token ids, not in the text
    assert "<|im_end|>" not in out.text and out.text.strip()


# --- streaming --------------------------------------------------------------------------


def test_stream_deltas_add_up_to_the_final_text(llm: LLM, greedy_out: RequestOutput) -> None:
    outs = list(llm.stream(PROMPT, GREEDY))
    *running, last = outs
    assert all(not o.finished and o.delta for o in running)
    assert "".join(o.delta for o in outs) == last.text == greedy_out.text
    # Each yield is a snapshot: earlier ones do not grow with later steps.
    assert [len(o.token_ids) for o in outs] == sorted({len(o.token_ids) for o in outs})
    assert last.token_ids == greedy_out.token_ids
    assert (last.finished, last.finish_reason) == (True, "length")
    m = last.metrics
    assert m is not None
    assert (m.n_prompt, m.n_out, m.num_preemptions) == (len(last.prompt_token_ids), 12, 0)
    assert m.ttft is not None and m.tpot is not None and m.e2e is not None
    assert 0 < m.ttft <= m.e2e and m.tpot > 0
    assert m.e2e == pytest.approx(m.ttft + m.tpot * (m.n_out - 1))


def test_closing_a_stream_early_aborts_its_request(llm: LLM) -> None:
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=200, temperature=0.0))
    first = next(stream)
    assert not first.finished and llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished()


# --- how a request ends -----------------------------------------------------------------


def test_stop_string(llm: LLM, greedy_out: RequestOutput) -> None:
    # " Paris.\n\nThe answer is: ..." - stop inside the greedy text, across a token boundary.
    text = greedy_out.text
    stop = "s.\n"
    assert stop in text
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=["answer", stop])
    (out,) = llm.generate(PROMPT, params)
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < 12
    assert out.token_ids == greedy_out.token_ids[: len(out.token_ids)]


def test_stop_string_in_the_last_allowed_token(llm: LLM, greedy_out: RequestOutput) -> None:
    """The stop string completes exactly at max_tokens: still a "stop", not a "length"."""
    last_piece = llm.tokenizer.decode(greedy_out.token_ids[-1:])
    stop = last_piece.strip()
    assert stop and greedy_out.text.count(stop) == 1
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, stop=stop))
    assert out.text == greedy_out.text[: greedy_out.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stream_holds_back_a_possible_stop_string(llm: LLM, greedy_out: RequestOutput) -> None:
    stop = "s.\n"
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=stop)
    outs = list(llm.stream(PROMPT, params))
    assert "".join(o.delta for o in outs) == outs[-1].text == " Pari"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.metrics is not None and out.metrics.n_out == 3


# --- logprobs and seeds -----------------------------------------------------------------


def test_logprobs(llm: LLM, greedy_out: RequestOutput) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
    (out,) = llm.generate(PROMPT, params)
    assert out.token_ids == greedy_out.token_ids[:6]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == 5
        assert len(set(lp.top_token_ids)) == 5
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        # Greedy picks the most likely token of the raw distribution.
        assert (lp.rank, lp.top_token_ids[0], lp.top_logprobs[0]) == (1, token, lp.logprob)
        assert math.log(sum(math.exp(x) for x in lp.top_logprobs)) < 1e-6  # a distribution
    # Prefill computes the same distribution the decode step did: re-run each prefix.
    prompt = llm.encode(PROMPT)
    for k in (0, 3, 5):
        (again,) = llm.generate([*prompt, *out.token_ids[:k]], params)
        first, expected = again.logprobs[0], out.logprobs[k]
        assert first.top_token_ids == expected.top_token_ids
        assert first.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)


def test_logprobs_zero_gives_only_the_sampled_token(llm: LLM) -> None:
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=3, logprobs=0, seed=1))
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert (lp.token_id, lp.top_token_ids, lp.top_logprobs) == (token, (), ())
        assert lp.logprob <= 0 and lp.rank >= 1


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    (a,) = llm.generate(PROMPT, seeded)
    (b,) = llm.generate(PROMPT, seeded)
    assert a.token_ids == b.token_ids
    # The same request among others, in another position, with other seeds and settings.
    others = SamplingParams(max_tokens=16, temperature=0.7, seed=7)
    batch = llm.generate(
        ["Once upon a time", PROMPT, PROMPT, "def f(x):"],
        [others, SamplingParams(max_tokens=9, temperature=1.2), seeded, GREEDY],
    )
    assert batch[2].token_ids == a.token_ids
    (c,) = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=9))
    assert c.token_ids != a.token_ids


def test_resumed_seeded_request_continues_its_draws(llm: LLM) -> None:
    """A request resumed after k tokens (request migration: they end its prompt, output_offset
    k) draws what the whole request drew from there, penalties over its output included."""
    seeded = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, presence_penalty=0.5
    )
    (whole,) = llm.generate(PROMPT, seeded)
    prompt = llm.encode(PROMPT)
    k = 5
    resumed = replace(seeded, max_tokens=12 - k, output_offset=k)
    (rest,) = llm.generate([*prompt, *whole.token_ids[:k]], resumed)
    assert [*whole.token_ids[:k], *rest.token_ids] == whole.token_ids
    # without the offset the draws restart at position 0: another continuation
    (restarted,) = llm.generate([*prompt, *whole.token_ids[:k]], replace(resumed, output_offset=0))
    assert restarted.token_ids != rest.token_ids


# --- the CLI ----------------------------------------------------------------------------


@pytest.fixture
def cli(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> tuple[CliRunner, list[dict[str, Any]]]:
    """`tandem` with `LLM(...)` answered by the module's engine (no second model load); the
    constructor arguments are recorded."""
    calls: list[dict[str, Any]] = []

    def shared_llm(model: str, **kwargs: Any) -> LLM:
        calls.append({"model": model, **kwargs})
        return llm

    monkeypatch.setattr(tandem.engine, "LLM", shared_llm)
    return CliRunner(env={"COLUMNS": "200"}), calls


def test_cli_models_list(smollm2_path: Path) -> None:
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["models", "list"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output
    assert hub.CATALOGUE["smollm2-135m"].requirement in result.output
    assert smollm2_path.name in result.output  # the pulled file is listed as local


def test_cli_generate(llm: LLM, cli: tuple[CliRunner, list[dict[str, Any]]]) -> None:
    runner, calls = cli
    result = runner.invoke(app, ["generate", "Hello", "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert calls == [
        {
            "model": "smollm2-135m",
            "dtype": "float32",
            "device": "cpu",
            "speculative": None,
            "quantization": None,
            "quant_group_size": 32,
            "kernel_routes": "auto",
            "kv_cache_dtype": "auto",
            "attention_backend": "auto",
            "cuda_graphs": True,
            "tensor_parallel_size": 1,
        }
    ]
    (expected,) = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0))
    assert result.output.startswith(expected.text + "\n")
    metrics = result.output.splitlines()[-1]
    n_prompt = len(llm.encode("Hello"))
    assert re.fullmatch(
        rf"{n_prompt} prompt \+ 8 output tokens, TTFT \d+ ms, TPOT [\d.]+ ms, finish=length",
        metrics,
    ), metrics


def test_cli_generate_chat(llm: LLM, cli: tuple[CliRunner, list[dict[str, Any]]]) -> None:
    runner, _ = cli
    result = runner.invoke(app, ["generate", "--chat", "What is the capital of France?"])
    assert result.exit_code == 0, result.output
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    (expected,) = llm.chat(conv, SamplingParams(max_tokens=64, temperature=0.0))
    assert result.output.startswith(expected.text + "\n")
    n_prompt = len(llm.apply_chat_template(conv))
    assert f"{n_prompt} prompt + {len(expected.token_ids)} output tokens" in result.output
    assert f"finish={expected.finish_reason}" in result.output


def test_cli_generate_rejects_bad_sampling_params(
    cli: tuple[CliRunner, list[dict[str, Any]]],
) -> None:
    runner, _ = cli
    result = runner.invoke(app, ["generate", "Hello", "--max-tokens", "0"])
    assert result.exit_code == 2
    assert "max_tokens must be >= 1" in result.output


def test_cli_generate_takes_any_proposer_as_method_and_argument(
    cli: tuple[CliRunner, list[dict[str, Any]]],
) -> None:
    runner, calls = cli
    args = ["generate", "Hello", "--max-tokens", "2", "--spec", "eagle:/heads"]
    result = runner.invoke(app, [*args, "--no-spec-cost-aware"])
    assert result.exit_code == 0, result.output
    assert calls[-1]["speculative"] == {
        "method": "eagle",
        "path": "/heads",
        "num_speculative_tokens": 5,
        "cost_aware": False,
    }
    for spec, message in (("eagle", "eagle:PATH"), ("beam", "unknown"), ("layerskip:x", "N")):
        result = runner.invoke(app, ["generate", "Hello", "--spec", spec])
        assert result.exit_code == 2 and "--spec" in result.output and message in result.output


class _Launched(Exception):
    """Raised by the recording cluster doubles below in place of starting anything."""


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Test doubles of the Ray and the local cluster that record their keyword arguments (by
    kind: "ray", "local") and raise `_Launched` at start."""
    import tandem.cluster.local_cluster
    import tandem.cluster.ray_cluster

    launched: dict[str, Any] = {}

    def recorder(kind: str) -> type:
        class Recording:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                launched[kind] = kwargs

            def start(self) -> None:
                raise _Launched

            def stop(self) -> None:  # a start that failed still stops what it began
                launched[f"{kind} stopped"] = True

        return Recording

    monkeypatch.setattr(tandem.cluster.ray_cluster, "RayCluster", recorder("ray"))
    monkeypatch.setattr(tandem.cluster.local_cluster, "LocalCluster", recorder("local"))
    return launched


def test_cli_serve_passes_the_speculative_switches_to_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tandem serve --spec ... --no-spec-cost-aware` reaches the decode workers on both launch
    paths: Ray pools get the engine's dict, local processes get the worker's flags."""
    launched = _record_launches(monkeypatch)
    runner = CliRunner()
    args = ["serve", "--spec", "ngram", "--no-spec-cost-aware", "--no-demo"]
    assert isinstance(runner.invoke(app, args).exception, _Launched)
    assert launched["ray"]["decode_engine"]["speculative"]["cost_aware"] is False
    assert launched["ray stopped"]
    assert isinstance(runner.invoke(app, [*args, "--no-ray"]).exception, _Launched)
    flags = launched["local"]["worker_args"]
    assert flags[flags.index("--spec") + 1] == "ngram" and "--no-spec-cost-aware" in flags
    runner.invoke(app, ["serve", "--spec", "ngram", "--no-ray", "--no-demo"])
    assert "--no-spec-cost-aware" not in launched["local"]["worker_args"]


def test_cli_serve_on_ray_takes_each_pools_tp_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prefill-tp/--decode-tp` on Ray: a bundle per rank in each pool's workers; a TP size
    above the GPUs a worker has is refused naming both, before anything starts."""
    launched = _record_launches(monkeypatch)
    runner = CliRunner()
    args = ["serve", "--prefill-tp", "2", "--decode-tp", "1", "--no-demo"]
    assert isinstance(runner.invoke(app, args).exception, _Launched)
    prefill, decode = launched["ray"]["prefill_pool"], launched["ray"]["decode_pool"]
    assert (prefill.tensor_parallel_size, len(prefill.bundles())) == (2, 2)
    assert prefill.placement_strategy == "STRICT_PACK"
    assert (decode.tensor_parallel_size, len(decode.bundles())) == (1, 1)
    launched.clear()
    result = runner.invoke(app, [*args, "--gpus-per-worker", "1"])
    assert result.exit_code == 2 and launched == {}
    words = " ".join(result.output.replace("│", " ").split())  # the error box wraps lines
    assert "--prefill-tp/--gpus-per-worker" in words
    assert "tensor_parallel_size=2 needs 2 GPUs per worker, one per rank; gpus_per_worker=1" in (
        words
    )
