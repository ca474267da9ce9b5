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


def _reduce_onto(comms, name, targets):
    for comm in comms:
        comm.begin_update()
    for comm in comms[1:]:
        comm.reduce(name)
    comms[0].reduce_onto(name, targets)
    for comm in comms:
        comm.end_update()


@pytest.mark.parametrize('size', [2, 3])
@pytest.mark.parametrize('dtype', ['<f2', '<f4', '<f8'])
def test_reduce_onto_arrays_is_bitwise_the_reduce_of_them_packed(size, dtype):
    """The master's gradients summed where they lie (``reduce_onto``): each array ends as
    the slot would, had it been packed there and reduced, and the slot is left alone."""
    pieces = [3, 32768 * 2 + 7, 1, 500]   # one of them across the 256 KiB blocks
    n = sum(pieces)
    name = f'grad/{dtype}'
    comms = _ranks(size, {name: (dtype, n)})
    try:
        rng = np.random.RandomState(size)
        values = [(rng.standard_normal(n) * 10.0 ** rng.randint(-3, 4, n)).astype(dtype)
                  for _ in range(size)]
        for comm, v in zip(comms[1:], values[1:]):
            comm.buffer(name)[...] = v
        root_slot = comms[0].buffer(name)
        root_slot[...] = -1
        bounds = np.cumsum([0] + pieces)
        arrays = [values[0][lo:hi].copy() for lo, hi in zip(bounds[:-1], bounds[1:])]
        _reduce_onto(comms, name, list(zip(bounds[:-1].tolist(), arrays)))
        got = np.concatenate(arrays)

        check = _ranks(size, {name: (dtype, n)})   # the same values through reduce
        try:
            for comm, v in zip(check, values):
                comm.buffer(name)[...] = v
            _reduce(check, name, 0)
            expected = check[0].buffer(name).copy()
        finally:
            _finalize(check)
        bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
        np.testing.assert_array_equal(got.view(bits), expected.view(bits))
        assert (root_slot == -1).all()
        for comm, v in zip(comms[1:], values[1:]):
            np.testing.assert_array_equal(comm.buffer(name), v)
    finally:
        _finalize(comms)


def test_reduce_onto_is_checked_as_a_reduce_and_must_cover_the_buffer():
    from mgpu_updater.comm.base import CollectiveOrderError
    spec = {'grad/<f4': ('<f4', 4), 'stat/<f4': ('<f4', 2)}
    comms = _ranks(2, spec)
    try:
        for comm in comms:
            comm.begin_update()
        comms[1].reduce('stat/<f4')   # the worker reduced another buffer
        with pytest.raises(CollectiveOrderError, match="'grad/<f4'"):
            comms[0].reduce_onto('grad/<f4', [(0, np.zeros(4, np.float32))])
        for comm in comms:
            comm.begin_update()
        comms[1].reduce('grad/<f4')
        with pytest.raises(ValueError, match='cover 3 of'):
            comms[0].reduce_onto('grad/<f4', [(0, np.zeros(3, np.float32))])
        with pytest.raises(RuntimeError, match="root's"):
            comms[1].reduce_onto('grad/<f4', [(0, np.zeros(4, np.float32))])
    finally:
        _finalize(comms)
