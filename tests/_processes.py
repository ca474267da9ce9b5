"""Process helpers for the tests: whether processes are gone."""
from __future__ import annotations

import os
import time


def gone_within(pids, seconds):
    """Whether every process of ``pids`` has exited within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False
