"""`tandem bench soak` end to end, as short as it goes: a 1P2D --no-ray cluster of the tiny random
Llama, a few seconds of short requests (the long prompt is longer than the tiny model's 512
positions), one decode worker SIGKILLed (seed 0's first fault), restarted by
its supervisor. The report is complete (every request ended, none lost or hung, the fault whole
again with its times, the leak checks passed) and the JSON and the chart are written. The
seeded schedule is checked on its own. Not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.bench.soak import FAULTS, SoakConfig
from tandem.cli import app

pytestmark = pytest.mark.timeout(180)


def test_the_schedule_is_seeded_and_gives_each_fault_its_turn() -> None:
    config = SoakConfig(duration_s=600.0, steady_s=60.0, fault_interval_s=90.0, seed=3)
    schedule = config.schedule()
    assert [at for at, _ in schedule] == [60.0, 150.0, 240.0, 330.0, 420.0, 510.0]
    kinds = [kind for _, kind in schedule]
    assert sorted(kinds[:3]) == sorted(kinds[3:]) == sorted(FAULTS)
    assert schedule == SoakConfig(duration_s=600.0, seed=3).schedule()
    assert schedule != SoakConfig(duration_s=600.0, seed=4).schedule()
    with pytest.raises(ValueError, match="duration_s"):
        SoakConfig(duration_s=10.0, steady_s=60.0)


def test_a_short_soak_reports_every_request_and_the_fault(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "soak.json"
    command = [
        "bench", "soak", "--model", str(tiny_llama_path), "--duration", "6", "--steady", "2",
        "--fault-interval", "4", "--prefill", "1", "--decode", "2", "--clients", "2",
        "--seed", "0", "--recovery-window", "1", "--long-share", "0", "--json", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert report["lost_or_hung"] == 0 and report["leak_checks_failed"] == 0, report
    assert set(report["outcomes"]) == {"completed"}  # the killed worker's streams migrated
    assert sum(report["outcomes"].values()) == len(report["timeline"])
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_decode" and fault["victim"].startswith("decode-")
    assert fault["ready_after_s"] is not None and fault["leak_check"]["ok"]
    assert set(report["phases"]) == {"steady", "fault", "recovery"}
    assert "requests by outcome" in result.output and "faults" in result.output
