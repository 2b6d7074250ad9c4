"""The GPU check's parts that need no GPU: its arguments, the roofline arithmetic, the targets,
the table, its imports (the GPU machine has torch, Triton and transformers only) and its clear
refusal without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem.bench.gpu import (
    LLAMA3_8B,
    GpuCheck,
    decode_row,
    main,
    parse_args,
    ratios,
    roofline_step_s,
    table,
)
from tandem.bench.gpu_runs import DecodeTiming
from tandem.engine.kv_quant import kv_bytes_per_token

GB = 10**9


def test_arguments() -> None:
    args = parse_args([])
    assert (args.batches, args.context, args.layers, args.quick) == ([1, 8, 64], 1024, 32, False)
    quick = parse_args(["--quick"])
    assert (quick.batches, quick.layers, quick.steps) == ([1, 64], 4, 8)
    assert parse_args(["--batches", "2,16", "--layers", "8"]).batches == [2, 16]
    for bad in (["--batches", "x"], ["--batches", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_roofline_counts_weights_once_and_every_requests_kv() -> None:
    kv = kv_bytes_per_token(LLAMA3_8B, torch.bfloat16)
    assert kv == 2 * 32 * 8 * 128 * 2  # 128 KiB a token
    # 16 GB of weights + 64 x 1024 tokens of KV at 4 TB/s
    step = roofline_step_s(16 * GB, kv, 64, 1024, 4000 * GB)
    assert step == pytest.approx((16 * GB + 64 * 1024 * kv) / (4000 * GB))
    row = decode_row("8b", "graphs", 32, 64, 1024, DecodeTiming(2 * step, 16 * GB, kv), 4000 * GB)
    assert row["of_roofline"] == pytest.approx(0.5)
    assert row["tok_s"] == pytest.approx(64 / (2 * step))
    assert row["roofline_tok_s"] == pytest.approx(64 / step)


def _row(model: str, mode: str, batch: int, step_s: float) -> dict[str, object]:
    return decode_row(model, mode, 32, batch, 1024, DecodeTiming(step_s, GB, 1000), 1000 * GB)


def test_ratios_and_table() -> None:
    rows = [
        _row("8b", "graphs", 1, 0.0012),
        _row("8b", "graphs", 64, 0.0100),
        _row("8b", "transformers", 64, 0.0400),
        _row("135m", "graphs", 1, 0.001),
        _row("135m", "eager", 1, 0.004),
    ]
    found = ratios(rows)
    roof_1 = roofline_step_s(GB, 1000, 1, 1024, 1000 * GB)
    assert found["8b_batch1_roofline"] == pytest.approx(roof_1 / 0.0012)
    assert found["8b_batch64_vs_transformers"] == pytest.approx(4.0)
    assert found["135m_graphs_vs_eager"] == pytest.approx(4.0)
    check = GpuCheck(device="H100", bandwidth_gb_s=3000.0, decode=rows, ratios=found)
    text = table(check)
    assert "| 8b | transformers | 64 | 1024 | 40.00 | 1600 | - | - |" in text
    assert "| 135m_graphs_vs_eager | 5.0 | 4.00 | no |" in text
    assert "| 8b_batch64_vs_transformers | 3.0 | 4.00 | yes |" in text
    assert "kernels: ok" in text
    assert "| 8b_batch1_roofline" in table(GpuCheck())  # no rows: every target unmeasured


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device would run the check")
def test_refuses_clearly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_imports_only_what_the_gpu_machine_has() -> None:
    code = (
        "import sys, json; import tandem.bench.gpu, tandem.bench.gpu_runs, "
        "tandem.bench.gpu_kernels; print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    tops = {name.split(".")[0] for name in json.loads(done.stdout) if not name.startswith("_")}
    third_party = tops - set(sys.stdlib_module_names) - {"tandem"}
    # transformers' own: safetensors
    allowed = {"torch", "torchgen", "numpy", "tqdm", "typing_extensions", "triton", "transformers",
               "safetensors"}  # fmt: skip
    assert third_party <= allowed, third_party - allowed
