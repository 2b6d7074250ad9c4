"""`tandem status` against a real router (gRPC on loopback) over an embedded registry that lists
two workers with long ids: `--json` gives every row, and neither a pipe nor an 80-column
terminal truncates a name (both get plain columns; a terminal wide enough, a table)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from router.router_server import RouterAddress, RouterServer
from tandem.cli import app
from tandem.cli.status_view import print_rows
from tandem.config import RouterConfig
from tandem.registry import Registry, WorkerRecord

pytestmark = pytest.mark.timeout(60)

PREFILL = "prefill-" + "p" * 40 + "-end"
DECODE = "decode-" + "d" * 40 + "-end"


def record(worker_id: str, role: str, model: str, port: int) -> WorkerRecord:
    now = time.time()
    return WorkerRecord(
        worker_id, role, model, f"127.0.0.1:{port}", "", "", 100, 25, 2, 1, False, (), now, now
    )


@pytest.fixture(scope="module")
def router(tiny_llama_path: Path) -> Iterator[RouterAddress]:
    model = str(tiny_llama_path)
    with Registry() as registry:
        registry.register(record(PREFILL, "prefill", model, 1), ttl_s=300)
        registry.register(record(DECODE, "decode", model, 2), ttl_s=300)
        server = RouterServer(RouterConfig(model), registry.url, http_port=0, grpc_port=0)
        try:
            yield server.start()
        finally:
            server.stop()


def test_status_json_lists_every_worker(router: RouterAddress) -> None:
    result = CliRunner().invoke(app, ["status", "--router", router.grpc_target, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["workers"]
    assert [(r["worker_id"], r["role"]) for r in rows] == [(DECODE, "decode"), (PREFILL, "prefill")]
    decode = rows[0]
    assert decode["endpoint"] == "127.0.0.1:2"
    assert (decode["running"], decode["waiting"], decode["state"]) == (2, 1, "serving")
    assert decode["kv_used"] == pytest.approx(0.75)
    assert decode["ttft_p50_s"] is None  # no /metrics to read


def test_status_in_a_pipe_prints_whole_names_one_line_per_worker(router: RouterAddress) -> None:
    command = ["status", "--router", router.grpc_target]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, command)
    assert result.exit_code == 0, result.output
    header, *lines = result.stdout.splitlines()
    assert header.split()[:3] == ["worker", "role", "endpoint"]
    assert [line.split()[:3] for line in lines] == [
        [DECODE, "decode", "127.0.0.1:2"],
        [PREFILL, "prefill", "127.0.0.1:1"],
    ]
    assert "75%" in lines[0] and "serving" in lines[0]


@pytest.mark.parametrize(
    ("width", "first_cells"),
    [(80, [[DECODE, "decode"], [PREFILL, "prefill"]]), (200, [["│", DECODE], ["│", PREFILL]])],
    ids=["narrow: plain columns", "wide: a table"],
)
def test_a_terminal_never_truncates_names(
    router: RouterAddress, width: int, first_cells: list[list[str]]
) -> None:
    result = CliRunner().invoke(app, ["status", "--router", router.grpc_target, "--json"])
    out = io.StringIO()
    terminal = Console(file=out, width=width, force_terminal=True, color_system=None)
    print_rows(json.loads(result.stdout)["workers"], terminal)
    lines = out.getvalue().splitlines()
    assert not any("…" in line for line in lines)
    assert [line.split()[:2] for line in lines if "-end" in line] == first_cells


class Remote:
    """A Ray actor method as the router calls it: `.remote()` gives something to await."""

    def __init__(self, value: object) -> None:
        self.value = value

    def remote(self, *args: object) -> Any:
        async def result() -> object:
            return self.value

        return result()


class ControllerDouble:
    """Test double of the Ray pool controller's actor handle (tests/ray test the controller):
    one decode worker pending for want of CPUs, one placement dropped earlier."""

    REASON = "infeasible on this cluster: needs CPU 64, the cluster has CPU 2"

    def __init__(self) -> None:
        slots = [
            {"role": "decode", "worker_id": "", "state": "pending", "reason": self.REASON,
             "age_s": 12.0},
            {"role": "prefill", "worker_id": PREFILL, "state": "serving", "reason": "",
             "age_s": 99.0},
        ]  # fmt: skip
        error = f"dropped a decode worker not placed in 300 s: {self.REASON}"
        self.status = Remote(slots)
        self.recent_events = Remote([{"time": 0.0, "role": "decode", "error": error}])
        self.scale = Remote({"prefill": 1, "decode": 2})


@pytest.fixture(scope="module")
def controlled_router(tiny_llama_path: Path) -> Iterator[str]:
    """A router whose controller is the double: its gRPC target."""
    with Registry() as registry:
        config = RouterConfig(str(tiny_llama_path))
        server = RouterServer(
            config, registry.url, http_port=0, grpc_port=0, controller=ControllerDouble()
        )
        try:
            yield server.start().grpc_target
        finally:
            server.stop()


def test_scale_prints_the_worker_it_could_not_place_with_the_reason(controlled_router: str) -> None:
    command = ["scale", "--decode", "2", "--router", controlled_router, "--wait", "60"]
    started = time.monotonic()
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, command)
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 30  # infeasible: no point waiting the whole minute
    lines = result.stdout.splitlines()
    assert lines[:2] == ["desired: 1 prefill, 2 decode", "not serving yet:"]
    assert lines[2] == f"  decode worker pending for 12 s: {ControllerDouble.REASON}"
    assert len(lines) == 3  # the event recorded before this scale is not repeated


def test_status_shows_pending_workers_with_their_reason_and_the_controllers_errors(
    controlled_router: str,
) -> None:
    target = controlled_router
    result = CliRunner().invoke(app, ["status", "--router", target, "--json"])
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    assert reply["pending"] == [
        {"role": "decode", "state": "pending", "reason": ControllerDouble.REASON,
         "age_s": 12.0},
    ]  # fmt: skip
    assert [e["role"] for e in reply["events"]] == ["decode"]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["status", "--router", target])
    lines = result.stdout.splitlines()
    assert f"decode worker pending for 12 s: {ControllerDouble.REASON}" in lines
    assert lines[-1].startswith("error at ") and "dropped a decode worker" in lines[-1]
