"""The statistics of `tandem bench transfer`: per channel and prompt length, GB/s against the
channel's reference; per channel, prompt length and streaming mode, the exposed transfer time
against one decode step; and the BENCHMARKS.md targets those rows meet or miss."""

from __future__ import annotations

from typing import Any

import torch

from tandem.bench.report import stats
from tandem.bench.transfer_config import (
    REFERENCE_NAMES,
    TARGET_EXPOSED_OF_DECODE_STEP,
    Devices,
    TransferBenchConfig,
    channel_label,
    reference_of,
    target_of,
)


def summarize_throughput(
    config: TransferBenchConfig,
    devices: Devices,
    samples: list[dict[str, Any]],
    pair_setup_s: float | None,
) -> dict[str, Any]:
    """Per (channel or reference, prompt length): seconds and GB/s; per channel row its
    reference, the ratio of medians and the target."""
    device_type = torch.device(config.device).type
    cells: dict[str, dict[str, Any]] = {}
    for s in samples:
        s["gb_s"] = s["nbytes"] / s["seconds"] / 1e9
    for what in {s["what"] for s in samples}:
        for n in config.prompt_tokens:
            mine = [s for s in samples if s["what"] == what and s["tokens"] == n]
            if mine:
                cells[f"{what}/{n}"] = {
                    "nbytes": mine[0]["nbytes"],
                    "seconds": stats([s["seconds"] for s in mine]),
                    "gb_s": stats([s["gb_s"] for s in mine]),
                }
    rows = []
    for channel in devices.channels:
        reference = reference_of(channel, device_type)
        target = target_of(channel, reference)
        for n in config.prompt_tokens:
            gb_s = cells[f"{channel}/{n}"]["gb_s"]["median"]
            ref_gb_s = cells[f"{reference}/{n}"]["gb_s"]["median"]
            ratio = gb_s / ref_gb_s
            rows.append(
                {
                    "channel": channel,
                    "label": channel_label(channel, device_type),
                    "tokens": n,
                    "nbytes": cells[f"{channel}/{n}"]["nbytes"],
                    "reference": reference,
                    "gb_s": gb_s,
                    "reference_gb_s": ref_gb_s,
                    "ratio": ratio,
                    "target": target,
                    "pass": None if target is None else ratio >= target,
                }
            )
    return {"pair_setup_s": pair_setup_s, "rows": rows, "cells": cells, "samples": samples}


def summarize_exposed(
    config: TransferBenchConfig, devices: Devices, samples: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per (TP sizes, channel, prompt length, streaming): exposed time, decode step, prefill; with
    streaming, the target exposed < one decode step."""
    device_type = torch.device(config.device).type
    rows = []
    cases = [
        (tp, channel, n, stream)
        for tp in devices.exposed_tp
        for channel in devices.exposed_channels
        for n in config.exposed_tokens
        for stream in (True, False)
    ]
    for tp, channel, n, stream in cases:
        mine = [
            s
            for s in samples
            if (tuple(s["tp"]), s["channel"], s["tokens"], s["stream"]) == (tp, channel, n, stream)
        ]
        if not mine:
            continue
        exposed = stats([s["exposed_s"] for s in mine])
        step = stats([s["tpot_s"] for s in mine])
        of_step = exposed["median"] / step["median"]
        rows.append(
            {
                "channel": channel,
                "tp": list(tp),
                "label": channel_label(channel, device_type, tp),
                "tokens": n,
                "stream": stream,
                "nbytes": mine[0]["nbytes"],
                "exposed_s": exposed,
                "decode_step_s": step,
                "prefill_s": stats([s["prefill_s"] for s in mine]),
                "sender_tail_s": stats([s["sender_tail_s"] for s in mine]),
                "exposed_of_step": of_step,
                "pass": of_step < TARGET_EXPOSED_OF_DECODE_STEP if stream else None,
            }
        )
    return {"rows": rows, "samples": samples}


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row that has a BENCHMARKS.md target, with its measured value."""
    targets = []
    for row in report["throughput"]["rows"]:
        if row["target"] is not None:
            targets.append(
                {
                    "name": f"{row['label']} / {REFERENCE_NAMES[row['reference']]}, "
                    f"{row['tokens']} tokens",
                    "value": row["ratio"],
                    "at_least": row["target"],
                    "pass": row["pass"],
                }
            )
    for row in report.get("exposed", {}).get("rows", []):
        if row["pass"] is not None:
            targets.append(
                {
                    "name": f"{row['label']} exposed / decode step, {row['tokens']} tokens, "
                    "streaming",
                    "value": row["exposed_of_step"],
                    "below": TARGET_EXPOSED_OF_DECODE_STEP,
                    "pass": row["pass"],
                }
            )
    return targets
