"""How many CPU threads a step's ops use.

Design note. Each op of a step on CPU (a matmul, a norm, the decode
kernel's split) forks onto the intra-op thread pool and joins it again,
dozens of times per step. On a machine whose cores are all taken by other
busy processes, every join waits for a thread the OS has descheduled: on a
2-core host with a load average of 20, a 512-token step of the tiny model
spent ~100 ms in each matmul and each ``sin`` with two threads, and ran
3–15× faster with one. Chunked prefill runs many more steps than
monolithic, so it paid that toll far more often. So a step uses every
thread only while the other work on the machine leaves a core for each;
otherwise one. The load is the kernel's own one-minute average, read at
most once a second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Read the load average at most this often (it moves over seconds anyway).
LOAD_CHECK_SECONDS = 1.0


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class ThreadPolicy:
    """``threads()``: the intra-op threads for the next step, 1 to ``max_threads``."""

    def __init__(
        self,
        max_threads: int,
        *,
        num_cores: int | None = None,
        load_average: Callable[[], float] = lambda: os.getloadavg()[0],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_threads = max(1, max_threads)
        self.num_cores = num_cores or _num_cores()
        self.load_average = load_average
        self.clock = clock
        self.current = self.max_threads
        self._checked_at: float | None = None

    def threads(self) -> int:
        if self.max_threads == 1:
            return 1
        now = self.clock()
        if self._checked_at is None or now - self._checked_at >= LOAD_CHECK_SECONDS:
            self._checked_at = now
            # Our own busy threads count in the load: take them out to see the others'.
            others = max(0.0, self.load_average() - self.current)
            self.current = self.max_threads if others + self.max_threads <= self.num_cores + 0.5 else 1
        return self.current

    @contextmanager
    def step(self) -> Iterator[int]:
        """Run the block (one step) on ``threads()`` intra-op threads, then
        give back the count found, so no other code sees it changed."""
        n = self.threads()
        if n >= self.max_threads:
            yield n
            return
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(self.max_threads)
