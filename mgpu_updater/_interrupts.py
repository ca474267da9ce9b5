"""A Ctrl-C held back for a few instructions that must not be cut in two, then delivered.

Python raises ``KeyboardInterrupt`` in the main thread at any instruction. Where a thread
or a process was started and its owner is not recorded yet, one raised in between leaves
the thread or process running with nobody to stop it. :func:`ctrl_c_held` installs a
handler that only notes the signal, and runs the one it replaced once the block is over:
Python's own then raises ``KeyboardInterrupt`` there, a script's own handler runs as it
would have. Only in the main thread, the only one Python delivers signals to.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Note a SIGINT while the block runs; deliver it as it would have been after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is None:   # not set from Python: not restorable
        yield
        return
    caught: List[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])   # Python's own raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
