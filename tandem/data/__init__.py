"""Data files that ship with tandem (README.md here: their sources and licenses).

`SPECBENCH_PATH`: the Spec-Bench prompts, read by the benchmarks, the draft-head training and the
tests; a package data file, so an installed tandem (the container images) has it too.
"""

from pathlib import Path

SPECBENCH_PATH = Path(__file__).with_name("specbench_dev.jsonl")
