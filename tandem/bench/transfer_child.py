"""The child processes of `tandem bench transfer`: each builds one side (a channel's receiver or
sender, the decode or prefill worker) and runs the methods its parent sends, one call at a time
over a pipe; the parent's `Child` handle puts a deadline on each call.

The children are not daemonic: a worker of several tensor-parallel ranks spawns its ranks, which a
daemonic process may not. So the parent closes each child whatever fails (`transfer.py` holds them
in an exit stack): `Child.close` closes the side and joins the process, terminating it if it does
not exit in time; a child whose parent dies sees its pipe close and exits."""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from typing import Any

import torch

from tandem.bench.common import BenchError, passive_omp
from tandem.bench.transfer_channels import ChannelReceiver, ChannelSender
from tandem.bench.transfer_config import CALL_TIMEOUT_S, TransferBenchConfig
from tandem.bench.transfer_workers import DecodeSide, PrefillSide

_SIDES: dict[str, Any] = {
    "channel_receiver": ChannelReceiver,
    "channel_sender": ChannelSender,
    "decode": DecodeSide,
    "prefill": PrefillSide,
}


def _child_main(
    conn: Connection, side: str, config: TransferBenchConfig, device: str, args: tuple[Any, ...]
) -> None:
    """A child process: build one side, then run the methods the parent sends, one at a time."""
    torch.set_num_threads(config.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        obj = _SIDES[side](config, device, *args)
        conn.send(("ok", obj.info()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, margs = conn.recv()
        except EOFError:  # the parent is gone
            obj.close()
            return
        try:
            if method == "close":
                obj.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(obj, method)(*margs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Child:
    """The parent's handle on a spawned side: one call at a time, each with a deadline."""

    def __init__(
        self,
        ctx: SpawnContext,
        name: str,
        side: str,
        config: TransferBenchConfig,
        device: str,
        *args: Any,
    ) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main,
            args=(child_conn, side, config, device, args),
            name=name,
            daemon=False,  # it may spawn tensor-parallel ranks; `close` ends it
        )
        with passive_omp():
            self.process.start()
        child_conn.close()

    def send(self, method: str, *args: Any) -> None:
        self.conn.send((method, args))

    def result(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise BenchError(f"{self.name}: no answer within {timeout_s:.0f} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise BenchError(f"{self.name} died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise BenchError(f"{self.name}: {value}")
        return value

    def call(self, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self.send(method, *args)
        return self.result(timeout_s)

    def close(self) -> None:
        """Ask the side to close, then join the process; terminate it if it does not exit."""
        try:
            self.conn.send(("close", ()))
            if self.conn.poll(30):
                self.conn.recv()
        except (OSError, EOFError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self.conn.close()
