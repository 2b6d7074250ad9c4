"""`python -m tandem.engine.models.tokenizer_export CHECKPOINT DEST`: save a checkpoint's
tokenizer as `transformers` builds it (for a GGUF, from the file's metadata), for
`tandem.tokenizer` to read without transformers. `tandem.tokenizer.tokenizer_dir` runs it in a
child process once per checkpoint."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from tandem.model_config import is_gguf


def export(checkpoint: Path, dest: Path) -> None:
    """Save the checkpoint's tokenizer as transformers builds it; atomically, so that a process
    racing this one finds either nothing or the whole export at `dest`."""
    if is_gguf(checkpoint):
        built = AutoTokenizer.from_pretrained(str(checkpoint.parent), gguf_file=checkpoint.name)
    else:
        built = AutoTokenizer.from_pretrained(str(checkpoint))
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".partial-"))
    try:
        built.save_pretrained(partial)
        with contextlib.suppress(OSError):  # another process saved it first
            partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already after the rename


if __name__ == "__main__":
    export(Path(sys.argv[1]), Path(sys.argv[2]))
