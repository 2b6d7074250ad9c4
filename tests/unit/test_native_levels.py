"""One build of the native library holds every instruction-set level, runs on any x86-64 CPU,
and each process takes the highest level its CPU runs, capped by TANDEM_NATIVE_ISA.

The kernels' own tests run once per level this CPU runs (the `kernels` fixture); a level the CPU
runs but the build lacks fails here, and the levels above the CPU are reported once, skipped."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem import config
from tandem.engine import native

X86_64 = platform.machine() in ("x86_64", "AMD64")


def test_every_level_is_built() -> None:
    lib = native.library()
    assert lib is not None, "the native extension did not build (see the log)"
    assert list(lib.levels) == (list(native.LEVELS) if X86_64 else ["generic"])
    assert lib.cpu_level in lib.levels
    assert native.runnable_levels() == list(lib.levels)[: lib.levels.index(lib.cpu_level) + 1]


def test_levels_above_this_cpu() -> None:
    lib = native.library()
    assert lib is not None
    above = [level for level in lib.levels if level not in native.runnable_levels()]
    if above:
        pytest.skip(f"not runnable on this CPU (it runs up to {lib.cpu_level}): {above}")
    with pytest.raises(ValueError, match="no kernels"):
        native.extension("neon")


def test_a_level_above_the_cpu_is_refused() -> None:
    lib = native.library()
    assert lib is not None
    above = [level for level in lib.levels if level not in native.runnable_levels()]
    for level in above:
        with pytest.raises(ValueError, match="this CPU runs up to"):
            native.extension(level)


@pytest.mark.parametrize("cap", ["generic", "avx2", "avx512", "avx512bf16", "amx", None])
def test_the_cap_picks_the_level(monkeypatch: pytest.MonkeyPatch, cap: str | None) -> None:
    """With TANDEM_NATIVE_ISA set a process uses min(cap, CPU) (amx caps as avx512bf16), without
    it the CPU's own level; the level is decided once a process (`level_in_use` is cached: the
    cache is cleared here to decide it again)."""
    runnable = native.runnable_levels()
    if cap is None:
        monkeypatch.delenv("TANDEM_NATIVE_ISA", raising=False)
    else:
        monkeypatch.setenv("TANDEM_NATIVE_ISA", cap)
    native.level_in_use.cache_clear()
    try:
        got = native.level_in_use()
    finally:
        native.level_in_use.cache_clear()
    ceiling = len(native.LEVELS) - 1
    if cap is not None:
        ceiling = min(config.NATIVE_ISA_LEVELS.index(cap), ceiling)
    want = [level for level in runnable if native.LEVELS.index(level) <= ceiling][-1]
    assert got == want


def test_an_unknown_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="TANDEM_NATIVE_ISA must be one of"):
        config.native_isa_cap()


@pytest.mark.skipif(not X86_64 or shutil.which("objdump") is None, reason="x86-64 objdump")
def test_no_code_outside_a_level_uses_its_instructions() -> None:
    """Every function compiled for a level lives in that level's namespace (isa::<level>::): the
    library and torch code a level's translation unit includes is compiled for the baseline, so
    the linker cannot pick a copy with AVX2 / AVX-512 instructions for code that runs on any
    CPU. Checked on the built objects: outside isa::avx2:: and the like, no VEX / EVEX
    instruction (mnemonics v*, ymm / zmm / k registers)."""
    folder = native.build_dir()
    for level in ("avx2", "avx512", "avx512bf16"):
        listing = subprocess.run(
            ["objdump", "-d", "-C", "--no-show-raw-insn", str(folder / f"isa_{level}.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        function, wide, offenders = "", 0, set()
        for line in listing.splitlines():
            header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
            if header:
                function = header.group(1)
                continue
            fields = line.split("\t")
            if len(fields) < 2 or not function:
                continue
            mnemonic = fields[-1].split(" ")[0]
            if mnemonic.startswith("v") or re.search(r"%[yz]mm|%k[0-7]", fields[-1]):
                wide += 1
                if not function.startswith(f"isa::{level}::") and f"isa::{level}::" not in function:
                    offenders.add(function)
        assert wide > 1000, f"{level}: hardly any vector code; was its target applied?"
        assert not offenders, f"{level} instructions outside isa::{level}: {sorted(offenders)[:5]}"


def test_the_build_folder_does_not_depend_on_this_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """x86-64 builds hash the sources, flags and torch, not /proc/cpuinfo: an image built on one
    CPU finds its library on another."""
    if not X86_64:
        pytest.skip("off x86-64 the build is for the build machine's CPU (-march=native)")
    before = native.build_dir()
    monkeypatch.setattr(native, "_cpu_features", lambda: "flags : fpu something else")
    assert native.build_dir() == before
    assert "-march=native" not in native.FLAGS
    assert Path(before).name.startswith(native.NAME)
