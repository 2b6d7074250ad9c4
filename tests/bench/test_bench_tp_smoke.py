"""`tandem bench tp` end to end on the tiny model at TP 1 and 2: the report is complete.

Not a measurement: 8 new tokens, one round.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from tandem.bench.tp_bench import TPBenchConfig, run_tp_bench


def test_report_is_complete(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = TPBenchConfig(model=str(tiny_llama_path), sizes=(1, 2), threads=2).quick()
    out = tmp_path / "tp.json"
    run_tp_bench(config, str(out), Console(file=io.StringIO()))
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"1", "2"}
    for size, res in report["results"].items():
        assert res["tok_s"]["median"] > 0
        share = res["collective_share"]["median"]
        assert share == 0 if size == "1" else 0 < share < 1
    assert out.with_suffix(".png").is_file()
