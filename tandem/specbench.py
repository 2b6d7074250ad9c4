"""Where the Spec-Bench dev prompts live and the categories they come in: the prompts that
draft-head training distils on and that the benchmarks send. Torch-free."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SPECBENCH_PATH = PROJECT_ROOT.parent / "shared" / "data" / "specbench_dev.jsonl"
SPECBENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)
