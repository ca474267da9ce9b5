"""The CUDA helpers: bounded event waits and the pinned host-to-device stager.

Tests marked ``gpu`` use real CuPy and skip with the reason without it; the others check the
structure handling and ordering against the stand-in in ``_fakecupy.py``.
"""
from __future__ import annotations

import numpy
import pytest

import _fakecupy
from mgpu_updater import _cuda


@pytest.fixture
def fake(monkeypatch):
    return _fakecupy.install(monkeypatch)


class _Event:
    def __init__(self, polls_until_done):
        self.left = polls_until_done

    @property
    def done(self):
        self.left -= 1
        return self.left < 0


def test_wait_event_returns_when_done_and_runs_the_check_meanwhile():
    calls = []
    _cuda.wait_event(_Event(0))
    _cuda.wait_event(_Event(400), check=lambda: calls.append(1))
    assert calls   # polled for longer than one check interval


def test_wait_event_times_out_and_lets_the_check_raise():
    with pytest.raises(TimeoutError, match=r'the copy did not finish within 0.05 s'):
        _cuda.wait_event(_Event(10 ** 9), timeout=0.05, what='the copy')

    def dead():
        raise RuntimeError('peer died')

    with pytest.raises(RuntimeError, match='peer died'):
        _cuda.wait_event(_Event(10 ** 9), check=dead)


def test_stager_keeps_the_structure_and_the_values(fake):
    stager = _cuda.PinnedStager(device=2)
    x = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
    t = numpy.array([1, 0, 2], dtype=numpy.int32)
    big_endian = numpy.arange(3, dtype='>f8')
    names = numpy.array(['a', 'b'])
    batch = {'x': x[:, ::2], 'y': (t, [big_endian, None, 7]), 'names': names,
             'empty': numpy.zeros((0, 3), numpy.float32)}
    staged = stager.stage(batch)
    out = staged.wait()
    assert set(out) == set(batch)
    assert isinstance(out['x'], fake.FakeArray)
    numpy.testing.assert_array_equal(out['x'], x[:, ::2])
    numpy.testing.assert_array_equal(out['y'][0], t)
    assert out['y'][0].dtype == numpy.int32
    numpy.testing.assert_array_equal(out['y'][1][0], big_endian)
    assert out['y'][1][0].dtype == numpy.float64 and out['y'][1][0].dtype.isnative
    assert out['y'][1][1:] == [None, 7] and out['names'] is names
    assert out['empty'].shape == (0, 3)
    assert isinstance(out['y'], tuple) and isinstance(out['y'][1], list)


def test_stager_orders_copies_after_compute_and_reuses_pinned_buffers(fake):
    compute = fake.cuda.Stream()
    stager = _cuda.PinnedStager(device=0, compute_stream=compute)
    a = numpy.ones((8, 8), numpy.float32)
    for _ in range(_cuda.PINNED_SETS):   # one batch from each set of pinned buffers
        stager.stage((a, a[0]))
    pinned = list(fake.pinned)
    assert len(pinned) == 2 * _cuda.PINNED_SETS
    del fake.log[:]
    staged = stager.stage((a * 2, a[0] * 2))
    record, wait, h2d1, h2d2, done = fake.log
    assert record[:2] == ('record', compute)                        # after compute so far
    assert wait[:2] == ('wait', stager.stream) and wait[2] is record[2]
    assert h2d1[:2] == h2d2[:2] == ('h2d', stager.stream)          # on the side stream
    assert done[:2] == ('record', stager.stream)
    assert fake.pinned == pinned                                    # same size: reused
    consumer = fake.cuda.Stream()
    x, x0 = staged.wait(consumer)
    assert fake.log[-1] == ('wait', consumer, done[2])
    numpy.testing.assert_array_equal(x, a * 2)
    stager.stage((numpy.ones((16, 16), numpy.float32), a[0]))
    assert len(fake.pinned) == len(pinned) + 1                      # grown for the bigger one


def test_stager_waits_for_the_copies_of_the_batch_before_the_last(fake):
    """Two sets of pinned buffers in turn: staging a batch waits for the copies from its
    set, those of the batch before the last, not for the last one's (which wait for the
    compute queued before them); a copy that never finishes is a TimeoutError."""
    stager = _cuda.PinnedStager(device=0, timeout=0.05)
    stager.stage(numpy.ones(4, numpy.float32))
    fake.hang = True   # no copy finishes from now on
    stager.stage(numpy.ones(4, numpy.float32))   # from the other set: no wait
    with pytest.raises(TimeoutError, match=r'host-to-device copy to device 0'):
        stager.stage(numpy.ones(4, numpy.float32))   # the first set again: its copy


def test_unavailable_reason_without_cupy(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, 'cupy', None)
    assert _cuda.unavailable_reason().startswith('CuPy not installed')
    with pytest.raises(ImportError, match=r"mgpu_updater\[cuda12\]"):
        _cuda.PinnedStager(0)


_NO_CUBLAS = ImportError('libcublas.so.13: cannot open shared object file: No such file or '
                         'directory')


@pytest.fixture
def chainer_without_cuda(monkeypatch):
    """Chainer's verdict where CuPy imports but its CUDA libraries do not load (no [ctk])."""
    from chainer.backends import cuda
    monkeypatch.setattr(cuda, 'available', False)
    monkeypatch.setattr(cuda, '_resolution_error', _NO_CUBLAS, raising=False)
    return cuda


def test_unavailable_reason_reports_chainers_own_cuda_verdict(fake, chainer_without_cuda):
    assert _cuda.unavailable_reason() == (
        'Chainer cannot use CUDA: chainer.backends.cuda.available is False (ImportError: '
        'libcublas.so.13: cannot open shared object file: No such file or directory)')
    assert _cuda.unavailable_reason(nccl=True) == _cuda.unavailable_reason()


def test_a_cudnn_error_alone_is_not_a_reason(fake, monkeypatch):
    # Chainer keeps a failed cuDNN import in _resolution_error too, with CUDA available
    from chainer.backends import cuda
    monkeypatch.setattr(cuda, 'available', True)
    monkeypatch.setattr(cuda, '_resolution_error',
                        ModuleNotFoundError("No module named 'cupy.cuda.cudnn'"), raising=False)
    assert _cuda.chainer_cuda_unavailable() is None
    assert _cuda.unavailable_reason() is None   # the stand-in has one device and NCCL


def test_gpu_devices_are_refused_with_chainers_reason(chainer_without_cuda):
    from mgpu_updater import _validate
    with pytest.raises(ValueError, match=r"^devices\[0\] is '@cupy:0', a GPU, but CuPy is not "
                                         r'installed or cannot use CUDA: chainer\.backends\.'
                                         r'cuda\.available is False \(ImportError: '
                                         r'libcublas\.so\.13: cannot open'):
        _validate.devices(['@cupy:0', '@cupy:1'])


def test_the_gpu_fixtures_skip_with_the_real_reason(fake, chainer_without_cuda):
    import conftest
    for nccl in (False, True):
        with pytest.raises(pytest.skip.Exception, match=r'^Chainer cannot use CUDA: .*'
                                                        r'ImportError: libcublas\.so\.13'):
            conftest._cupy_or_skip(nccl=nccl)


# -- on a GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_stager_round_trip(gpu):
    cupy = gpu
    stager = _cuda.PinnedStager(0)
    x = numpy.random.RandomState(0).rand(64, 1, 28, 28).astype(numpy.float32)
    t = numpy.arange(64, dtype=numpy.int32)
    with cupy.cuda.Device(0):
        out_x, out_t = stager.stage((x, t)).wait()
        assert isinstance(out_x, cupy.ndarray) and out_x.device.id == 0
        numpy.testing.assert_array_equal(out_x.get(), x)
        numpy.testing.assert_array_equal(out_t.get(), t)
    stager.close()


@pytest.mark.gpu
def test_gpu_stager_many_batches_while_computing(gpu):
    # staging batch k+1 while batch k is being used must never corrupt either: pinned
    # buffers are reused and device memory is recycled through the memory pool
    cupy = gpu
    stager = _cuda.PinnedStager(0)
    n = 2 ** 20
    with cupy.cuda.Device(0):
        staged = stager.stage(numpy.full(n, 0, numpy.float32))
        sums = []
        for k in range(1, 30):
            current = staged.wait()
            staged = stager.stage(numpy.full(n, k, numpy.float32))   # overlaps the compute
            y = current
            for _ in range(20):
                y = y * 1.0 + 0.0
            sums.append(float(y.sum()))
            del current, y
        assert sums == [float(n * k) for k in range(0, 29)]
    stager.close()


# -- bench/gpu_check records the CUDA verdict and libraries (no GPU needed) -------------------

def _gpu_check():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        'bench', 'gpu_check.py')
    spec = importlib.util.spec_from_file_location('gpu_check_under_test', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_records_chainers_cuda_verdict(chainer_without_cuda):
    verdict = _gpu_check().chainer_cuda()
    assert verdict['available'] is False and verdict['cudnn_enabled'] is False
    assert verdict['resolution_error'] == f'ImportError: {_NO_CUBLAS}'
    assert verdict['unavailable_reason'] == _cuda.chainer_cuda_unavailable()
    assert 'libcublas.so.13' in verdict['unavailable_reason']


def _installed_cupy_major():
    from importlib.metadata import PackageNotFoundError, version
    for name in ('cupy-cuda13x', 'cupy-cuda12x', 'cupy'):
        try:
            return int(version(name).split('.')[0])
        except PackageNotFoundError:
            pass
    return None


def test_gpu_check_records_whether_cublas_nvrtc_curand_load():
    libs = _gpu_check().cuda_libraries('14.2.0')
    assert libs['cudnn'] == 'not supported by CuPy >= 14'
    names = ('cublas', 'nvrtc', 'curand')
    if (_installed_cupy_major() or 0) >= 14:   # make test-cupy14: CuPy 14 with [ctk]
        for name in names:
            assert libs[name]['loads'] is True, libs[name]
            assert f'/lib{name}.so.' in (libs[name]['path'] or ''), libs[name]
        assert isinstance(libs['curand']['version'], int) and libs['curand']['version'] > 0
        assert libs['nvrtc']['version'].split('.')[0].isdigit()
    elif _installed_cupy_major() is None:
        for name in names:
            assert libs[name] == {'loads': False,
                                  'error': "ModuleNotFoundError: No module named 'cupy'"}
