"""Data files that ship with tandem (README.md here: their sources and licenses).

`SPECBENCH_PATH`: the Spec-Bench dev prompts, in the categories `SPECBENCH_CATEGORIES`, read by
the benchmarks, the draft-head training and the tests; a package data file, so an installed tandem
(the container images) has it too.
"""

from pathlib import Path

SPECBENCH_PATH = Path(__file__).with_name("specbench_dev.jsonl")
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
