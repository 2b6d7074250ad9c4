"""The one frozen config tree, built once at the entry point (CLI, tests, offline API).

`EngineConfig` (model, cache, scheduler, speculative decoding) is what an engine runs;
`WorkerConfig` adds a worker's address, registry and KV transfer (`TransferConfig`);
`RouterConfig` is the router's. Derived values are properties. Environment variables are read
(and written) here and nowhere else. Torch-free: the router imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Model dtype names; their torch dtypes are in tandem/engine/dtypes.py (this module is torch-free).
DTYPES = ("float32", "bfloat16", "float16")
# Quantized KV cache formats (tandem/engine/kv_quant.py); "auto" keeps the model dtype.
KV_CACHE_DTYPES = ("int8", "fp8")
# Weight-only quantization of the decoder's linear layers (tandem/engine/quant/), and the
# int4 group sizes torch's int4 kernels take.
QUANT_METHODS = ("int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128, 256)
# How the CPU products of linear layers pick their kernels (tandem/engine/routes.py): a policy,
# or one route forced wherever a layer has it.
KERNEL_ROUTE_POLICIES = ("auto", "probe", "default")
KERNEL_ROUTE_NAMES = (
    "row_gemm",
    "matmul",
    "f_linear",
    "f_linear_fp32",
    "quant_gemm",
    "torch_packed",
    "dequant",
    "dequant_fp32",
)
# Attention over the paged cache (tandem/engine/attention.py): "auto" takes the Triton kernels on
# CUDA where they apply and SDPA elsewhere.
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
DEFAULT_MODEL = "smollm2-135m"
# Every gRPC channel and server of the cluster: a KV chunk or a long prompt fits in one message.
GRPC_MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
]


# Instruction-set levels of the native CPU kernels, lowest first (tandem/engine/native.py); "amx"
# has no kernels of its own and caps like avx512bf16.
NATIVE_ISA_LEVELS = ("generic", "avx2", "avx512", "avx512bf16", "amx")


def native_isa_cap() -> str | None:
    """The highest level the native kernels may use (`$TANDEM_NATIVE_ISA`), None for the CPU's
    own: so that the AVX2 kernels run, and are tested, on an AVX-512 machine too."""
    cap = os.environ.get("TANDEM_NATIVE_ISA") or None
    if cap is not None and cap not in NATIVE_ISA_LEVELS:
        raise ValueError(
            f"TANDEM_NATIVE_ISA must be one of {'|'.join(NATIVE_ISA_LEVELS)}, got {cap!r}"
        )
    return cap


def tandem_home() -> Path:
    """Where Tandem keeps downloaded models and caches (`$TANDEM_HOME`, default ~/.cache/tandem)."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def torch_extensions_dir() -> Path:
    """Where torch builds C++ extensions (`$TORCH_EXTENSIONS_DIR`, as torch's own default)."""
    return Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )


def cpu_attention_kernel() -> bool:
    """Whether CPU attention may take the native kernel (`$TANDEM_CPU_ATTENTION=sdpa`: never)."""
    return os.environ.get("TANDEM_CPU_ATTENTION", "kernel") != "sdpa"


def api_key_from_environment() -> str | None:
    """The key the router's public APIs require (`$TANDEM_API_KEY`); None, unset or empty: open.
    An environment variable keeps the key out of the process list, where a flag would show it."""
    return os.environ.get("TANDEM_API_KEY") or None


FAULT_PREFILL_STEP_DELAY = "TANDEM_FAULT_PREFILL_STEP_DELAY_S"
FAULT_KV_TRAILER_DELAY = "TANDEM_FAULT_KV_TRAILER_DELAY_S"


def fault_prefill_step_delay_s() -> float:
    """Fault injection, for tests only: seconds each prefill worker's engine step is held up
    (`$TANDEM_FAULT_PREFILL_STEP_DELAY_S`; unset or 0: none), so that a prefill slowed past its
    transfer's deadline stays covered on a machine fast enough never to miss one."""
    return _fault_seconds(FAULT_PREFILL_STEP_DELAY)


