"""The machine a figure was measured on: CPU model and ISA flags, the native kernels' level,
software versions, threads and the git commit, as each report records and prints them."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

from tandem.engine import native, routes

REPO_ROOT = Path(__file__).resolve().parents[2]


def machine_info() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model and ISA flags, the native kernels' level
    (the CPU's, or as TANDEM_NATIVE_ISA capped it), software versions, threads, commit."""
    commit, dirty = _git_state()
    lib = native.library()
    return {
        "cpu": _cpu_model(),
        "isa_flags": routes.machine_identity()["isa_flags"],
        "native_level": native.level_in_use() if lib is not None else None,
        "cpu_level": lib.cpu_level if lib is not None else None,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line naming what a run measured on: CPU, its ISA flags, the kernels' level, threads."""
    return (
        f"CPU: {machine['cpu']} ({machine['isa_flags'] or 'no AVX2'}); native kernels: "
        f"{machine['native_level']} (the CPU runs {machine['cpu_level']}); torch "
        f"{machine['torch']}, {machine['torch_threads']} threads"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_state() -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(REPO_ROOT), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))
