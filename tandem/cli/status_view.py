"""The rows of `tandem status`, from the admin ListWorkers reply and each worker's /metrics, and
their three renderings: JSON (`--json`), a table on a terminal wide enough for it, and plain
aligned columns otherwise (a pipe, a file, a narrow terminal): one line per worker, whole names.
Below them, one line per worker the cluster controller has not started yet (pending, with its
reason, or starting) and per error event it recorded."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from tandem.cluster.signals import worker_summary

HEADER = (
    "worker", "role", "endpoint", "running", "waiting", "KV used", "p50 TTFT", "p50 TPOT",
    "accept", "state", "beat",
)  # fmt: skip
UNBOUNDED_WIDTH = 100_000  # to measure the table's natural width


def worker_rows(workers: Any) -> list[dict[str, Any]]:
    """One dict per worker (WorkerInfo messages), sorted by role and id; the latencies and the
    draft acceptance rate are None when its /metrics cannot be read or has none yet."""
    rows = []
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        summary = worker_summary(w.metrics_url)
        rows.append(
            {
                "worker_id": w.worker_id,
                "role": w.role,
                "endpoint": w.endpoint,
                "model": w.model,
                "running": w.running,
                "waiting": w.waiting,
                "kv_blocks_total": w.kv_blocks_total,
                "kv_blocks_free": w.kv_blocks_free,
                "kv_used": 1 - w.kv_blocks_free / w.kv_blocks_total if w.kv_blocks_total else 0.0,
                "ttft_p50_s": summary.get("ttft_p50"),
                "tpot_p50_s": summary.get("tpot_p50"),
                "acceptance": summary.get("acceptance"),
                "state": "draining" if w.draining else "serving",
                "heartbeat_age_s": w.heartbeat_age_s,
            }
        )
    return rows


def controller_rows(reply: Any) -> dict[str, list[dict[str, Any]]]:
    """The controller's part of a ListWorkers reply: workers not started yet, error events."""
    return {
        "pending": [
            {"role": p.role, "state": p.state, "reason": p.reason, "age_s": p.age_s}
            for p in reply.pending
        ],
        "events": [
            {"time_unix": e.time_unix, "role": e.role, "error": e.error} for e in reply.events
        ],
    }


def controller_lines(controller: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        f"{p['role']} worker {p['state']} for {p['age_s']:.0f} s: {p['reason']}"
        for p in controller["pending"]
    ]
    for e in controller["events"]:
        at = time.strftime("%H:%M:%S", time.localtime(e["time_unix"]))
        lines.append(f"error at {at}: {e['error']}")
    return lines


def rows_json(rows: list[dict[str, Any]], controller: dict[str, list[dict[str, Any]]]) -> str:
    return json.dumps({"workers": rows, **controller}, indent=2)


def print_rows(rows: list[dict[str, Any]], out: Console) -> None:
    """A table on a terminal that is wide enough for it, else plain columns (which a narrow
    terminal wraps: rich would cut the names to fit)."""
    cells = [_cells(row) for row in rows]
    table = Table(*HEADER)
    for row_cells in cells:
        table.add_row(*row_cells)
    unbounded = out.options.update_width(UNBOUNDED_WIDTH)
    if out.is_terminal and out.measure(table, options=unbounded).maximum <= out.width:
        out.print(table)
        return
    widths = [max(map(len, column)) for column in zip(HEADER, *cells, strict=True)]
    for line in (HEADER, *cells):
        text = "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        out.print(text.rstrip(), soft_wrap=True, markup=False, highlight=False)


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    acceptance = row["acceptance"]
    return (
        row["worker_id"], row["role"], row["endpoint"], str(row["running"]), str(row["waiting"]),
        f"{row['kv_used']:.0%}", _ms(row["ttft_p50_s"]), _ms(row["tpot_p50_s"]),
        f"{acceptance:.0%}" if acceptance is not None else "-", row["state"],
        f"{row['heartbeat_age_s']:.1f}s ago",
    )  # fmt: skip


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"
