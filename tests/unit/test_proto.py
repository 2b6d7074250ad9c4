"""The committed tandem/v1 modules are exactly what `make proto` generates from proto/."""

from __future__ import annotations

from pathlib import Path

from tandem import protogen


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    committed_dir = protogen.ROOT / "tandem" / "v1"
    assert fresh, "no .proto files found"
    names = {p.name for p in fresh}
    committed = {p.name for p in committed_dir.glob("*_pb2*.py*")}
    assert names == committed, "run `make proto`: generated files differ from the committed set"
    for p in fresh:
        assert p.read_bytes() == (committed_dir / p.name).read_bytes(), (
            f"tandem/v1/{p.name} is stale: run `make proto`"
        )
