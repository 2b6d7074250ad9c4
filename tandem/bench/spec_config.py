"""What `tandem bench spec` runs: the proposers of `--methods`, the prompt groups and reference
sides it reports, BENCHMARKS.md's targets, and its config (`SpecBenchConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.config import DEFAULT_MODEL, DTYPES, parse_speculative
from tandem.data import SPECBENCH_CATEGORIES, SPECBENCH_PATH

GROUPS = {
    "input-grounded": ("summarization", "rag"),
    "chat": SPECBENCH_CATEGORIES[:8],  # MT-bench's eight
    "other": ("translation", "qa", "math_reasoning"),
}
ALL = "all"
NO_SPEC = "no spec"
HF_GREEDY, HF_LOOKUP, HF_ASSISTED = "hf greedy", "hf prompt lookup", "hf assisted"

# Targets from BENCHMARKS.md (thresholds, not measurements).
TARGET_NGRAM_B1_GROUNDED = 2.0  # vs no speculation, and vs transformers prompt lookup
TARGET_MODEL_B1_CHAT = 1.5
TARGET_LARGE_BATCH = 0.95
LARGE_BATCH = 32


@dataclass(frozen=True)
class SpecMethod:
    """One proposer of `--methods`: `ngram`, `layerskip:N`, `draft:MODEL`, `medusa:PATH`,
    `eagle:PATH`."""

    label: str
    speculative: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.speculative["method"])

    @property
    def model_based(self) -> bool:
        return self.name != "ngram"


def parse_method(text: str, num_speculative_tokens: int) -> SpecMethod:
    """The engine's `speculative` settings for one `--methods` entry; ValueError names a bad one."""
    spec = parse_speculative(text, num_speculative_tokens=num_speculative_tokens)
    return SpecMethod(text.strip(), spec)


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str = DEFAULT_MODEL
    methods: tuple[str, ...] = ("ngram",)
    num_speculative_tokens: int = 5
    categories: tuple[str, ...] = SPECBENCH_CATEGORIES
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    prompts_per_category: int = 3  # batch-1 prompts of each category
    new_tokens: int = 128
    rounds: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 2
    block_size: int = 16
    references: bool = True  # transformers at batch 1
    seed: int = 0
    warmup: bool = True  # one short unmeasured run of every side first
    prompts_path: str = str(SPECBENCH_PATH)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        unknown = set(self.categories) - set(SPECBENCH_CATEGORIES)
        if unknown or not self.categories:
            raise ValueError(
                f"categories must be among {', '.join(SPECBENCH_CATEGORIES)}, got "
                f"{sorted(unknown) or 'none'}"
            )
        if not self.methods:
            raise ValueError("methods is empty")
        self.parsed_methods()  # raises on a bad method
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        for name in ("prompts_per_category", "new_tokens", "rounds", "threads", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def parsed_methods(self) -> list[SpecMethod]:
        return [parse_method(m, self.num_speculative_tokens) for m in self.methods]

    def quick(self) -> SpecBenchConfig:
        """A check that the whole pipeline works, not a measurement."""
        return replace(
            self,
            batch_sizes=tuple(b for b in self.batch_sizes if b <= 4) or (1,),
            prompts_per_category=1,
            new_tokens=min(self.new_tokens, 16),
            rounds=1,
            warmup=False,
        )
