"""The layout's rules that no import contract states: file names, single definitions, environment.

- no two modules share a file name (`__init__.py` apart): a name says which module it is;
- `GRPC_OPTIONS` and the table from transfer failure causes to status codes are defined once;
- `os.environ` is read or written only in tandem/config.py;
- the import contracts (pyproject.toml, `make lint`) fail when a forbidden import is added;
- every module of the engine can be the first one a process imports.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tandem", "router", "prefill_worker", "decode_worker", "kv_transfer")
GENERATED = ROOT / "tandem" / "v1"


def source_files() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if GENERATED not in path.parents
    )


def parsed() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in source_files()}


def test_no_two_modules_share_a_file_name() -> None:
    names = Counter(path.name for path in source_files() if path.name != "__init__.py")
    shared = {name: count for name, count in names.items() if count > 1}
    assert not shared, shared


def assigned_names(tree: ast.Module) -> list[str]:
    return [
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    ]


def test_grpc_options_are_defined_once() -> None:
    where = [path for path, tree in parsed().items() if "GRPC_OPTIONS" in assigned_names(tree)]
    assert where == [ROOT / "tandem" / "config.py"]


def maps_causes_to_status_codes(node: ast.Dict) -> bool:
    keys = [k for k in node.keys if isinstance(k, ast.Attribute)]
    return any(isinstance(k.value, ast.Name) and k.value.id == "FailureCause" for k in keys) and (
        "StatusCode" in ast.unparse(node)
    )


def test_the_cause_to_status_table_is_defined_once() -> None:
    tables = [
        (path.relative_to(ROOT), node.lineno)
        for path, tree in parsed().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict) and maps_causes_to_status_codes(node)
    ]
    assert [path for path, _ in tables] == [Path("kv_transfer/state.py")], tables


def touches_the_environment(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "os" and node.attr in ("environ", "getenv", "putenv", "unsetenv")
    if isinstance(node, ast.ImportFrom) and node.module == "os":
        return any(a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names)
    return False


def test_the_environment_is_read_only_in_config() -> None:
    readers = sorted(
        {
            str(path.relative_to(ROOT))
            for path, tree in parsed().items()
            if any(touches_the_environment(node) for node in ast.walk(tree))
        }
    )
    assert readers == ["tandem/config.py"]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300
    )


def test_a_forbidden_import_breaks_the_contracts(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0
    policies = tmp_path / "router" / "policies.py"
    policies.write_text(policies.read_text() + "\nfrom tandem.engine import kv_cache  # noqa\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "router is not allowed to import tandem.engine" in broken.stdout, broken.stdout


# In a fresh process, after torch: each engine module imported first, in a fork of its own.
# The names come from the files: pkgutil.walk_packages would import the packages first.
FIRST_IMPORTS = """
import importlib, multiprocessing, sys
import torch

def first_import(name):
    try:
        importlib.import_module(name)
    except Exception as e:
        return f"{name}: {type(e).__name__}: {e}"

names = sys.argv[1:]
with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
    print("\\n".join(e for e in pool.map(first_import, names, chunksize=1) if e))
"""


def test_every_engine_module_imports_first() -> None:
    """An import cycle through a package's `__init__` fails in some orders only: importing
    `tandem.engine.quant` first failed (models -> tp.shard -> quant.model, half initialized),
    while every entry point imported `tandem.engine.models` first."""
    names = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "tandem" / "engine").rglob("*.py")
        if path.name != "__main__.py"
    ]
    run = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, *names], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr
