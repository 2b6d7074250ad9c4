"""The compiled CPU helpers (`csrc/`): paged attention (`cpu_attention.py`), the fused layer ops
(`layer_ops.py`, `models/rope.py`), the few-row products of float32 weights (`models/linear.py`)
and of int4 / int8 ones (`quant/tiles.py`) and the KV row copies of the transfer planes
(`kv_transfer/layout.py`), one extension.

It is built on first use with `torch.utils.cpp_extension` (gcc and ninja, about a minute; `make
install` builds it) into a folder of `~/.cache/torch_extensions` (or `$TORCH_EXTENSIONS_DIR`)
named by a hash of the sources, torch's version, the flags and this CPU's features
(`-march=native`: a home shared by different hosts gets one build each). Once built, a process
imports the library directly, without the build's lock file, so worker processes started or
killed at any moment never wait on each other. If it cannot be built, each user keeps its
portable path (SDPA, NumPy copies).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "paged_attention.cpp",
    "copy_rows.cpp",
    "layer_ops.cpp",
    "quant_gemm.cpp",
    "row_gemm.cpp",
    "bindings.cpp",
)
HEADERS = ("native.h", "simd.h")
NAME = "tandem_native"
FLAGS = ("-O3", "-march=native", "-fopenmp")


def _cpu_features() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_dir() -> Path:
    key = hashlib.sha256()
    for name in SOURCES + HEADERS:
        key.update((CSRC / name).read_bytes())
    for part in (torch.__version__, " ".join(FLAGS), platform.machine(), _cpu_features()):
        key.update(part.encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"{NAME}-{key.hexdigest()[:16]}"


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def extension() -> ModuleType | None:
    """The built extension, or None (the build failed: logged once)."""
    folder = build_dir()
    try:
        return _import(folder / f"{NAME}.so")
    except (ImportError, OSError):
        pass  # not built yet (or a build in progress): build, or wait for it, under the lock
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package's binary sits beside this Python
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            NAME,
            [str(CSRC / name) for name in SOURCES],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja: the portable paths still work
        log.warning("native CPU extension unavailable (%s); portable paths are used", e)
        return None
