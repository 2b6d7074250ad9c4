"""`tandem bench quant`: summaries and targets from scripted samples, and the whole matrix with
`--quick` sizes on the real model, llama.cpp off (not a measurement)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tandem.bench.quant import check_targets, run_quant_bench, summarize
from tandem.bench.quant_config import LLAMA_CPP, NGRAM, SPEC_OFF, QuantBenchConfig


def sample(fmt: str, spec: str, batch_size: int, decode_tok_s: float) -> dict:
    counters = {"drafts": 4, "draft_tokens": 20, "accepted": 8} if spec == NGRAM else {}
    return {
        "format": fmt,
        "spec": spec,
        "batch_size": batch_size,
        "decode_tok_s": decode_tok_s,
        "output_tok_s": decode_tok_s / 2,
        "spec_counters": counters,
        **({"first_difference": [None]} if spec == NGRAM else {}),
    }


def test_summary_ratios_and_targets() -> None:
    config = QuantBenchConfig(batch_sizes=(1, 16))
    samples = [
        sample("bf16", SPEC_OFF, 1, 30.0),
        sample("bf16", NGRAM, 1, 60.0),
        sample("bf16", SPEC_OFF, 16, 300.0),
        sample("int8", SPEC_OFF, 1, 50.0),
        sample("int4", SPEC_OFF, 1, 80.0),
        sample("int4", SPEC_OFF, 16, 400.0),
        sample(LLAMA_CPP, LLAMA_CPP, 1, 100.0),
    ]
    rows = {(r["format"], r["spec"], r["batch_size"]): r for r in summarize(samples, config)}
    assert rows["int8", SPEC_OFF, 1]["vs_bf16"] == pytest.approx(50 / 30)
    assert rows["int4", SPEC_OFF, 1]["vs_llama_cpp"] == pytest.approx(0.8)
    ngram = rows["bf16", NGRAM, 1]
    assert ngram["vs_off"] == pytest.approx(2.0) and ngram["same_output"] == [1, 1]
    assert ngram["mean_acceptance_length"] == pytest.approx(3.0)
    assert ngram["acceptance_rate"] == pytest.approx(0.4)
    floors = [{"format": "int4", "engine_b1_of_floor": 0.9}]
    rooflines = [
        {"format": "bf16", "engine_b1_of_roofline": 0.6},
        {"format": "int4", "engine_b1_of_roofline": 0.6},
    ]
    targets = check_targets(
        list(rows.values()), floors, rooflines, {"bf16": 100, "int8": 53}, config
    )
    got = {t["name"]: (round(t["value"], 3), t["pass"]) for t in targets}
    assert got == {
        "int8 batch 1: / bf16": (1.667, True),
        "int4 batch 1: / bf16": (2.667, True),
        "int4 batch 1: / llama.cpp": (0.8, False),
        "bf16 batch 1: of its memory roofline": (0.6, False),  # 70% for every format
        "int4 batch 1: of its memory roofline": (0.6, True),  # but int4: 50%
        "int4 batch 1: of its kernel floor": (0.9, True),
        "int4 batch 16: / bf16": (1.333, True),
        "KV bytes per token: bf16 / int8 (int8 <= 0.55x bf16)": (1.887, True),
    }


def test_bad_config_is_refused() -> None:
    for options, field in (
        ({"formats": ("fp4",)}, "formats"),
        ({"group_size": 48}, "group_size"),
        ({"new_tokens": 1}, "new_tokens"),
        ({"categories": ("poetry",)}, "categories"),
    ):
        with pytest.raises(ValueError, match=field):
            QuantBenchConfig(**options)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_quant_quick(smollm2_path: Path, tmp_path: Path) -> None:
    """Short prompts of their own keep the prefill out of the test's time (< 40 s here)."""
    text = "Summarize: the cat sat on the mat. The cat sat on the mat because the mat was warm."
    rows = [
        {"question_id": i, "category": "summarization", "turns": [text * (i + 1)]} for i in range(2)
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = QuantBenchConfig(
        model=str(smollm2_path), llama_cpp=False, prompts_path=str(prompts)
    ).quick()
    out = tmp_path / "quant.json"
    console = Console(file=io.StringIO(), width=200)
    returned = run_quant_bench(config, out, console)

    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "quant.png").stat().st_size > 0
    assert report["skipped"] == {LLAMA_CPP: "turned off (--no-llama-cpp)"}
    keys = {(r["format"], r["spec"], r["batch_size"]) for r in report["summary"]}
    assert keys == {
        (f, s, b) for f in ("bf16", "int8", "int4") for s in (SPEC_OFF, NGRAM) for b in (1, 2)
    } | {("fp32", SPEC_OFF, b) for b in (1, 2)}
    for row in report["summary"]:
        assert row["decode_tok_s"]["median"] > 0 and row["output_tok_s"]["median"] > 0
        if row["spec"] == NGRAM:
            assert row["same_output"][1] == row["batch_size"]
    formats = ["fp32", "bf16", "int8", "int4"]
    assert [f["format"] for f in report["kernel_floor"]] == formats
    assert all(f["steps_s"]["median"] > 0 for f in report["kernel_floor"])
    assert [r["format"] for r in report["roofline"]] == formats
    bytes_of = {r["format"]: r["weight_bytes"] for r in report["roofline"]}
    # what a decode step reads shrinks with the format: float32, bfloat16, int8, int4 codes
    assert bytes_of["fp32"] > bytes_of["bf16"] > bytes_of["int8"] > bytes_of["int4"]
    assert all(r["roofline_tok_s"] > 0 for r in report["roofline"])
    assert set(report["routes"]) == set(formats) and all(report["routes"].values())
    machine = report["machine"]
    assert machine["native_level"] in ("generic", "avx2", "avx512", "avx512bf16")
    names = [t["name"] for t in report["targets"]]
    assert names[:2] == ["int8 batch 1: / bf16", "int4 batch 1: / bf16"]
    assert names[-1].startswith("KV bytes")
    text_out = console.file.getvalue()  # type: ignore[attr-defined]
    for part in ("kernel floor", "memory roofline", "kernel routes", "targets", "native kernels"):
        assert part in text_out
