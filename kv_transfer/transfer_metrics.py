"""Transfer metrics one worker keeps: bytes, seconds, exposed time, failures by cause."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from kv_transfer.state import FailureCause


@dataclass
class TransferMetrics:
    completed: int = 0
    nbytes: int = 0
    seconds: float = 0.0  # summed over transfers (header to trailer)
    exposed_s: list[float] = field(default_factory=list)  # decode admission - prefill end
    failures: Counter[FailureCause] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def success(self, nbytes: int, seconds: float, exposed_s: float | None) -> None:
        with self._lock:
            self.completed += 1
            self.nbytes += nbytes
            self.seconds += seconds
            if exposed_s is not None:
                self.exposed_s.append(exposed_s)

    def failure(self, cause: FailureCause) -> None:
        with self._lock:
            self.failures[cause] += 1
