"""`tandem bench experiment pd|spec --quick` end to end on the tiny random Llama (given a minimal
chat template for the Spec-Bench chat prompts): every deployment starts, every pass completes
without errors or KV leaks, the reports, tables and plots are complete.

Not a measurement: a tiny model on a shared machine. The pure helpers (the long prompts'
schedule, salting, the ratio) are checked apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.bench.experiment import PdConfig, SpecExperimentConfig, long_schedule, salted
from tandem.bench.workloads import BenchRequest
from tandem.cli import app
from tandem.specbench import SPECBENCH_PATH

pytestmark = pytest.mark.timeout(180)

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_llama_path, model, dirs_exist_ok=True)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model


def test_helpers() -> None:
    assert long_schedule(32, 4, 4) == [7, 13, 19, 25]
    assert long_schedule(8, 2, 2) == [3, 5]
    requests = [BenchRequest(0, 4, (255, 7, 8)), BenchRequest(1, 4, (3, 9))]
    assert [r.prompt_token_ids for r in salted(requests, 2, 256)] == [(1, 7, 8), (5, 9)]
    quick = PdConfig().quick()
    assert quick.num_short >= 2 * quick.concurrency
    assert PdConfig().no_chunk_budget >= 2048 + 4 * 128
    with pytest.raises(ValueError, match="num_short"):
        PdConfig(num_short=4, concurrency=4)
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        PdConfig(local_prefill_tokens=4096)
    spec = SpecExperimentConfig()
    assert [spec.requests_at(c) for c in (1, 4, 16, 32)] == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="categories"):
        SpecExperimentConfig(workloads=(("x", "nope"),))


def test_pd_quick(chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "pd"
    args = ["bench", "experiment", "pd", "--quick", "--model", str(chat_model), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "with / without the long ones" in result.output
    report = json.loads((out / "results.json").read_text())
    names = [d["name"] for d in report["deployments"]]
    assert names == ["colocated no-chunk", "colocated chunked", "1P1D long-on-P", "1P1D all-on-P"]
    for d in report["deployments"]:
        kinds = [p["kind"] for p in d["passes"]]
        assert kinds == ["baseline", "interfered"]
        for p in d["passes"]:
            assert p["summary"]["errors"] == {}, p["summary"]
            assert p["kv_leak_check"]["status"] == "OK", p["kv_leak_check"]
            assert p["checks"] == {"streamed_token_mismatches": 0, "length_mismatches": 0}
        baseline, interfered = d["passes"]
        assert set(baseline["by_tag"]) == {"short"}
        assert set(interfered["by_tag"]) == {"short", "long"}
        assert interfered["by_tag"]["long"]["num_ok"] == 2
        assert interfered["by_tag"]["short"]["num_ok"] == 8
        assert d["ratio"]["p99_tpot_ratio"] > 0
    rows = {(r["deployment"], r["pass"], r["tag"]): r for r in report["rows"]}
    assert rows["1P1D all-on-P", "interfered", "long"]["prefilled_on_p"] == 2
    assert rows["1P1D all-on-P", "interfered", "short"]["prefilled_on_p"] == 8
    assert rows["1P1D long-on-P", "interfered", "long"]["prefilled_on_p"] == 2
    assert rows["1P1D long-on-P", "interfered", "short"]["prefilled_on_p"] == 0
    assert rows["colocated chunked", "interfered", "long"]["prefilled_on_p"] == 0
    targets = report["targets"]
    assert [t["deployment"] for t in targets] == ["1P1D long-on-P", "1P1D all-on-P"]
    assert all(t["target"].startswith("disaggregated") for t in targets)
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 4 * (8 + 10)
    assert len((out / "inputs.jsonl").read_text().splitlines()) == 10
    assert (out / "pd.png").stat().st_size > 0


@pytest.mark.skipif(not SPECBENCH_PATH.is_file(), reason="Spec-Bench prompts not found")
def test_spec_quick(chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec"
    args = ["bench", "experiment", "spec", "--quick", "--model", str(chat_model), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "results.json").read_text())
    rows = report["rows"]
    assert [(r["workload"], r["concurrency"]) for r in rows] == [
        ("qa", 1), ("qa", 2), ("humanities", 1), ("humanities", 2),
    ]  # fmt: skip
    for r in rows:
        assert r["ok"] == r["n"] == 2 and r["compared_outputs"] == 2
        assert r["off_tok_s"] > 0 and r["on_tok_s"] > 0 and r["tok_s_ratio"] > 0
        assert r["draft_tokens"] is not None  # the spec-on worker exports its acceptance
    for p in report["points"]:
        assert p["summary"]["errors"] == {} and p["kv_leak_check"]["status"] == "OK"
        drafted = p["server"]["totals"]["spec_draft_tokens"]
        assert drafted == 0 if p["side"] == "off" else drafted >= 0
    assert report["targets"] == []  # no input-grounded batch-1 point in --quick
    assert (out / "spec.png").stat().st_size > 0
