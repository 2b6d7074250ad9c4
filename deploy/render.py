"""Render a kustomization as `kubectl kustomize` would, for the small subset of kustomize that
deploy/ uses. The real path is `kubectl apply -k deploy/overlays/<name>`; this exists because the
test machine has no kustomize binary (tests/unit/test_deploy_manifests.py), and to look at a
rendered overlay anywhere: `python deploy/render.py deploy/overlays/gpu`.

Supported, and nothing else (any other kustomization key is an error, never silently ignored):

    resources   YAML files (one or more documents each) and directories holding a
                kustomization.yaml, rendered first, in the order listed
    patches     entries {path, target: {kind, name}} whose file is a JSON 6902 (RFC 6902) list of
                `add`, `replace` and `remove` operations, applied in order to the one resource of
                that kind and name
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}
OPS = {"add", "replace", "remove"}


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The resources of the kustomization in `directory`, patches applied."""
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    unknown = set(spec) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{directory}: keys this renderer does not implement: {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: resources defined twice: {sorted(duplicates)}")
    for patch in spec.get("patches", []):
        _apply_patch(directory, patch, docs)
    return docs


def _apply_patch(directory: Path, patch: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    if set(patch) != {"path", "target"} or set(patch["target"]) != {"kind", "name"}:
        raise ValueError(f"{directory}: only `path` + `target` (kind, name) patches: {patch}")
    kind, name = patch["target"]["kind"], patch["target"]["name"]
    targets = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if len(targets) != 1:
        raise ValueError(f"{directory}: patch target {kind}/{name} matches {len(targets)} objects")
    ops = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise ValueError(f"{directory / patch['path']}: not a JSON 6902 list of operations")
    for op in ops:
        apply_operation(targets[0], op)


def apply_operation(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, replace or remove), in place."""
    if op.get("op") not in OPS:
        raise ValueError(f"unsupported JSON patch operation {op}")
    *parents, last = _pointer(op["path"])
    container: Any = doc
    for token in parents:
        container = container[int(token)] if isinstance(container, list) else container[token]
    if isinstance(container, list):
        if op["op"] == "add" and last == "-":
            container.append(copy.deepcopy(op["value"]))
            return
        index = int(last)
        if op["op"] == "add":
            if not 0 <= index <= len(container):
                raise IndexError(f"{op['path']}: index out of range")
            container.insert(index, copy.deepcopy(op["value"]))
            return
        if not 0 <= index < len(container):
            raise IndexError(f"{op['path']}: index out of range")
        if op["op"] == "replace":
            container[index] = copy.deepcopy(op["value"])
        else:
            del container[index]
        return
    if op["op"] != "add" and last not in container:
        raise KeyError(f"{op['path']}: nothing to {op['op']}")
    if op["op"] == "remove":
        del container[last]
    else:
        container[last] = copy.deepcopy(op["value"])


def _pointer(path: str) -> list[str]:
    """RFC 6901: "/a/b~1c" -> ["a", "b/c"]."""
    if not path.startswith("/"):
        raise ValueError(f"a JSON pointer starts with '/', got {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python deploy/render.py DIRECTORY_WITH_KUSTOMIZATION")
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main(sys.argv[1:])
