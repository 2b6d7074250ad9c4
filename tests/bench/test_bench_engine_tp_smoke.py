"""`tandem bench engine --tp` end to end on the tiny model at TP 1 and 2: the report is
complete, and the comparison's options are refused beside `--tp`.

Not a measurement: 8 new tokens, one round.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tandem.cli import app


def test_report_is_complete(tiny_llama_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    args = ["bench", "engine", "--model", str(tiny_llama_path), "--tp", "1,2"]
    result = CliRunner().invoke(app, [*args, "--dtypes", "float32", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "overhead" in result.output  # of TP on fewer cores than ranks, not a speedup
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["float32"]
    assert set(report["results"]["float32"]) == {"1", "2"}
    for size, res in report["results"]["float32"].items():
        assert res["tok_s"]["median"] > 0
        share = res["collective_share"]["median"]
        assert share == 0 if size == "1" else 0 < share < 1
    assert out.with_suffix(".png").is_file()


def test_comparison_options_refused_with_tp() -> None:
    result = CliRunner().invoke(app, ["bench", "engine", "--tp", "1,3", "--batch", "4"])
    assert result.exit_code == 2
    assert "--batch" in result.output
    result = CliRunner().invoke(app, ["bench", "engine", "--device", "cuda"])
    assert result.exit_code == 2
    assert "--tp only" in result.output
