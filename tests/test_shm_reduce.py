"""The shared-memory ``reduce``: the root's slot ends up holding exactly the plain sum.

``reduce`` sums the slots block by block (see ``mgpu_updater.comm.shm.sum_slots``), for speed;
each element is still summed in the same order (the root's slot, then the others in rank
order), so the result must be bitwise the whole-array sum's, for every dtype, any length
(around and across the blocks) and any root. (The speed is measured, not tested here: a timing
test on a shared machine was not reliable.)
"""
from __future__ import annotations

import numpy as np
import pytest

from mgpu_updater.comm.shm import ShmCommunicator


def _ranks(size, spec):
    root = ShmCommunicator.create(size, spec)
    return [root] + [ShmCommunicator.attach(root.handle, r) for r in range(1, size)]


def _finalize(comms):
    for comm in reversed(comms):
        comm.finalize()


def _reduce(comms, name, root):
    """As the local protocol runs it: every other rank's reduce first, the root's last."""
    for comm in comms:
        comm.begin_update()
    for comm in comms:
        if comm.rank != root:
            comm.reduce(name, root)
    comms[root].reduce(name, root)
    for comm in comms:
        comm.end_update()


@pytest.mark.parametrize('size,root', [(2, 0), (2, 1), (3, 0), (3, 2)])
@pytest.mark.parametrize('dtype', ['<f2', '<f4', '<f8'])
def test_reduce_is_bitwise_the_plain_sum_in_rank_order(size, root, dtype):
    # around and across the 256 KiB blocks of every dtype (32768, 65536, 131072 elements)
    counts = [1, 5, 32767, 65536, 131073]
    spec = {f'grad{i}/{dtype}': (dtype, n) for i, n in enumerate(counts)}
    comms = _ranks(size, spec)
    try:
        rng = np.random.RandomState(size * 10 + root)
        for i, n in enumerate(counts):
            name = f'grad{i}/{dtype}'
            # magnitudes far apart: the order of the additions changes the rounding
            values = [(rng.standard_normal(n) * 10.0 ** rng.randint(-3, 4, n)).astype(dtype)
                      for _ in range(size)]
            for comm, v in zip(comms, values):
                comm.buffer(name)[...] = v
            expected = values[root].copy()
            for r in range(size):
                if r != root:
                    expected = expected + values[r]   # whole arrays, one rank after another
            _reduce(comms, name, root)
            got = comms[root].buffer(name)
            bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
            np.testing.assert_array_equal(got.view(bits), expected.view(bits))
            for r, (comm, v) in enumerate(zip(comms, values)):
                if r != root:   # the other slots are left as they were
                    np.testing.assert_array_equal(comm.buffer(name), v)
    finally:
        _finalize(comms)
