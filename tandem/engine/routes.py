"""Which kernel computes each linear product on CPU: chosen by measurement, once per machine.

A linear layer's product of n rows can take several routes on CPU: the native few-row products
(`row_gemm` for float weights, `quant_gemm` for int4 / int8 tiles), torch's GEMM (`f_linear`, or
`matmul`: weight @ x.T), torch's packed weight-only kernels (`torch_packed`), dequantize then
GEMM (`dequant`), and bfloat16 products through float32 (`f_linear_fp32`, `dequant_fp32`: torch's
bfloat16 GEMM crawls on CPUs without AVX-512 BF16). Which is fastest depends on the CPU, the
native kernels' ISA level, torch's build, the thread count, the layer's shape and the rows, so
no threshold tuned on one CPU holds on another. At engine load `bind` gives every layer shape
class one route per row bucket (`ROW_BUCKETS`), from this machine's table: a JSON file under
`$TANDEM_HOME/routes/` named by the machine's identity (CPU vendor, family, model, stepping and
ISA flags, the native kernels' level and build, torch's version and its own kernels' level, the
thread count). A shape class the table lacks is measured there and then, under a file lock, so
the processes of a cluster on one machine all read one table, and disaggregated output cannot
differ from offline output by route: each candidate is timed on the layer's own weights (median
of at least 5 calls, after one to warm up), and replaces the default route only when at least
10% faster.

Exactness restricts the candidates; it is not traded for speed. In a bfloat16 model, products of
up to `INVARIANT_ROWS` rows (decode and speculative verification steps) take only routes whose
result for a row does not depend on the other rows (`row_gemm`, `quant_gemm`), so a token
verified among drafts scores bit for bit as the decode step would.

`ModelSettings.kernel_routes` picks the policy: "auto" (the table, measuring what it lacks),
"probe" (measure the model's shapes again and rewrite them), "default" (no table: the defaults,
which are the routes measured on the AVX-512 BF16 machine before this table existed), or a route's
name, forced wherever a layer has it (tests pin routes that way).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tandem.config import KERNEL_ROUTE_NAMES, tandem_home

log = logging.getLogger(__name__)

# A product of n rows takes the first bucket whose bound is >= n, the last bucket beyond it; each
# bucket is measured at its bound (the last one at LONG_ROWS: a prompt's chunk).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 128)
LONG_ROWS = 256
INVARIANT_ROWS = 16  # bfloat16 rows up to which routes must be row-invariant
ROW_GEMM_MAX_ROWS = 32  # row_gemm reads the weights once per 8 rows: never a candidate beyond
INVARIANT = frozenset({"row_gemm", "quant_gemm"})
# Routes of each kind of layer, in order of preference among equals.
CANDIDATES = {
    "float32": ("row_gemm", "matmul", "f_linear"),
    "bfloat16": ("row_gemm", "f_linear", "f_linear_fp32"),
    "int8": ("quant_gemm", "torch_packed", "dequant", "dequant_fp32"),
    "int4": ("quant_gemm", "torch_packed", "dequant", "dequant_fp32"),
}
ROUTE_NAMES = frozenset(KERNEL_ROUTE_NAMES)
assert all(name in ROUTE_NAMES for names in CANDIDATES.values() for name in names)
MIN_GAIN = 0.10  # a measured route replaces the default when at least this much faster
REPEATS = 5
GIVE_UP = 3.0  # a candidate whose first call is this much slower than the quickest is dropped
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def bucket_rows() -> tuple[int, ...]:
    """The rows each bucket is measured at."""
    return (*ROW_BUCKETS, LONG_ROWS)


def bucket_of(rows: int) -> int:
    """The index of the bucket that takes `rows`."""
    return min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS))


def default_route(kind: str, rows: int) -> str:
    """The route of `rows` rows when nothing was measured."""
    if kind == "float32":
        return "matmul" if rows <= 2 else "row_gemm" if rows <= ROW_GEMM_MAX_ROWS else "f_linear"
    if kind == "bfloat16":
        return "row_gemm" if rows <= INVARIANT_ROWS else "f_linear"
    limit = 32 if kind == "int8" else 128  # torch's packed kernels used to run up to these
    return "quant_gemm" if rows <= limit else "dequant"


def default_of(kind: str, rows: int, options: list[str]) -> str:
    """`default_route`, or the first of `options` where the layer lacks it."""
    default = default_route(kind, rows)
    return default if default in options else options[0]


def candidates(kind: str, rows: int, exact: bool, available: frozenset[str]) -> list[str]:
    """The routes a product of `rows` rows may take; `exact`: a bfloat16 model's."""
    names = [n for n in CANDIDATES[kind] if n in available]
    if rows > ROW_GEMM_MAX_ROWS:
        names = [n for n in names if n != "row_gemm"]
    invariant = [n for n in names if n in INVARIANT]
    if exact and rows <= INVARIANT_ROWS and invariant:  # none without the native library
        return invariant
    return names


