"""Keeping the host memory a replica frees, for its next micro-batch (glibc's malloc).

Every micro-batch, Chainer on the CPU allocates its activations and gradients afresh and
frees them in backward. Left alone, glibc's malloc hands much of that memory back to the
kernel as soon as it is freed (its thresholds adapt to what it has seen: arrays above
``M_MMAP_THRESHOLD`` get a mapping of their own, and a heap top freer than
``M_TRIM_THRESHOLD`` is trimmed), so the next micro-batch takes the same pages again, one
page fault each. On a virtual machine a page fault is expensive: measured on this
project's 2-core VM with the benchmark's CNN, 8,000 to 15,000 faults per update of 8
micro-batches, and the same loop ran 25% faster without them (``bench/scaling.py``
records how the methods compare with and without this).

``reuse_host_memory='auto'`` (the default) therefore fixes both thresholds once per replica
process, as a memory pool does: :data:`MMAP_THRESHOLD` (glibc's largest, so arrays up to
32 MiB come from the heap and are reused) and :data:`TRIM_THRESHOLD` (the heap keeps up to
1 GiB it no longer uses; it is reused, not returned). The cost is that a process keeps its
peak heap, the way CuPy's memory pool keeps the device memory it used. ``'auto'`` leaves
malloc alone when the user configured it (:data:`USER_VARIABLES`, or ``glibc.malloc``
tunables in ``GLIBC_TUNABLES``); ``True`` applies it anyway, ``False`` never. Where the C
library is not glibc nothing is done.

Where it is applied: a worker at start-up, for its life; the master at the first update.
The master is the user's process, and glibc has no way back to its adaptive thresholds, so
this stays for the rest of the master's life; ``reuse_host_memory=False`` avoids it.
Nothing here changes a result: only where malloc finds memory.
"""
from __future__ import annotations

import ctypes
import os
import platform
from typing import Any, Tuple

#: glibc's ``M_MMAP_THRESHOLD`` ceiling on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``,
#: ``4 * 1024 * 1024 * sizeof(long)``); mallopt refuses more.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: The free memory the heap may keep at its top before it is given back to the kernel.
TRIM_THRESHOLD = 1024 * 1024 * 1024

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: The environment variables by which a user configures glibc's malloc. When any is set
#: (or ``GLIBC_TUNABLES`` names a ``glibc.malloc`` tunable), ``'auto'`` leaves it alone.
USER_VARIABLES: Tuple[str, ...] = ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_',
                                   'MALLOC_TOP_PAD_', 'MALLOC_MMAP_MAX_', 'MALLOC_ARENA_MAX')


def user_configured() -> Tuple[str, ...]:
    """The user's malloc settings in the environment (names), empty if there are none."""
    named = tuple(name for name in USER_VARIABLES if os.environ.get(name, '').strip())
    if 'glibc.malloc.' in os.environ.get('GLIBC_TUNABLES', ''):
        named += ('GLIBC_TUNABLES',)
    return named


def decide(setting: Any) -> bool:
    """Whether the replica processes reuse freed memory, from the validated
    ``reuse_host_memory`` (``'auto'``, True or False). Decided once, in the master."""
    if setting == 'auto':
        return not user_configured()
    return bool(setting)


def is_glibc() -> bool:
    return platform.libc_ver()[0] == 'glibc'


def reuse_freed_memory(enabled: bool) -> bool:
    """Fix this process's malloc thresholds (see the module's docstring) if ``enabled``
    and the C library is glibc. Returns whether they were set. Process-wide, for good."""
    if not enabled or not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Both, in this order: each disables the adaptive thresholds (a 1 from mallopt: done).
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
