"""Generate the protobuf/gRPC modules under tandem/v1 from proto/tandem/v1 (`make proto`).

`generate(out_dir)` writes into any directory, so a test can regenerate into a temporary one and
compare with the committed modules byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "tandem" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpc_tools) on every .proto; returns the generated files."""
    from grpc_tools import protoc  # dev dependency, pinned so the output is reproducible

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    return sorted((out_dir / "tandem" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    written = generate(ROOT)
    (ROOT / "tandem" / "v1" / "__init__.py").touch()
    print("\n".join(str(p.relative_to(ROOT)) for p in written), file=sys.stdout)


if __name__ == "__main__":
    main()
