"""Several replicas on one GPU (``devices=['@cupy:0', '@cupy:0']``): the shared-memory
backend with device <-> host staging (``comm/staged.py``), since NCCL refuses two ranks on
one GPU.

Here, on CPU: the backend choice, the validation, and the staged communicator's data flow
against the CuPy stand-in (two ranks in one process, attached to the same shared segments).
On a GPU, tests/test_gpu.py runs two replicas on GPU 0 against StandardUpdater.
"""
from __future__ import annotations

import types

import numpy
import pytest

import _fakecupy
from mgpu_updater import comm as comms
from mgpu_updater.comm.shm import ShmCommunicator
from mgpu_updater.comm.staged import HostStagedCommunicator

SPEC = {'param/<f4': ('<f4', 5), 'grad/<f4': ('<f4', 5), 'grad/<f2': ('<f2', 3),
        'stat/<f4': ('<f4', 2), 'grad/empty': ('<f4', 0)}


def gpu(device_id):
    """A stand-in for Chainer's GpuDevice: what the factory reads of it."""
    return types.SimpleNamespace(xp=object(), device=types.SimpleNamespace(id=device_id))


def cpu():
    return types.SimpleNamespace(xp=numpy)


@pytest.mark.parametrize('ids, backend', [
    ([0, 1], 'nccl'), ([0, 1, 2, 3], 'nccl'), ([0, 0], 'shm'), ([0, 1, 0], 'shm'),
    ([2, 2, 2], 'shm')])
def test_a_gpu_listed_twice_goes_through_shared_memory(ids, backend):
    assert comms.backend_for([gpu(i) for i in ids]) == backend
    assert comms.backend_for([cpu(), cpu()]) == 'shm'


def test_a_repeated_gpu_is_not_refused_for_being_repeated(monkeypatch):
    from chainer.backends import cuda

    from mgpu_updater import _validate
    monkeypatch.setattr(cuda, 'available', False)   # no GPU here: the CUDA check speaks
    with pytest.raises(ValueError, match=r"^devices\[0\] is 0, a GPU, but CuPy is not "
                                         r'installed or cannot use CUDA'):
        _validate.devices([0, 0])


@pytest.fixture
def pair(monkeypatch):
    """(stand-in, master, worker): rank 0 and rank 1 on GPU 0, staged, one process."""
    fake = _fakecupy.install(monkeypatch)
    master, handle = comms.create('shm', 2, SPEC, gpu(0))
    try:
        worker = comms.attach('shm', handle, 1, gpu(0))
    except BaseException:
        master.finalize()
        raise
    yield fake, master, worker
    worker.finalize()
    master.finalize()


def test_buffers_live_on_the_device(pair):
    fake, master, worker = pair
    for comm in (master, worker):
        assert isinstance(comm, HostStagedCommunicator) and comm.name == 'shm'
        for name, (dtype, count) in SPEC.items():
            buf = comm.buffer(name)
            assert isinstance(buf, fake.FakeArray) and buf.shape == (count,)
            assert buf.dtype == numpy.dtype(dtype)
    assert master.buffer('grad/<f4') is not worker.buffer('grad/<f4')
    assert len(master.owned_segments) == len(SPEC) + 1   # one per buffer, and the ledger


def test_bcast_goes_device_host_device(pair):
    fake, master, worker = pair
    values = numpy.arange(5, dtype='<f4') + 0.5
    master.buffer('param/<f4').set(values)   # as on CuPy: [...] = takes scalars only
    del fake.log[:]
    master.bcast('param/<f4')                 # the root: device -> shared host slot
    assert fake.log == [('d2h', 0, 20)]
    assert not numpy.array_equal(worker.buffer('param/<f4'), values)   # not yet copied
    worker.bcast('param/<f4')                 # the others: shared host slot -> device
    assert fake.log[1:] == [('h2d', 0, 20)]
    numpy.testing.assert_array_equal(worker.buffer('param/<f4'), values)


@pytest.mark.parametrize('name', ['grad/<f4', 'grad/<f2', 'stat/<f4'])
def test_reduce_sums_on_the_host_and_returns_the_sum_to_the_roots_device(pair, name):
    fake, master, worker = pair
    n = SPEC[name][1]
    mine, theirs = numpy.arange(n) + 1.0, 10.0 * (numpy.arange(n) + 1)
    for comm, data in ((worker, theirs), (master, mine)):   # host -> device, as on CuPy
        comm.buffer(name).set(data.astype(comm.buffer(name).dtype))
    del fake.log[:]
    worker.reduce(name)                       # before it tells the master it is done
    assert [entry[0] for entry in fake.log] == ['d2h']
    master.reduce(name)
    assert [entry[0] for entry in fake.log] == ['d2h', 'd2h', 'h2d']
    numpy.testing.assert_array_equal(master.buffer(name), (mine + theirs).astype(SPEC[name][0]))
    numpy.testing.assert_array_equal(worker.buffer(name), theirs.astype(SPEC[name][0]))


def test_an_empty_buffer_makes_no_trouble(pair):
    fake, master, worker = pair
    worker.reduce('grad/empty')
    master.reduce('grad/empty')
    assert master.buffer('grad/empty').shape == (0,)


def test_finalize_twice_use_after_finalize_and_bad_names(pair):
    fake, master, worker = pair
    with pytest.raises(KeyError, match=r"no buffer named 'nope'"):
        master.buffer('nope')
    worker.finalize()
    worker.finalize()
    with pytest.raises(RuntimeError, match='communicator was finalized'):
        worker.reduce('grad/<f4')


def test_a_failing_device_side_releases_the_shared_segments(monkeypatch):
    from mgpu_updater import _cuda
    made = []
    original = ShmCommunicator.create.__func__

    def create(cls, size, spec, broadcast=()):
        made.append(original(cls, size, spec, broadcast))
        return made[-1]

    monkeypatch.setattr(ShmCommunicator, 'create', classmethod(create))

    def no_cupy():
        raise ImportError('the GPU code of mgpu_updater needs CuPy')

    monkeypatch.setattr(_cuda, 'import_cupy', no_cupy)
    with pytest.raises(ImportError, match='needs CuPy'):
        comms.create('shm', 2, SPEC, gpu(0))
    [inner] = made
    assert inner.finalized
