"""`tandem bench transfer` end to end with tiny sizes: every channel and reference in real
sender/receiver processes, and the exposed-time part with the real workers on the tiny random
Llama, at TP 1 and into a decode worker of two ranks (spawned by the side's child process); the
report is complete. Not a measurement (the default model's `--quick` takes a minute).
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from tandem.bench.transfer import run_transfer_bench
from tandem.bench.transfer_channels import block_order, kv_checksum
from tandem.bench.transfer_config import TransferBenchConfig, plan_devices, reference_of, target_of
from tandem.cli import app


def test_checksum_sees_misplaced_tokens_and_layers() -> None:
    caches = [torch.randn(2, 4, 2, 1, 3) for _ in range(2)]  # [2, blocks, block_size, heads, dim]
    blocks = block_order(4, seed=0)
    assert sorted(blocks) == [0, 1, 2, 3] and blocks == block_order(4, seed=0)
    base = kv_checksum(caches, blocks, 7)
    assert kv_checksum(caches, blocks, 7) == base
    assert kv_checksum(caches, blocks[::-1], 7) != base  # same tokens, other order
    assert kv_checksum(caches[::-1], blocks, 7) != base  # layers swapped
    caches[1][:, blocks[3], 1] = 0  # token 7 is past num_tokens: not covered
    assert kv_checksum(caches, blocks, 7) == base


def test_plan_references_and_targets() -> None:
    config = TransferBenchConfig()
    devices = plan_devices(config)
    assert (devices.sender, devices.receiver, devices.skipped) == ("cpu", "cpu", {})
    assert [reference_of(c, "cpu") for c in ("pair", "grpc", "shm")] == ["tcp", "tcp", "memcpy"]
    assert reference_of("pair", "cuda") == reference_of("shm", "cuda") == "device_copy"
    assert reference_of("grpc", "cuda") == "tcp"
    assert target_of("grpc", "tcp") == 0.6 and target_of("shm", "memcpy") == 0.5
    assert target_of("shm", "device_copy") == 0.5
    assert target_of("pair", "device_copy") is None
    quick = config.quick()
    assert quick.prompt_tokens == (512,) and quick.reps == 1 and quick.exposed_tokens == (512,)
    with pytest.raises(ValueError, match="unknown"):
        TransferBenchConfig(channels=("rdma",))
    assert devices.exposed_tp == ((1, 1), (3, 1), (1, 3))
    with pytest.raises(ValueError, match="exposed_tp"):
        TransferBenchConfig(exposed_tp=((3, 0),))


def test_cli_rejects_bad_options() -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", "--channels", "pair,rdma"])
    assert result.exit_code == 2
    assert "rdma" in result.output
    result = CliRunner().invoke(app, ["bench", "transfer", "--exposed-tp", "1:1,3"])
    assert result.exit_code == 2
    assert "PREFILL:DECODE" in result.output


@pytest.mark.timeout(120)
def test_bench_transfer_smoke(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = replace(
        TransferBenchConfig(model=str(tiny_llama_path)).quick(),
        prompt_tokens=(40, 64),  # 40: a partly filled last block
        exposed_tokens=(48,),
        exposed_tp=((1, 1), (1, 2)),
        decode_tokens=2,
    )
    out = tmp_path / "transfer.json"
    console = Console(file=io.StringIO(), width=80)
    returned = run_transfer_bench(config, out, console)

    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "transfer.png").stat().st_size > 0
    for key in ("cpu", "cores", "torch", "git_commit"):
        assert key in report["machine"]
    # The tiny Llama: 2 layers x 2 KV heads x 16 dim, float32.
    assert report["layout"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4

    res = report["throughput"]
    assert res["pair_setup_s"] > 0
    assert [(r["channel"], r["tokens"]) for r in res["rows"]] == [
        (c, n) for c in ("pair", "grpc", "shm") for n in (40, 64)
    ]
    for row in res["rows"]:
        assert row["nbytes"] == row["tokens"] * report["layout"]["bytes_per_token"]
        assert row["gb_s"] > 0 and row["reference_gb_s"] > 0 and row["ratio"] > 0
        assert row["pass"] == (row["ratio"] >= row["target"])
    whats = {s["what"] for s in res["samples"]}
    assert whats == {"pair", "grpc", "shm", "tcp", "memcpy"}
    assert len(res["samples"]) == 5 * 2  # one round, two lengths
    assert all(s["data_plane"] == s["what"] for s in res["samples"] if "data_plane" in s)

    rows = report["exposed"]["rows"]
    # into a decode worker of two ranks on shm too: each rank's shared cache written its heads
    cases = [(tp, c) for tp in ((1, 1), (1, 2)) for c in ("pair", "grpc", "shm")]
    assert [(tuple(r["tp"]), r["channel"], r["stream"]) for r in rows] == [
        (tp, c, s) for tp, c in cases for s in (True, False)
    ]
    assert rows[-1]["label"] == "shm, P TP 1 -> D TP 2"
    assert all(s["data_plane"] == s["channel"] for s in report["exposed"]["samples"])
    for row in rows:
        assert row["tokens"] == 48
        assert row["exposed_s"]["median"] > 0 and row["decode_step_s"]["median"] > 0
        assert row["prefill_s"]["median"] > 0
        assert (row["pass"] is None) == (not row["stream"])
    assert all(s["n_out"] == 3 for s in report["exposed"]["samples"])
    assert len(report["targets"]) == 6 + 6
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "KV transfer throughput" in text and "exposed transfer time" in text