@dataclass(frozen=True)
class RouteSet:
    """A layer's route for each row bucket."""

    names: tuple[str, ...]

    def route(self, rows: int) -> str:
        return self.names[bucket_of(rows)]

    def describe(self) -> str:
        """e.g. "1-16 row_gemm, 17-128 f_linear, 129+ f_linear_fp32"."""
        parts, start = [], 1
        for i, name in enumerate(self.names):
            last = i + 1 == len(self.names) or self.names[i + 1] != name
            if last:
                end = ROW_BUCKETS[i] if i < len(ROW_BUCKETS) else None
                span = f"{start}-{end}" if end is not None and end != start else str(start)
                parts.append(f"{span if end is not None else f'{start}+'} {name}")
                start = (end or 0) + 1
        return ", ".join(parts)


class Routed(Protocol):
    """A layer whose products can take routes: the kind and shape that key its table entry, the
    routes it holds, and each route as a call on its weights ([rows, in] -> [rows, out], rows in
    `activation_dtype`); `set_routes` binds them (and frees what no route of it reads)."""

    chosen: RouteSet | None

    @property
    def route_kind(self) -> str | None: ...

    @property
    def shape_key(self) -> str: ...

    @property
    def activation_dtype(self) -> torch.dtype: ...

    @property
    def in_features(self) -> int: ...

    def available_routes(self) -> frozenset[str]: ...

    def route_call(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def set_routes(self, chosen: RouteSet) -> None: ...

    def read_bytes(self, rows: int) -> int: ...


def machine_identity(num_threads: int | None = None) -> dict[str, str]:
    """What a route table holds for: the CPU, the native kernels (their level and build: changed
    kernels are measured again), torch, the threads."""
    from tandem.engine import native

    fields: dict[str, str] = {}
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("vendor_id", "cpu family", "model", "stepping", "model name"):
                fields.setdefault(key, value)
            elif key == "flags":
                flags = set(value.split())
            if key == "processor" and fields:
                break  # the first CPU's fields
    fields["isa_flags"] = " ".join(f for f in ISA_FLAGS if f in flags)
    fields["native_level"] = native.level_in_use()
    fields["native_build"] = native.build_in_use()
    fields["torch"] = torch.__version__
    fields["torch_cpu"] = torch.backends.cpu.get_cpu_capability()  # its kernels' level
    fields["threads"] = str(num_threads or torch.get_num_threads())
    return fields


def table_path(identity: Mapping[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(dict(identity), sort_keys=True).encode()).hexdigest()
    return tandem_home() / "routes" / f"{digest[:16]}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_table(path: Path, identity: Mapping[str, str]) -> dict[str, dict]:
    """The table's entries (shape key -> {"routes": [...], "us": {...}}), or none where the file
    is missing, corrupt (logged) or for another identity."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("route table %s unreadable (%s): measuring again", path, e)
        return {}
    if not isinstance(data, dict) or data.get("identity") != dict(identity):
        log.warning("route table %s is for another machine: measuring again", path)
        return {}
    entries = data.get("shapes")
    if not isinstance(entries, dict) or not all(_valid_entry(e) for e in entries.values()):
        log.warning("route table %s holds malformed entries: measuring again", path)
        return {}
    return entries


def _valid_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    names = entry.get("routes")
    return (
        isinstance(names, list)
        and len(names) == len(bucket_rows())
        and all(n in ROUTE_NAMES for n in names)
    )


def write_table(path: Path, identity: Mapping[str, str], entries: Mapping[str, dict]) -> None:
    data = {"identity": dict(identity), "buckets": list(bucket_rows()), "shapes": dict(entries)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _medians_us(
    calls: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor
) -> dict[str, float]:
    """The median time of each call on `x` in microseconds: one call each to warm up, then
    REPEATS rounds of one call each, interleaved (a machine whose speed drifts, or that other work
    shares, slows every candidate alike). A candidate whose warm-up took over GIVE_UP times the
    quickest one's cannot win and is not timed further (infinity)."""
    with torch.inference_mode():
        warm: dict[str, float] = {}
        for name, call in calls.items():
            start = time.perf_counter()
            call(x)
            warm[name] = time.perf_counter() - start
        quickest = min(warm.values())
        timed = [name for name in calls if warm[name] <= GIVE_UP * quickest]
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(REPEATS):
            for name in timed:
                start = time.perf_counter()
                calls[name](x)
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(times[n]) * 1e6 if n in times else float("inf") for n in calls}


def measure(layer: Routed, exact: bool) -> dict:
    """A table entry for `layer`'s shape class: per bucket the default, replaced by the fastest
    candidate where it is at least MIN_GAIN faster; the medians in microseconds beside it."""
    kind = layer.route_kind
    assert kind is not None
    available = layer.available_routes()
    gen = torch.Generator().manual_seed(0)
    names: list[str] = []
    timings: dict[str, dict[str, float]] = {}
    for rows in bucket_rows():
        options = candidates(kind, rows, exact, available)
        default = default_of(kind, rows, options)
        x = torch.randn(rows, layer.in_features, generator=gen).to(layer.activation_dtype)
        times = _medians_us({name: layer.route_call(name) for name in options}, x)
        fastest = min(times, key=lambda n: times[n])
        chosen = fastest if times[fastest] <= (1 - MIN_GAIN) * times[default] else default
        names.append(chosen)
        timings[str(rows)] = {n: round(t, 1) for n, t in times.items() if t != float("inf")}
    return {"routes": names, "us": timings}


def bind(layers: list[Routed], policy: str, exact: bool) -> None:
    """Give every layer its routes under `policy` (the module docstring); layers on other devices
    or of dtypes without routes (route_kind None) keep their fallback."""
    layers = [layer for layer in layers if layer.route_kind is not None]
    if not layers:
        return
    if policy == "default" or policy in ROUTE_NAMES:
        for layer in layers:
            kind, available = layer.route_kind, layer.available_routes()
            assert kind is not None
            names = []
            for rows in bucket_rows():
                options = candidates(kind, rows, exact, available)
                names.append(policy if policy in options else default_of(kind, rows, options))
            layer.set_routes(RouteSet(tuple(names)))
        return
    identity = machine_identity()
    path = table_path(identity)

    def key_of(layer: Routed) -> str:  # a shape class, and whether exactness restricted it
        return f"{layer.shape_key}{' exact' if exact else ''}"

    with _locked(path):
        entries = read_table(path, identity)
        measured: set[str] = set()
        for layer in layers:
            key = key_of(layer)
            if key not in measured and (policy == "probe" or key not in entries):
                entries[key] = measure(layer, exact)
                measured.add(key)
        if measured:
            write_table(path, identity, entries)
    seen: dict[str, str] = {}
    for layer in layers:
        chosen = RouteSet(tuple(entries[key_of(layer)]["routes"]))
        layer.set_routes(chosen)
        seen[key_of(layer)] = chosen.describe()
    log.info(
        "kernel routes (%s, table %s):\n  %s",
        identity["native_level"],
        path,
        "\n  ".join(f"{key}: {text}" for key, text in seen.items()),
    )


def describe(products: list[Routed]) -> dict[str, str]:
    """Shape class -> its routes by row bucket, for the products that have routes."""
    found: dict[str, str] = {}
    for product in products:
        if product.chosen is not None:
            found.setdefault(product.shape_key, product.chosen.describe())
    return found
