"""A stage's recent load: its compute over the last BUSY_WINDOW_SECONDS
(/health's and the stage_busy_fraction metric's busy fraction)."""

from __future__ import annotations

import threading
from collections import deque

from orchestrator.config import BUSY_WINDOW_SECONDS


class BusyWindow:
    """A stage's compute over the last BUSY_WINDOW_SECONDS: passes added as
    they end (by the serving thread), the fraction read by any thread."""

    def __init__(self, seconds: float = BUSY_WINDOW_SECONDS):
        self.seconds = seconds
        self._passes: deque[tuple[float, float]] = deque()  # (when it ended, its compute seconds)
        self._busy = 0.0  # the compute seconds of the passes held
        self._lock = threading.Lock()

    def add(self, ended: float, seconds: float) -> None:
        with self._lock:
            self._passes.append((ended, seconds))
            self._busy += seconds
            self._drop(ended - self.seconds)

    def fraction(self, now: float) -> float:
        """The share of the window before ``now`` spent computing passes (a pass that began before it counts in
        part: only the oldest can, as a stage runs one pass at a time)."""
        start = now - self.seconds
        with self._lock:
            self._drop(start)
            busy = self._busy
            if self._passes:
                ended, seconds = self._passes[0]
                busy -= max(0.0, seconds - (ended - start))
        return min(1.0, max(0.0, busy) / self.seconds)

    def _drop(self, start: float) -> None:
        """Forget the passes that ended before ``start`` (under the lock)."""
        while self._passes and self._passes[0][0] <= start:
            self._busy -= self._passes.popleft()[1]
