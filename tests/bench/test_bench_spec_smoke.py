"""`tandem bench spec`: method parsing, summaries and targets from scripted runs, and the whole
pipeline with `--quick` sizes on the real model (not a measurement)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tandem.bench.spec import Prompt, RunResult, _sample, check_targets, run_spec_bench, summarize
from tandem.bench.spec_config import HF_LOOKUP, NO_SPEC, SpecBenchConfig, parse_method


def test_methods_parse_into_engine_settings() -> None:
    assert parse_method("ngram", 4).speculative == {"method": "ngram", "num_speculative_tokens": 4}
    assert parse_method("layerskip:8", 5).speculative["num_layers"] == 8
    assert parse_method("draft:smollm2-135m", 5).speculative["draft_model"] == "smollm2-135m"
    assert parse_method("eagle:/heads", 5).model_based
    bad_methods = {
        "beam": "unknown speculative method",
        "medusa": "medusa:PATH",
        "ngram:3": "no argument",
    }
    for bad, message in bad_methods.items():
        with pytest.raises(ValueError, match=message):
            parse_method(bad, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_method("ngram", 0)
    with pytest.raises(ValueError, match="categories"):
        SpecBenchConfig(categories=("poetry",))


def test_summary_ratios_acceptance_and_targets() -> None:
    config = SpecBenchConfig(categories=("summarization", "writing"), batch_sizes=(1,))
    counters = {
        "drafts": 10,
        "draft_tokens": 30,
        "accepted": 20,
        "drafted_per_position": [10, 10, 10],
        "accepted_per_position": [9, 7, 4],
        "propose_s": 0.1,
        "verify_s": 1.0,
        "plain_by_cost": 3,
    }
    samples = []
    for category, spec_wall in (("summarization", 0.4), ("writing", 2.0)):
        batch = [Prompt(1, category, [1, 2, 3])]
        base = RunResult(1.0, [[5] * 10], [0.1])
        runs = {
            NO_SPEC: base,
            "ngram": RunResult(spec_wall, [[5] * 9 + [6]], [0.05], counters),
            HF_LOOKUP: RunResult(1.6, [[5] * 10], [None]),
        }
        for side, result in runs.items():
            samples.append(_sample(0, category, 1, 0, side, batch, result, base))
    rows = summarize(samples, config, [NO_SPEC, "ngram"])
    by_key = {(r["scope"], r["side"]): r for r in rows}
    grounded = by_key["input-grounded", "ngram"]
    assert grounded["vs_no_spec"] == pytest.approx(2.5)
    assert grounded["vs_hf_lookup"] == pytest.approx(4.0)
    assert grounded["decode_speedup"] == pytest.approx(2.0)
    assert grounded["same_output"] == 0 and grounded["requests"] == 1
    assert samples[1]["first_difference"] == [9]
    everything = by_key["all", "ngram"]
    assert everything["vs_no_spec"] == pytest.approx(2.0 / 2.4)  # 20 tokens in 2.4 s vs 2.0 s
    acc = everything["acceptance"]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 40 / 20)
    assert acc["per_position"] == pytest.approx([0.9, 0.7, 0.4])
    assert by_key["chat", "ngram"]["vs_no_spec"] == pytest.approx(0.5)
    targets = {t["name"]: t for t in check_targets(rows, config.parsed_methods())}
    assert [t["pass"] for t in targets.values()] == [True, True]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_spec_quick(smollm2_path: Path, tmp_path: Path) -> None:
    config = SpecBenchConfig(
        model=str(smollm2_path),
        methods=("ngram", f"medusa:{tmp_path / 'no-heads'}"),
        categories=("writing", "qa"),  # short prompts: prefill stays out of the test's time
        new_tokens=6,
    ).quick()
    out = tmp_path / "spec.json"
    console = Console(file=io.StringIO(), width=200)
    returned = run_spec_bench(config, out, console)

    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "spec.png").stat().st_size > 0
    assert list(report["skipped"]) == [f"medusa:{tmp_path / 'no-heads'}"]
    assert report["config"]["batch_sizes"] == [1, 4]
    sides = {(s["side"], s["batch_size"]) for s in report["samples"]}
    assert sides == {
        (NO_SPEC, 1),
        (NO_SPEC, 4),
        ("ngram", 1),
        ("ngram", 4),
        ("hf greedy", 1),
        (HF_LOOKUP, 1),
    }
    rows = {(r["scope"], r["batch_size"], r["side"]): r for r in report["summary"]}
    for batch_size in (1, 4):
        row = rows["all", batch_size, "ngram"]
        assert row["tok_s"] > 0 and row["vs_no_spec"] > 0
        assert row["requests"] == 2 * batch_size
        # float32 greedy: speculation never changes the output
        assert row["same_output"] == row["requests"]
        assert row["acceptance"]["draft_tokens"] > 0
    assert rows["all", 1, "ngram"]["vs_hf_lookup"] > 0
    assert {"chat", "other", "writing", "qa"} <= {scope for scope, _, _ in rows}
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "ngram vs no speculation" in text and "batch 1 references" in text
