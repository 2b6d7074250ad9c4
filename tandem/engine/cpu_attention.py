"""The compiled CPU kernel for short-query attention over the paged KV cache (`csrc/`).

Decodes and speculative verifications read every request's whole context each step; gathering
those blocks into a padded copy and running SDPA over it (`TorchSDPABackend`'s portable path)
costs three passes over the context plus the padding, which at batch 16 of ~800-token prompts
took most of a step. The kernel reads the blocks where they are, once for keys and once for
values, and dequantizes int8 / fp8 slots as it reads them.

It is built on first use with `torch.utils.cpp_extension` (gcc and ninja, ~45 s; `make install`
builds it) into a folder of `~/.cache/torch_extensions` (or `$TORCH_EXTENSIONS_DIR`) named by a
hash of the source, torch's version, the flags and this CPU's features (`-march=native`: a home
shared by different hosts gets one build each). Once built, a process imports the library
directly, without the build's lock file, so worker processes started or killed at any moment
never wait on each other. If it cannot be built, or with `TANDEM_CPU_ATTENTION=sdpa`, CPU
attention stays on the portable path.
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

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
ENV = "TANDEM_CPU_ATTENTION"  # "sdpa" keeps CPU attention on the portable path
MAX_BLOCK_SIZE = 64  # the kernel's `kMaxBlockSize`


NAME = "tandem_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp")


def _cpu_features() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_dir() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes())
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
def kernel() -> ModuleType | None:
    """The built extension, or None (switched off, or the build failed: logged once)."""
    if os.environ.get(ENV, "kernel") == "sdpa":
        return None
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
            [str(SOURCE)],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja: the portable path still works
        log.warning("CPU paged-attention kernel unavailable (%s); attention uses SDPA", e)
        return None


def runs_on(device: torch.device, block_size: int) -> bool:
    """Whether the kernel runs attention over caches of `block_size` on `device`."""
    return device.type == "cpu" and block_size <= MAX_BLOCK_SIZE and kernel() is not None


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim], the requests' queries in order
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, slot_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    query_starts: torch.Tensor,  # [B + 1] int64: request b's queries are rows [s[b], s[b+1])
    head_dim: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] in q's dtype
    ext = kernel()
    assert ext is not None, "check runs_on() first"
    out = ext.paged_attention(
        q.float().contiguous(),
        kv_cache[0],
        kv_cache[1],
        block_tables,
        context_lens,
        query_starts,
        head_dim,
        scale,
    )
    return out.to(q.dtype)
