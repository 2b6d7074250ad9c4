"""The /dev/shm KV files' names and their cleanup: a file whose creator is gone (killed without
cleanup) is unlinked by the host's next `create` or `unlink`, a live creator's never, nor one of
another PID namespace (a container sharing /dev/shm), whose pids mean nothing here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.engine.shared_kv import OWN_PREFIX, PREFIX, SHM_DIR, SharedKVFile, shm_available

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")


def gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_file() -> Path:
    path = SHM_DIR / f"{OWN_PREFIX}{gone_pid()}-test"
    path.write_bytes(b"\0" * 64)
    return path


def test_create_and_unlink_remove_the_files_of_creators_that_are_gone() -> None:
    live = SHM_DIR / f"{OWN_PREFIX}{os.getppid()}-test-live"  # pytest's parent: alive
    foreign = SHM_DIR / f"{PREFIX}1-{gone_pid()}-test-other-namespace"
    for path in (live, foreign):
        path.write_bytes(b"\0" * 64)
    try:
        before_create = stale_file()
        file = SharedKVFile.create(2, (2, 3, 4), torch.float32)
        assert not before_create.exists()
        file.map()
        assert Path(file.path).exists() and file.path.startswith(
            f"{SHM_DIR}/{OWN_PREFIX}{os.getpid()}-"
        )
        before_unlink = stale_file()  # a worker killed while this one ran
        file.unlink()
        assert not Path(file.path).exists() and not before_unlink.exists()
        assert live.exists() and foreign.exists()
    finally:
        for path in (live, foreign):
            path.unlink(missing_ok=True)
