"""Resident memory of this process, for the benchmarks: now, and the peak while a block runs."""
from __future__ import annotations

import os
import threading
import time


def rss() -> int:
    """Bytes resident now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set size while the block runs, sampled every 2 ms (a spike shorter than that
    can be missed; the loader's and XLA's allocations last far longer)."""

    def __enter__(self):
        self.peak, self.base, self._stop = 0, rss(), False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def above(self) -> float:
        """GiB above the RSS at entry."""
        return (self.peak - self.base) / 2**30

    @property
    def gib(self) -> float:
        return self.peak / 2**30
