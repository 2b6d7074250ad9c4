"""What `tandem bench quant` runs: the weight formats, speculation modes and llama.cpp side it
compares, the issue's targets, and its config (`QuantBenchConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.config import DEFAULT_MODEL, KV_CACHE_DTYPES, QUANT_GROUP_SIZES, QUANT_METHODS
from tandem.data import SPECBENCH_CATEGORIES, SPECBENCH_PATH

FP32, BF16 = "fp32", "bf16"
FORMATS = (FP32, BF16, *QUANT_METHODS)
SPEC_OFF, NGRAM = "off", "ngram"
SPECS = (SPEC_OFF, NGRAM)
LLAMA_CPP = "llama.cpp"
INSTALL_HINT = "pip install -e '.[bench-ref]' (compiles llama.cpp, ~5 minutes)"

# Targets from issue 27 (thresholds, not measurements).
TARGET_INT8_VS_BF16 = 1.6
TARGET_INT4_VS_BF16 = 2.0
TARGET_INT4_VS_LLAMA_CPP = 1.0
TARGET_OF_ROOFLINE = {FP32: 0.7, BF16: 0.7, "int8": 0.7, "int4": 0.5}
TARGET_OF_KERNEL_FLOOR = {FP32: 0.85, BF16: 0.85, "int8": 0.85, "int4": 0.85}
TARGET_BATCH_VS_BF16 = 1.0  # each quantized format at the largest batch
TARGET_KV_INT8_OF_BF16 = 0.55  # at most


@dataclass(frozen=True)
class QuantBenchConfig:
    model: str = DEFAULT_MODEL
    formats: tuple[str, ...] = FORMATS
    group_size: int = 32  # int4
    kv_cache_dtype: str = "auto"  # of every Tandem engine: "auto" (bfloat16) | "int8" | "fp8"
    num_speculative_tokens: int = 5
    batch_sizes: tuple[int, ...] = (1, 16)
    prompts: int = 3  # batch-1 prompts per round, one at a time
    new_tokens: int = 128
    rounds: int = 3
    threads: int = 2
    device: str = "cpu"
    block_size: int = 16
    kernel_steps: int = 30  # batch-1 steps of the linear layers per kernel-floor sample
    bandwidth_mib: int = 1024  # float32 tensor summed to measure read bandwidth
    llama_cpp: bool = True
    seed: int = 0
    warmup: bool = True  # one short unmeasured run of every side first
    categories: tuple[str, ...] = ("summarization", "rag")
    prompts_path: str = str(SPECBENCH_PATH)

    def __post_init__(self) -> None:
        unknown = set(self.formats) - set(FORMATS)
        if unknown or not self.formats:
            raise ValueError(f"formats must be among {list(FORMATS)}, got {list(self.formats)}")
        if self.group_size not in QUANT_GROUP_SIZES:
            raise ValueError(
                f"group_size must be one of {list(QUANT_GROUP_SIZES)}, got {self.group_size}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (decode needs two), got {self.new_tokens}")
        if self.bandwidth_mib < 16:
            raise ValueError(f"bandwidth_mib must be >= 16, got {self.bandwidth_mib}")
        for name in ("num_speculative_tokens", "prompts", "rounds", "threads", "kernel_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if set(self.categories) - set(SPECBENCH_CATEGORIES) or not self.categories:
            raise ValueError(f"categories must be among {list(SPECBENCH_CATEGORIES)}")

    def quick(self) -> QuantBenchConfig:
        """A check that the whole pipeline works, not a measurement."""
        return replace(
            self,
            batch_sizes=(1, 2),
            prompts=1,
            new_tokens=min(self.new_tokens, 8),
            rounds=1,
            kernel_steps=3,
            bandwidth_mib=64,
            warmup=False,
        )