def fault_kv_trailer_delay_s() -> float:
    """Fault injection, for tests only: seconds a prefill worker holds back each KV transfer's
    trailer (the first token) once its layers went out (`$TANDEM_FAULT_KV_TRAILER_DELAY_S`;
    unset or 0: none): a transfer that stalls half-way, with the engine loop running on."""
    return _fault_seconds(FAULT_KV_TRAILER_DELAY)


def _fault_seconds(name: str) -> float:
    value = os.environ.get(name) or "0"
    try:
        delay = float(value)
    except ValueError:
        raise ValueError(f"{name} must be seconds, got {value!r}") from None
    if delay < 0:
        raise ValueError(f"{name} must be >= 0, got {delay}")
    return delay


def put_python_bin_on_path() -> None:
    """Let this process's children find the tools installed beside its Python (ninja)."""
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


# A launcher's pid, set in its child's environment (tandem/cluster/lifetime.py die_with_parent)
PARENT_PID_ENV = "TANDEM_DIE_WITH_PARENT"


def take_parent_pid() -> int | None:
    """The launcher's pid a child was started with, taken out of the environment so that this
    process's own children do not take it for theirs."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    return None if value is None else int(value)


def child_environment(**defaults: str) -> dict[str, str]:
    """This process's environment for a child, with `defaults` where it sets nothing."""
    return {**defaults, **os.environ}


def take_environment(env: Mapping[str, str]) -> None:
    """Make `env` this process's whole environment (a forked child takes its launcher's of the
    moment: tandem/engine/tp/ranks.py)."""
    os.environ.clear()
    os.environ.update(env)


