"""`tandem bench gpu`: the engine at GPU speed on one GPU, in under 5 minutes (`--quick`: 90 s).

Phases, each model built on the GPU with random weights and freed before the next:

1. kernels: the Triton attention kernels and backend against the reference (`gpu_kernels.py`,
   the cases `make test` runs under Triton's interpreter), and one decode step's logits on the
   Triton backend with a CUDA graph against the SDPA backend run eagerly (TP 1);
2. bandwidth: a >= 4 GiB device-to-device `copy_` (bytes read + written, median of 10), the HBM
   roofline of a decode step: (weight bytes + KV bytes) / bandwidth;
3. a Llama-3-8B-shaped model, bf16: the engine's decode step at batch 1, 8 and 64 with 1k-token
   contexts (Triton attention, CUDA graphs) against that roofline and against transformers'
   `generate` on the same shape (SDPA, static cache, no compilation);
4. a SmolLM2-135M-shaped model, bf16, batch 1: the decode step with and without CUDA graphs.

The targets (issue 32) are checked and printed with the table; the JSON holds every figure.
Imports torch, Triton, transformers and the engine core only (the GPU machine has no more):
no rich, no typer here; `tandem bench gpu` passes its arguments to `main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.model_config import ModelConfig

if TYPE_CHECKING:
    from tandem.bench.gpu_runs import DecodeTiming

LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
GRAPH_LOGIT_TOLERANCE = 1e-3
# (what, goal): the targets
TARGETS = {
    "8b_batch1_roofline": 0.85,  # engine tok/s over roofline tok/s, weights + KV
    "8b_batch64_roofline": 0.75,
    "8b_batch64_vs_transformers": 3.0,
    "135m_graphs_vs_eager": 5.0,
}


@dataclass
class GpuCheck:
    """Every figure of one run (the JSON)."""

    device: str = ""
    quick: bool = False
    kernel_errors: dict[str, float] = field(default_factory=dict)
    kernel_failures: list[str] = field(default_factory=list)
    # one float32 decode step's logits, Triton + CUDA graph against SDPA eager: max |diff| / max
    graph_logit_diff: float | None = None
    bandwidth_gb_s: float | None = None
    decode: list[dict[str, Any]] = field(default_factory=list)  # one row per (model, batch)
    ratios: dict[str, float] = field(default_factory=dict)  # the targets' measured values
    seconds: float = 0.0


def roofline_step_s(
    weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int, bandwidth: float
) -> float:
    """The shortest a decode step can take: every weight once, and every request's KV."""
    return (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth


def decode_row(
    model: str,
    mode: str,
    layers: int,
    batch: int,
    context: int,
    timing: DecodeTiming,
    bandwidth: float,
) -> dict[str, Any]:
    """One decode measurement with its roofline (bandwidth in bytes/s)."""
    roof = roofline_step_s(
        timing.weight_bytes, timing.kv_bytes_per_token, batch, context, bandwidth
    )
    return {
        "model": model,
        "mode": mode,  # graphs | eager (the engine) | transformers
        "layers": layers,
        "batch": batch,
        "context": context,
        "step_ms": timing.step_s * 1e3,
        "tok_s": batch / timing.step_s,
        "roofline_tok_s": batch / roof,
        "of_roofline": roof / timing.step_s,
        "weight_bytes": timing.weight_bytes,
        "kv_bytes_per_token": timing.kv_bytes_per_token,
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The targets' measured values, of those rows the run has."""
    by = {(r["model"], r["batch"], r.get("mode", "")): r for r in rows}
    found = {}
    for batch in (1, 64):
        row = by.get(("8b", batch, "graphs"))
        if row is not None:
            found[f"8b_batch{batch}_roofline"] = row["of_roofline"]
    engine, hf = by.get(("8b", 64, "graphs")), by.get(("8b", 64, "transformers"))
    if engine is not None and hf is not None:
        found["8b_batch64_vs_transformers"] = engine["tok_s"] / hf["tok_s"]
    graphs, eager = by.get(("135m", 1, "graphs")), by.get(("135m", 1, "eager"))
    if graphs is not None and eager is not None:
        found["135m_graphs_vs_eager"] = graphs["tok_s"] / eager["tok_s"]
    return found


def table(check: GpuCheck) -> str:
    """The decode rows and the targets, as a Markdown table (docs/benchmarks.md takes it)."""
    failed = ", ".join(check.kernel_failures)
    lines = [
        f"GPU: {check.device}; copy bandwidth {check.bandwidth_gb_s or 0:.0f} GB/s; "
        f"kernels: {'FAILED ' + failed if failed else 'ok'}; "
        f"graph vs SDPA logits, max diff / max: {check.graph_logit_diff}",
        "",
        "| model | mode | batch | context | step ms | tok/s | roofline tok/s | of roofline |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in check.decode:
        roof = f"{r['roofline_tok_s']:.0f}" if r["mode"] != "transformers" else "-"
        share = f"{r['of_roofline']:.0%}" if r["mode"] != "transformers" else "-"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['batch']} | {r['context']} | "
            f"{r['step_ms']:.2f} | {r['tok_s']:.0f} | {roof} | {share} |"
        )
    lines += ["", "| target | goal | measured | met |", "|---|---:|---:|---|"]
    for name, goal in TARGETS.items():
        value = check.ratios.get(name)
        measured = "-" if value is None else f"{value:.2f}"
        met = "-" if value is None else ("yes" if value >= goal else "no")
        lines.append(f"| {name} | {goal} | {measured} | {met} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tandem bench gpu",
        description="The engine at GPU speed on one CUDA GPU: kernels against the reference, "
        "decode of a Llama-3-8B-shaped model against the HBM roofline and transformers, the "
        "135M model with and without CUDA graphs. Random weights, nothing downloaded.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="under 90 s: the 8B shape's first 4 layers, batch 1 and 64",
    )
    parser.add_argument("--batches", default="1,8,64", help="batch sizes of the 8B shape")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each request")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers of the 8B shape (default 32, --quick 4)",
    )
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' generate"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1 or args.context < 1 or args.steps < 1:
        parser.error("--batches, --context and --steps must be >= 1")
    if args.quick:
        args.batches = [b for b in args.batches if b in (1, 64)] or args.batches[:1]
        args.steps = min(args.steps, 8)
    if args.layers is None:
        args.layers = 4 if args.quick else LLAMA3_8B.num_layers
    return args


