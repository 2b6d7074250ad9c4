"""`tandem bench engine` end to end with tiny sizes on the real model: the report is complete.

Not a measurement: 8 new tokens, batch 2, one round, float32 only.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tandem.bench.engine_bench import (
    EngineBenchConfig,
    left_pad,
    load_prompts,
    run_engine_bench,
    select_prompts,
)
from tandem.bench.report import stats


def test_left_pad_and_stats() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    s = stats([3.0, 1.0, 2.0, 10.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (4, 2.5, 1.0, 10.0)


def test_prompt_selection_is_seeded() -> None:
    pool = load_prompts()
    assert {p.category for p in pool}.isdisjoint({"summarization", "rag"})
    first = select_prompts(pool, 16, seed=0)
    assert first == select_prompts(pool, 16, seed=0)
    assert first != select_prompts(pool, 16, seed=1)
    assert select_prompts(pool, 3, seed=0) == first[:3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_engine_smoke(smollm2_path: Path, tmp_path: Path) -> None:
    # Short prompts keep the (unoptimized) prefill out of the test's time.
    pool = load_prompts()
    seed = next(
        s for s in range(1000) if all(len(p.text) < 150 for p in select_prompts(pool, 2, s))
    )
    config = EngineBenchConfig(
        model=str(smollm2_path),
        dtypes=("float32",),
        new_tokens=8,
        batch=2,
        rounds=1,
        prompts_per_round=1,
        kernel_steps=2,
        bandwidth_mib=64,
        seed=seed,
        warmup=False,
    )
    out = tmp_path / "engine.json"
    console = Console(file=io.StringIO(), width=120)
    returned = run_engine_bench(config, out, console)

    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "engine.png").stat().st_size > 0
    assert report["config"]["new_tokens"] == 8
    for key in ("cpu", "cores", "torch", "transformers", "torch_threads", "git_commit"):
        assert key in report["machine"]
    assert len(report["prompts"]["batch"]) == 2

    res = report["results"]["float32"]
    assert res["weight_bytes"] > 0
    samples = res["samples"]
    assert len(samples["b1"]) == 1 and len(samples["batch"]) == 1
    assert samples["batch"][0]["output_tokens"] == 2 * 8
    assert len(samples["kernel"]) == 1 and len(samples["bandwidth"]) == 1
    for name in (
        "engine_b1_tok_s",
        "hf_b1_tok_s",
        "engine_batch_tok_s",
        "hf_batch_tok_s",
        "kernel_floor_steps_s",
        "kernel_floor_fused_steps_s",
        "read_bandwidth_gb_s",
        "bandwidth_limit_steps_s",
    ):
        assert res["summary"][name]["median"] > 0, name
    assert all(v > 0 for v in res["ratios"].values())
    assert all(v > 0 for v in res["fractions"].values())
    # float32 greedy: the engine and transformers agree on the first tokens at least.
    assert samples["b1"][0]["agree_tokens"] >= 1

    names = [t["name"] for t in report["targets"]]
    assert names == ["float32 batch 1: engine / kernel floor"]
    assert "float32" in console.file.getvalue()  # type: ignore[attr-defined]