@contextmanager
def environment_defaults(**defaults: str) -> Iterator[None]:
    """Within the block, variables of `defaults` that are unset take those values (for the child
    processes started meanwhile, e.g. OMP_WAIT_POLICY=PASSIVE); unset again after it."""
    added = [key for key in defaults if key not in os.environ]
    os.environ.update({key: defaults[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@dataclass(frozen=True)
class ModelSettings:
    model: str = DEFAULT_MODEL  # catalogue name, HF directory or .gguf path
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    engine: str = "real"  # "real" | "sim" (tandem/engine/sim.py: modelled step times)
    sim_profile: str | None = None  # sim: a profile JSON (`tandem bench calibrate`); None: zero
    quantization: str | None = None  # weights of the linear layers: "int8" | "int4" | None
    quant_group_size: int = 32  # int4: input channels per scale and zero (halved where it does
    # not divide a layer's input size: SmolLM2's 576 takes 64 for 128)
    kernel_routes: str = "auto"  # CPU: KERNEL_ROUTE_POLICIES or a route of KERNEL_ROUTE_NAMES
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    cuda_graphs: bool = True  # CUDA + Triton attention: decode / verify steps replay graphs
    # Ranks the model is sharded over (tandem/engine/tp/): processes on this host, rank 0 this one
    tensor_parallel_size: int = 1
    # A collective that a rank does not join within this time fails the step on the other ranks
    tp_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.engine != "real":
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs engine='real' "
                f"(the simulated engine models one device), got {self.engine!r}"
            )
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.engine not in ("real", "sim"):
            raise ValueError(f"engine must be 'real' or 'sim', got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANT_METHODS:
            raise ValueError(
                f"quantization must be one of {list(QUANT_METHODS)} or None, "
                f"got {self.quantization!r}"
            )
        if self.kernel_routes not in KERNEL_ROUTE_POLICIES + KERNEL_ROUTE_NAMES:
            raise ValueError(
                f"kernel_routes must be one of {list(KERNEL_ROUTE_POLICIES)} or a route of "
                f"{list(KERNEL_ROUTE_NAMES)}, got {self.kernel_routes!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(
                f"quant_group_size must be one of {list(QUANT_GROUP_SIZES)}, "
                f"got {self.quant_group_size}"
            )

    @property
    def cpu_threads(self) -> int | None:
        """torch intra-op threads of each of the engine's processes on CPU: `num_threads`, else
        with tensor parallelism the host's cores shared among the ranks (each rank's default of
        all cores would oversubscribe them N times), else None (torch's default)."""
        if self.num_threads is not None or self.tensor_parallel_size == 1:
            return self.num_threads
        return max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    memory_gib: float = 1.0  # KV cache budget when num_blocks is not given
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8" | "fp8" (e4m3)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # running requests at most
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" (lower value first, then arrival)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


# `grammar`: no proposer; the only drafts are the tokens a structured output's grammar forces
# (engine/grammar.py), so a request with `speculative` false is the same request without them
SPEC_METHODS = ("ngram", "draft", "layerskip", "medusa", "eagle", "grammar")
# The field each method needs: its argument in `METHOD:ARG` (parse_speculative)
SPEC_ARGUMENTS = {
    "draft": "draft_model",
    "layerskip": "num_layers",
    "medusa": "path",
    "eagle": "path",
}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding; `method=None` turns it off."""

    method: str | None = None  # one of SPEC_METHODS
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None  # draft: catalogue name, HF directory or .gguf path
    num_layers: int | None = None  # layerskip: the target's first N layers draft
    path: str | None = None  # medusa / eagle: directory of the trained heads
    # medusa / eagle heads and draft models saved with a token ranking draft over its first N
    # tokens; 0: the whole vocabulary (spec/draft_vocab.py)
    draft_vocab_size: int = 8192
    # no drafts once this many requests run, fewer as it nears; None: the device's default
    # (spec/adaptive.py: 32 on CUDA, 4 on CPU)
    disable_batch_size: int | None = None
    # draft only as much as the measured step and proposer times pay for (spec/cost.py)
    cost_aware: bool = True

    def __post_init__(self) -> None:
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ValueError(f"disable_batch_size must be >= 1, got {self.disable_batch_size}")
        if self.method not in (None, *SPEC_METHODS):
            raise ValueError(
                f"speculative method must be one of {SPEC_METHODS} or None, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        needs = SPEC_ARGUMENTS.get(self.method or "")
        if needs is not None and getattr(self, needs) is None:
            raise ValueError(f"speculative method {self.method!r} needs {needs!r}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")


def parse_speculative(text: str, **options: Any) -> dict[str, Any]:
    """`METHOD[:ARG]` ("ngram", "layerskip:N", "draft:MODEL", "medusa:DIR", "eagle:DIR"), plus
    further `SpecConfig` fields, as the engine's `speculative` dict; ValueError names what is
    wrong. ARG may instead come in `options` (e.g. `draft_model`)."""
    name, _, arg = text.strip().partition(":")
    spec: dict[str, Any] = {"method": name, **options}
    if name in ("ngram", "grammar"):
        if arg:
            raise ValueError(f"speculative method {text!r}: {name} takes no argument")
    elif name in SPEC_ARGUMENTS:
        field_name = SPEC_ARGUMENTS[name]
        if arg:
            if name == "layerskip" and not arg.isdigit():
                raise ValueError(f"speculative method {text!r}: write layerskip:N, N the layers")
            spec[field_name] = int(arg) if name == "layerskip" else arg
        elif spec.get(field_name) is None:
            raise ValueError(f"speculative method {text!r}: write {name}:{field_name.upper()}")
    else:
        raise ValueError(f"unknown speculative method {text!r}; known: {', '.join(SPEC_METHODS)}")
    SpecConfig(**spec)  # the engine's own checks (k >= 1, num_layers >= 1, ...)
    return spec


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    @classmethod
    def create(
        cls,
        model: str = DEFAULT_MODEL,
        speculative: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> EngineConfig:
        """Flat keyword form (`dtype=`, `block_size=`, `max_num_seqs=`...) routed to its section;
        `speculative={"method": "ngram", "num_speculative_tokens": 5}` as in vLLM (also
        `"draft"` with `"draft_model"`, `"layerskip"` with `"num_layers"`, `"medusa"`/`"eagle"`
        with `"path"`)."""
        sections: dict[str, dict[str, Any]] = {
            "model": {"model": model},
            "cache": {},
            "scheduler": {},
        }
        owners = {
            name: section
            for section, klass in (
                ("model", ModelSettings),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
            )
            for name in klass.__dataclass_fields__
        }
        for key, value in overrides.items():
            if key not in owners:
                raise ValueError(f"unknown engine option {key!r}; known: {sorted(owners)}")
            sections[owners[key]][key] = value
        return cls(
            ModelSettings(**sections["model"]),
            CacheConfig(**sections["cache"]),
            SchedulerConfig(**sections["scheduler"]),
            SpecConfig(**(speculative or {})),
        )


# -- workers and router ------------------------------------------------------------------------

KV_CHANNELS = ("auto", "grpc", "pair", "shm")  # kv_transfer/sender.py
ON_TRANSFER_FAILURE = ("local", "fail")  # decode: prefill the prompt itself, or fail the request
# router/tools.py: how a model writes tool calls; auto: from its chat template
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
ON_PREFILL_FAILURE = ("retry", "local", "fail")  # router: another P once, then local; or ...


@dataclass(frozen=True)
class TransferConfig:
    """How a worker moves KV: the prefill side's channel and streaming, the decode side's
    deadline and what it does when a transfer fails."""

    channel: str = "auto"  # prefill: auto (shared memory on one host, else a pair, else gRPC)
    stream_layers: bool = True  # prefill: send layer l as soon as it is computed
    timeout_s: float = 30.0  # decode: a transfer's deadline
    on_failure: str = "local"  # decode: ON_TRANSFER_FAILURE
    pair_idle_s: float = 300.0  # prefill: a torch.distributed pair idle this long is closed

    def __post_init__(self) -> None:
        if self.channel not in KV_CHANNELS:
            raise ValueError(f"channel must be one of {KV_CHANNELS}, got {self.channel!r}")
        if self.on_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(
                f"on_transfer_failure must be one of {ON_TRANSFER_FAILURE}, got {self.on_failure!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"transfer timeout must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker process: its engine, address, registry and KV transfer."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    registry_url: str | None = None  # None: an embedded Redis of its own
    metrics_port: int | None = 0  # Prometheus; 0: any free port, None: none
    heartbeat_ttl_s: float = 3.0  # the registry forgets a worker this long after its last beat

    def __post_init__(self) -> None:
        mc = self.engine.model
        # A dead rank must fail the steps (and stop the heartbeat) before the registry would
        # forget the worker anyway: its collectives wait at most tp_timeout_s.
        if mc.tensor_parallel_size > 1 and mc.tp_timeout_s >= self.heartbeat_ttl_s:
            raise ValueError(
                f"tp_timeout_s={mc.tp_timeout_s:g} must be below heartbeat_ttl_s="
                f"{self.heartbeat_ttl_s:g} for a worker of tensor_parallel_size="
                f"{mc.tensor_parallel_size}"
            )


@dataclass(frozen=True)
class RouterConfig:
    model: str  # catalogue name, HF directory or .gguf path; also the served model id
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_loaded"
    local_prefill_tokens: int = 32  # prompts this short are prefilled by the decode worker
    on_prefill_failure: str = "retry"  # ON_PREFILL_FAILURE
    max_inflight: int = 256
    max_queue: int = 1024
    timeout_s: float = 600.0  # a request's deadline unless it asks for a shorter one
    # With no decode worker serving, a request (new, or migrating off a dead one) waits this
    # long in the router for a replacement (its deadline bounds the wait too), then UNAVAILABLE;
    # 0: at once. At most `max_decode_waiters` wait; more: RESOURCE_EXHAUSTED.
    decode_wait_s: float = 30.0
    max_decode_waiters: int = 256
    # A decode worker that has sent a request tokens and then nothing at all, on any stream,
    # for this long is treated as dead: its requests resume on another one (router/core.py).
    decode_stall_s: float = 30.0
    max_model_len: int | None = None
    tool_call_parser: str = "auto"  # TOOL_CALL_PARSERS
    # `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and tandem.v1.Tandem (auth.py);
    # None: open. Kept out of repr, so a logged config does not leak it.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("api_key must not be empty (None leaves the APIs open)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}")
        if self.on_prefill_failure not in ON_PREFILL_FAILURE:
            raise ValueError(f"on_prefill_failure must be one of {ON_PREFILL_FAILURE}")
        if self.decode_wait_s < 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {self.decode_wait_s}")
        if self.max_decode_waiters < 0:
            raise ValueError(f"max_decode_waiters must be >= 0, got {self.max_decode_waiters}")
        if not self.decode_stall_s > 0:
            raise ValueError(f"decode_stall_s must be > 0, got {self.decode_stall_s}")