def run(args: argparse.Namespace) -> GpuCheck:
    import torch

    from tandem.bench import gpu_kernels, gpu_runs

    device = torch.device("cuda")
    bf16 = torch.bfloat16
    check = GpuCheck(device=torch.cuda.get_device_name(device), quick=args.quick)
    start = time.perf_counter()
    check.kernel_errors = gpu_kernels.all_errors(device)
    check.kernel_failures = gpu_kernels.failures(check.kernel_errors)
    small = replace(SMOLLM2_135M, num_layers=2)
    check.graph_logit_diff = gpu_runs.logits_agree(small, torch.float32, device)
    if not check.graph_logit_diff <= GRAPH_LOGIT_TOLERANCE:
        check.kernel_failures.append("graph_logits")
    bandwidth = gpu_runs.copy_bandwidth(device)
    check.bandwidth_gb_s = bandwidth / 1e9
    big = replace(LLAMA3_8B, num_layers=args.layers)
    runs = [("8b", big, b, "graphs") for b in args.batches]
    if not args.no_transformers:
        runs += [("8b", big, b, "transformers") for b in args.batches if b == 64 or not args.quick]
    runs += [("135m", SMOLLM2_135M, 1, mode) for mode in ("graphs", "eager")]
    for name, cfg, batch, mode in runs:
        if mode == "transformers":
            timing = gpu_runs.hf_decode(cfg, bf16, device, batch, args.context, args.steps)
        else:
            timing = gpu_runs.engine_decode(
                cfg, bf16, device, batch, args.context, args.steps, graphs=mode == "graphs"
            )
        row = decode_row(name, mode, cfg.num_layers, batch, args.context, timing, bandwidth)
        check.decode.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    check.ratios = ratios(check.decode)
    check.seconds = time.perf_counter() - start
    return check


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("tandem bench gpu: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "tandem bench gpu: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    check = run(args)
    print(table(check))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(check), indent=2) + "\n")
    return 1 if check.kernel_failures else 0


if __name__ == "__main__":
    sys.exit(main())
