"""The compiled CPU helpers (`csrc/`): paged attention (`cpu_attention.py`), the fused layer ops
(`layer_ops.py`, `models/rope.py`), the few-row products of float32 / bfloat16 weights
(`models/linear.py`) and of int4 / int8 ones (`quant/tiles.py`) and the KV row copies of the
transfer planes (`kv_transfer/layout.py`), one extension.

One build runs on every x86-64 CPU: the compute kernels are compiled once per instruction-set
level (generic, avx2, avx512, avx512bf16: `csrc/isa.h`), each in its own submodule of the
library, and a process takes the highest level its CPU runs (`cpu_level`), capped by
`TANDEM_NATIVE_ISA` (`config.native_isa_cap`), so that the lower levels run and are tested on any
machine. On other architectures (Arm) the one `generic` level is built for the build machine's
CPU (`-march=native`), as before.

It is built on first use with `torch.utils.cpp_extension` (gcc and ninja, a minute or two; `make
install` and the CPU image build it) into a folder of `~/.cache/torch_extensions` (or
`$TORCH_EXTENSIONS_DIR`) named by a hash of the sources, torch's version and the flags (and, off
x86-64, this CPU's features). Once built, a process imports the library directly, without the
build's lock file, so worker processes started or killed at any moment never wait on each other.
If it cannot be built, each user keeps its portable path (SDPA, `F.linear`, NumPy copies).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch

from tandem import config

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "bindings.cpp",  # the longest to compile (torch's and pybind11's headers): first
    "isa.cpp",
    "isa_generic.cpp",
    "isa_avx2.cpp",
    "isa_avx512.cpp",
    "isa_avx512bf16.cpp",
    "paged_attention.cpp",
    "copy_rows.cpp",
    "layer_ops.cpp",
    "quant_gemm.cpp",
    "row_gemm.cpp",
    "decode_layers.cpp",
)
HEADERS = (
    "native.h",
    "copy_rows.h",
    "isa.h",
    "isa_kernels.h",
    "simd.h",
    "kernels/attention.h",
    "kernels/layer_ops.h",
    "kernels/quant_gemm.h",
    "kernels/row_gemm.h",
)
NAME = "tandem_native"
X86_64 = platform.machine() in ("x86_64", "AMD64")
# x86-64: the baseline, each level's translation unit switches its own target on; elsewhere the
# build machine's CPU
# (-Wno-psabi: simd::Vec is wider than some levels' registers, which GCC notes at every inline
# function that takes one; they never cross a call between levels.)
FLAGS = (
    ("-O3", "-fopenmp", "-Wno-psabi")
    if X86_64
    else ("-O3", "-march=native", "-fopenmp", "-Wno-psabi")
)
# The levels built, lowest first (`isa::Level`): the caps config takes but "amx", which caps like
# avx512bf16 (no kernels of its own: torch's oneDNN takes AMX for bfloat16 prompt products).
LEVELS = tuple(level for level in config.NATIVE_ISA_LEVELS if level != "amx")


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
    machine = platform.machine() if X86_64 else f"{platform.machine()} {_cpu_features()}"
    for part in (torch.__version__, " ".join(FLAGS), machine):
        key.update(part.encode())
    return config.torch_extensions_dir() / f"{NAME}-{key.hexdigest()[:16]}"


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extension(level: str | None = None) -> ModuleType | None:
    """The kernels of `level` (default: `level_in_use()`), with the level-free helpers beside
    them, or None where the library did not build. A level above the CPU's raises ValueError."""
    lib = library()
    if lib is None:
        return None
    if level is None:
        level = level_in_use()
    if level not in lib.levels:
        raise ValueError(f"no kernels for level {level!r} here; built: {list(lib.levels)}")
    if level not in runnable_levels():
        raise ValueError(f"this CPU runs up to {lib.cpu_level!r}, not {level!r}")
    module: ModuleType = getattr(lib, level)
    return module


@functools.cache  # extension() asks on every call: once per layer op on CPU
def runnable_levels() -> list[str]:
    """The levels built here that this CPU runs, lowest first (none where the build failed)."""
    lib = library()
    if lib is None:
        return []
    return [name for name in lib.levels if LEVELS.index(name) <= LEVELS.index(lib.cpu_level)]


@functools.cache
def level_in_use() -> str:
    """The level this process computes with: the CPU's, capped by TANDEM_NATIVE_ISA (logged
    once); "generic" where the library did not build."""
    lib = library()
    if lib is None:
        return "generic"
    cap = config.native_isa_cap()
    levels = runnable_levels()
    if cap is not None:
        ceiling = min(config.NATIVE_ISA_LEVELS.index(cap), len(LEVELS) - 1)
        levels = [name for name in levels if LEVELS.index(name) <= ceiling]
    level: str = levels[-1]
    log.info(
        "native CPU kernels: level %s (CPU runs %s%s)",
        level,
        lib.cpu_level,
        f", capped by TANDEM_NATIVE_ISA={cap}" if cap else "",
    )
    return level


def build_in_use() -> str:
    """The loaded library's build folder name (hashed from the sources and flags: other kernels,
    another name), "none" where the library did not build."""
    lib = library()
    return Path(lib.__file__ or "").parent.name if lib is not None else "none"


@functools.cache
def library() -> ModuleType | None:
    """The built library, every level in it, or None (the build failed: logged once)."""
    folder = build_dir()
    try:
        return _import(folder / f"{NAME}.so")
    except (ImportError, OSError):
        pass  # not built yet (or a build in progress): build, or wait for it, under the lock
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package's binary sits beside this Python
        config.put_python_bin_on_path()
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
