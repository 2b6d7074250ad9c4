"""`tandem bench serve` end to end against a tiny-model 1P1D LocalCluster: ~10 requests over
HTTP (through the CLI) and over gRPC, random token prompts and Spec-Bench chat. The reports are
complete: no errors, exact counts, server-side deltas, KV leak check OK.

Not a measurement: the tiny random Llama (byte-level tokenizer, given a minimal chat template here)
on a shared machine. The router's local_prefill_tokens is 4, so every request goes through the
prefill worker and its KV is transferred.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tandem.bench.serve import run_serve_bench
from tandem.bench.serve_config import ServeConfig
from tandem.bench.workloads import LoadPoint, WorkloadConfig
from tandem.cli import app
from tandem.cluster.local_cluster import LocalCluster
from tandem.config import RouterConfig

pytestmark = pytest.mark.timeout(120)

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_llama_path, model, dirs_exist_ok=True)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    c = LocalCluster(
        str(model),
        num_prefill=1,
        num_decode=1,
        http_port=0,
        grpc_port=0,
        router=RouterConfig(str(model), local_prefill_tokens=4),
    )
    try:
        yield c.start(timeout_s=90)
    finally:
        c.stop(grace_s=5.0)


def _check_point(point: dict[str, Any], n: int) -> None:
    s = point["summary"]
    assert (s["num_requests"], s["num_ok"], s["errors"]) == (n, n, {}), s
    assert s["ttft"]["count"] == n and s["e2e"]["count"] == n
    assert s["output_throughput"] > 0
    assert point["checks"] == {"streamed_token_mismatches": 0, "length_mismatches": 0}
    server = point["server"]
    totals = server["totals"]
    assert totals["kv_transfers"] == n and totals["kv_transfer_bytes"] > 0
    roles = sorted(w["role"] for w in server["workers"].values())
    assert roles == ["decode", "prefill"]
    router = server["router"]
    assert router is not None
    assert router["requests"] == {"length": n}  # both APIs record into the router's metrics
    assert point["kv_leak_check"]["status"] == "OK", point["kv_leak_check"]


def test_http_random_through_the_cli(cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "http"
    args = [
        "bench", "serve", "--url", cluster.http_url, "--num-requests", "10",
        "--concurrency", "4", "--input-len", "uniform(16,48)", "--output-len", "8",
        "--slo-ttft", "60000", "--out", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "KV leak check OK" in result.output
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["api"] == "http" and report["machine"]["git_commit"]
    assert report["model"]["vocab_size"] == 256 and report["model"]["max_model_len"] == 512
    (point,) = report["points"]
    _check_point(point, 10)
    assert point["summary"]["goodput"] == pytest.approx(point["summary"]["request_throughput"])
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 10 and all(r["output_tokens"] == 8 for r in requests)
    assert all(r["events"] == 8 and r["streamed_tokens"] == 8 for r in requests)
    inputs = (out / "inputs.jsonl").read_text().splitlines()
    assert len(inputs) == 10 and 16 <= json.loads(inputs[0])["input_len"] <= 48
    assert (out / "summary.csv").read_text().count("\n") == 2
    for png in ("latency_vs_load", "throughput_vs_tpot", "ttft_tpot_distributions"):
        assert (out / f"{png}.png").stat().st_size > 0


def test_grpc_random_and_specbench_chat(cluster: Any, tmp_path: Path) -> None:
    base = ServeConfig(
        url=cluster.http_url,
        grpc=cluster.grpc_target,
        workload=WorkloadConfig("random", num_requests=10, input_len="32", output_len="8"),
        points=(LoadPoint(rate=50.0, concurrency=8),),
        leak_wait_s=15.0,
    )
    console = Console(file=io.StringIO(), width=120)
    report = run_serve_bench(base, console)
    (point,) = report["points"]
    _check_point(point, 10)
    timings = point["server_timings"]
    assert timings["requests"] == timings["via_prefill_worker"] == 10
    assert timings["exposed_transfer_s"]["count"] == 10
    assert point["summary"]["total_throughput"] > point["summary"]["output_throughput"]

    chat = ServeConfig(
        url=cluster.http_url,
        grpc=cluster.grpc_target,
        workload=WorkloadConfig("specbench:qa", output_len="8", ignore_eos=True),
        points=(LoadPoint(concurrency=2),),
        max_requests=4,
        leak_wait_s=15.0,
        out=str(tmp_path / "chat"),
        plots=False,
    )
    report = run_serve_bench(chat, console)
    (point,) = report["points"]
    _check_point(point, 4)
    inputs = [json.loads(line) for line in (tmp_path / "chat" / "inputs.jsonl").open()]
    assert len(inputs) == 20 and all(row["tag"] == "qa" and row["messages"] for row in inputs)
