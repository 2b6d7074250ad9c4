"""`tandem scale|status|drain`: the router's admin API (gRPC), for operators."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from tandem.cli.options import console

RouterOpt = Annotated[str, typer.Option(help="The router's gRPC address.")]
TokenOpt = Annotated[str | None, typer.Option(help="Admin token.")]


def _admin(router: str, token: str | None) -> tuple[Any, list[tuple[str, str]]]:
    import grpc

    from tandem.v1 import admin_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(router)), metadata


def _admin_call(fn: Any, request: Any, metadata: list[tuple[str, str]]) -> Any:
    import grpc

    try:
        return fn(request, metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        console.print(f"[red]{e.code().name}:[/red] {e.details()}")
        raise typer.Exit(1) from None


def scale(
    prefill: Annotated[int | None, typer.Option(help="Prefill pool size.")] = None,
    decode: Annotated[int | None, typer.Option(help="Decode pool size.")] = None,
    router: RouterOpt = "127.0.0.1:50051",
    token: TokenOpt = None,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the pools, then print what is not placed.")
    ] = 10.0,
) -> None:
    """Set the size of the prefill and/or decode pool (scale-down drains); then wait up to
    --wait seconds for the pools to serve at that size, and print the workers still not
    running with the reason (a worker infeasible on this cluster ends the wait at once)."""
    from tandem.cli.status_view import controller_lines, controller_rows
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    asked = time.time()
    reply = _admin_call(
        stub.Scale, admin_pb2.ScaleRequest(prefill=prefill, decode=decode), metadata
    )
    console.print(f"desired: {reply.prefill} prefill, {reply.decode} decode")
    desired = {"prefill": reply.prefill, "decode": reply.decode}
    deadline = time.monotonic() + wait
    while True:
        workers = _admin_call(stub.ListWorkers, admin_pb2.ListWorkersRequest(), metadata)
        controller = controller_rows(workers)
        controller["events"] = [e for e in controller["events"] if e["time_unix"] >= asked]
        if _placed(workers, desired) or time.monotonic() >= deadline or _infeasible(controller):
            break
        time.sleep(0.5)
    if controller["pending"] or controller["events"]:
        console.print("not serving yet:")
    for line in controller_lines(controller):
        console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)


def _placed(reply: Any, desired: dict[str, int]) -> bool:
    """Every pool serves at its desired size, nothing pending."""
    serving = [w.role for w in reply.workers if not w.draining]
    return not reply.pending and all(serving.count(r) == n for r, n in desired.items())


def _infeasible(controller: dict[str, list[dict[str, Any]]]) -> bool:
    """Some placement cannot happen on this cluster: waiting longer shows nothing new."""
    return any(p["reason"].startswith("infeasible") for p in controller["pending"])


def status(
    router: RouterOpt = "127.0.0.1:50051",
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="The rows as JSON on stdout.")] = False,
) -> None:
    """The workers of the cluster: role, endpoint, load, KV usage; then the workers not started
    yet (pending, with the reason) and the controller's errors. A table on a terminal, plain
    columns in a pipe, JSON with --json."""
    from tandem.cli.status_view import (
        controller_lines,
        controller_rows,
        print_rows,
        rows_json,
        worker_rows,
    )
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    reply = _admin_call(stub.ListWorkers, admin_pb2.ListWorkersRequest(), metadata)
    rows, controller = worker_rows(reply.workers), controller_rows(reply)
    if as_json:
        typer.echo(rows_json(rows, controller))
        return
    print_rows(rows, console)
    for line in controller_lines(controller):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def drain(
    worker: Annotated[str, typer.Argument(help="Worker id (see `tandem status`).")],
    router: RouterOpt = "127.0.0.1:50051",
    token: TokenOpt = None,
) -> None:
    """Drain one worker: it finishes its requests and leaves; the pool replaces it."""
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    _admin_call(stub.Drain, admin_pb2.DrainRequest(worker_id=worker), metadata)
    console.print(f"draining {worker}")
