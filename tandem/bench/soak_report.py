"""The soak's report: requests by outcome, p50/p99 TTFT and TPOT per phase (steady; fault: from a
kill until the cluster is whole again; recovery: the window after that), each fault's recovery
times and leak check; printed as tables, drawn as latency over time with the faults marked.

A request's phase is that of its start. A DEADLINE_EXCEEDED whose request was running during a
fault or recovery counts apart (`deadline_exceeded (recovery)`): the target allows those only.
Per fault: `ready` = kill -> every worker listed again (a replacement registered, or Redis back
and re-populated); `serving` = ready -> the first completion of a request sent after it (the
issue's "recovery <= 5 s after a replacement is ready"); `first ok` = kill -> the first
completion of a request sent after the kill (the cluster's other workers serve meanwhile).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tandem.bench.report import pyplot, save_chart
from tandem.bench.serving_metrics import percentile
from tandem.bench.soak import Fault, Request, SoakConfig

PHASES = ("steady", "fault", "recovery")
BAD = ("hung", "lost")  # outcomes the target allows none of (prefixes)


def summarize(
    config: SoakConfig, requests: list[Request], faults: list[Fault], final_check: dict[str, Any]
) -> dict[str, Any]:
    windows = [_window(f, config) for f in faults]
    outcomes: Counter[str] = Counter()
    by_phase: dict[str, list[Request]] = {p: [] for p in PHASES}
    for r in requests:
        by_phase[_phase(r.start_s, windows)].append(r)
        disturbed = any(r.start_s < end and (r.end_s or r.start_s) >= at for at, _, end in windows)
        late = r.outcome == "deadline_exceeded" and disturbed
        outcomes[f"{r.outcome} (recovery)" if late else r.outcome] += 1
    examples: dict[str, str] = {}
    for r in requests:
        if r.detail:
            examples.setdefault(r.outcome, r.detail)
    return {
        "config": asdict(config),
        "outcomes": dict(outcomes.most_common()),
        "error_examples": examples,  # the first message of each failed outcome
        "phases": {p: _latency(rs) for p, rs in by_phase.items()},
        "faults": [_fault_row(f, requests) for f in faults],
        "final_leak_check": final_check,
        "timeline": [
            [round(r.start_s, 3), r.ttft_s and round(r.ttft_s, 4), r.outcome] for r in requests
        ],
        "lost_or_hung": sum(n for k, n in outcomes.items() if k.startswith(BAD)),
        "leak_checks_failed": sum(not f.leak_check.get("ok") for f in faults)
        + (not final_check.get("ok")),
    }


def _window(f: Fault, config: SoakConfig) -> tuple[float, float, float]:
    """(kill, ready, end of recovery) in seconds from the start; a fault never whole again
    lasts to the end."""
    ready = f.ready_s if f.ready_s is not None else float("inf")
    return f.at_s, ready, ready + config.recovery_window_s


def _phase(t: float, windows: list[tuple[float, float, float]]) -> str:
    for at, ready, end in windows:
        if at <= t < ready:
            return "fault"
        if ready <= t < end:
            return "recovery"
    return "steady"


def _latency(requests: list[Request]) -> dict[str, Any]:
    done = [r for r in requests if r.outcome == "completed"]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    row: dict[str, Any] = {"requests": len(requests), "completed": len(done)}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 99):
            row[f"{name}_p{q}_s"] = percentile(values, q) if values else None
    return row


def _fault_row(f: Fault, requests: list[Request]) -> dict[str, Any]:
    def first_completion_after(t: float | None) -> float | None:
        ends = [
            r.end_s
            for r in requests
            if t is not None and r.start_s >= t and r.outcome == "completed" and r.end_s
        ]
        return min(ends) - t if ends and t is not None else None

    return {
        "kind": f.kind,
        "victim": f.victim,
        "at_s": f.at_s,
        "ready_after_s": None if f.ready_s is None else f.ready_s - f.at_s,
        "serving_after_ready_s": first_completion_after(f.ready_s),
        "first_ok_after_kill_s": first_completion_after(f.at_s),
        "leak_check": f.leak_check,
    }


def print_soak(report: dict[str, Any], console: Console) -> None:
    c = report["config"]
    console.print(
        f"soak: {c['model']} {c['num_prefill']}P{c['num_decode']}D, {c['duration_s']:.0f} s, "
        f"seed {c['seed']}, {c['clients']} clients, {len(report['faults'])} faults"
    )
    outcomes = Table(title="requests by outcome", title_justify="left", box=box.SIMPLE_HEAD)
    outcomes.add_column("outcome")
    outcomes.add_column("requests", justify="right")
    for kind, n in report["outcomes"].items():
        outcomes.add_row(kind, str(n))
    console.print(outcomes)
    for kind, message in report["error_examples"].items():
        console.print(f"  [dim]{kind}: {message}[/dim]", markup=True, highlight=False)
    phases = Table(title="latency by phase", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("phase", "requests", "completed", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        phases.add_column(name, justify="left" if name == "phase" else "right")
    for phase, row in report["phases"].items():
        phases.add_row(
            phase, str(row["requests"]), str(row["completed"]),
            *(_ms(row[k]) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")),
        )  # fmt: skip
    console.print(phases)
    faults = Table(title="faults", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("at", "fault", "ready after", "serving after ready", "first ok", "leak check"):
        faults.add_column(name, justify="left" if name in ("fault", "leak check") else "right")
    for f in report["faults"]:
        faults.add_row(
            f"{f['at_s']:.0f} s", f"{f['kind']}", _s(f["ready_after_s"]),
            _s(f["serving_after_ready_s"]), _s(f["first_ok_after_kill_s"]),
            _leak(f["leak_check"]),
        )  # fmt: skip
    console.print(faults)
    console.print(
        f"lost or hung: {report['lost_or_hung']}; leak checks failed: "
        f"{report['leak_checks_failed']} (final: {_leak(report['final_leak_check'])})"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def _leak(check: dict[str, Any]) -> str:
    return "ok" if check.get("ok") else "[red]LEAK[/red]"


def write_chart(report: dict[str, Any], path: Path) -> None:
    """TTFT of each request over the run (failed ones at the bottom, in red), each fault's span
    from the kill to ready shaded and labelled."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    done = [(t, ttft) for t, ttft, outcome in report["timeline"] if outcome == "completed" and ttft]
    failed = [t for t, _, outcome in report["timeline"] if outcome != "completed"]
    if done:
        ax.scatter(*zip(*done, strict=True), s=6, label="TTFT, completed")
    if failed:
        ax.scatter(failed, [0.0] * len(failed), s=10, color="tab:red", marker="x", label="failed")
    for f in report["faults"]:
        end = f["at_s"] + (f["ready_after_s"] or 0.0)
        ax.axvspan(f["at_s"], max(end, f["at_s"] + 0.5), color="tab:orange", alpha=0.3)
        ax.text(f["at_s"], 1.0, f["kind"].removeprefix("kill_"), transform=ax.get_xaxis_transform(),
                fontsize=7, va="top", rotation=90)  # fmt: skip
    ax.set_xlabel("seconds from the start (shaded: kill -> cluster whole again)")
    ax.set_ylabel("TTFT, s")
    ax.legend(loc="upper right", fontsize=8)
    c = report["config"]
    title = (
        f"tandem bench soak: {c['model']} {c['num_prefill']}P{c['num_decode']}D, seed {c['seed']}"
    )
    save_chart(fig, title, path)
