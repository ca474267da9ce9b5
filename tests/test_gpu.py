"""The updater on one GPU ('@cupy:0'): equivalence, CUDA-stream prefetch, float16.

Marked ``gpu``; each skips with the reason when CuPy or a CUDA device is missing. With one
GPU there are no workers: multi-replica logic is proven on CPU replicas through the same
communicator interface, and NCCL itself in tests/test_nccl.py.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import classifier, dataset, params, run_updates, setup_optimizer

pytestmark = pytest.mark.gpu


def _reference(model, opt, data, samples_per_update, updates, device):
    losses = []
    for u in range(updates):
        batch = data[u * samples_per_update:(u + 1) * samples_per_update]
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        updater = StandardUpdater(it, opt, device=device)
        losses.append(float(run_updates(updater, model, 1)[0]['main/loss'].array))
    return losses


@pytest.mark.parametrize('prefetch', [0, 2])
def test_one_gpu_with_accumulation_matches_the_large_batch(gpu, prefetch):
    b, k, updates = 8, 4, 3
    data = dataset(b * k * updates, seed=1)
    model, ref = classifier(seed=1), classifier(seed=1)
    opt = setup_optimizer('momentum+decay', model)
    it = chainer.iterators.SerialIterator(data, b, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@cupy:0'], accumulate_steps=k,
                                          prefetch=prefetch)
    try:
        # the master alone on a GPU reports device arrays (nonfinite='raise' reads nothing
        # before the step), as StandardUpdater does
        losses = [float(o['main/loss']) for o in run_updates(updater, model, updates)]
    finally:
        updater.finalize()
    assert isinstance(model.predictor.l1.W.array, gpu.ndarray)
    ref_losses = _reference(ref, setup_optimizer('momentum+decay', ref), data, b * k, updates,
                            '@cupy:0')
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = params(_to_cpu(model))
    for name, value in params(_to_cpu(ref)).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _to_cpu(model):
    copy = model.copy(mode='copy')
    copy.to_device('@numpy')
    return copy


def test_prefetch_stages_batches_on_a_side_stream(gpu):
    from mgpu_updater._loader import make_loader
    device = chainer.get_device('@cupy:0')
    device.use()
    it = chainer.iterators.SerialIterator(dataset(64, seed=2), 16, shuffle=False)
    loader = make_loader(it, chainer.dataset.concat_examples, device, 2)
    try:
        batch = loader.get()
        x, t = batch.arrays
        assert isinstance(x, gpu.ndarray) and x.shape == (16, 5)
        np.testing.assert_array_equal(gpu.asnumpy(x), dataset(64, seed=2)._datasets[0][:16])
        second = loader.get()
        np.testing.assert_array_equal(gpu.asnumpy(second.arrays[1]),
                                      dataset(64, seed=2)._datasets[1][16:32])
    finally:
        loader.close()


def test_float16_dynamic_loss_scaling_on_gpu(gpu):
    with chainer.using_config('dtype', np.float16):
        model, ref = classifier(seed=3), classifier(seed=3)
    data = dataset(4 * 8 * 3, seed=3, dtype=np.float16)

    def opt_for(m):
        opt = chainer.optimizers.SGD(0.1)
        opt.setup(m)
        opt.use_fp32_update()
        opt.loss_scaling(interval=2)
        return opt
    opt = opt_for(model)
    it = chainer.iterators.SerialIterator(data, 8, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@cupy:0'], accumulate_steps=4)
    ref_opt = opt_for(ref)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', 'Non finite number found in param.grad')
        try:
            run_updates(updater, model, 3)
        finally:
            updater.finalize()
        _reference(ref, ref_opt, data, 32, 3, '@cupy:0')
    assert opt._loss_scale == ref_opt._loss_scale
    got = params(_to_cpu(model))
    for name, value in params(_to_cpu(ref)).items():
        assert got[name].dtype == np.float16
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32),
                                   rtol=2e-2, atol=2e-3, err_msg=name)


@pytest.mark.parametrize('prefetch', [0, 2])
def test_two_replicas_on_one_gpu_match_the_large_batch(gpu, prefetch):
    """devices=['@cupy:0', '@cupy:0']: a worker process with CUDA on the same GPU, GPU
    prefetch in it, gradients staged through host shared memory (NCCL refuses two ranks on
    one GPU), against StandardUpdater on the same samples in one batch."""
    from mgpu_updater import comm
    b, k, updates = 4, 2, 3
    datasets = [dataset(b * k * updates, seed=5 + r) for r in range(2)]
    model, ref = classifier(seed=5), classifier(seed=5)
    opt = setup_optimizer('momentum+decay', model)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    devices = ['@cupy:0', '@cupy:0']
    assert comm.backend_for([chainer.get_device(d) for d in devices]) == 'shm'
    updater = ParallelAccumulatingUpdater(its, opt, devices=devices, accumulate_steps=k,
                                          prefetch=prefetch)
    try:
        losses = [o['main/loss'] for o in run_updates(updater, model, updates)]
    finally:
        updater.finalize()
    ref_opt = setup_optimizer('momentum+decay', ref)
    ref_losses = []
    for u in range(updates):
        batch = [s for d in datasets for s in d[u * k * b:(u + 1) * k * b]]
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        updater = StandardUpdater(it, ref_opt, device='@cupy:0')
        ref_losses.append(float(run_updates(updater, ref, 1)[0]['main/loss'].array))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = params(_to_cpu(model))
    for name, value in params(_to_cpu(ref)).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_read_on_host_reads_every_value_as_float_does(gpu):
    """One stacked read per device gives what ``float()`` of each value gives."""
    from mgpu_updater._replica import read_on_host
    loss = gpu.asarray(np.float32(0.1234567))
    values = [loss, chainer.Variable(gpu.asarray(np.float32(-2.5e-8))),
              gpu.asarray(np.float16(3.14)), gpu.asarray([7], dtype=np.int32),
              np.float32(1.1), 2, gpu.asarray([1.0, 2.0], dtype=np.float32)]
    got = read_on_host(values)
    expected = [float(loss), float(np.float32(-2.5e-8)), float(np.float16(3.14)), 7.0,
                float(np.float32(1.1)), 2.0]
    assert got[:6] == expected
    assert all(type(v) is float for v in got[:6])
    np.testing.assert_array_equal(got[6], np.array([1.0, 2.0]))
    assert got[6].dtype == np.float64


@pytest.mark.parametrize('nonfinite,prefetch', [('skip', 0), ('raise', 0), ('raise', 2),
                                                ('ignore', 0), ('ignore', 2)])
def test_the_master_alone_waits_for_its_device_only_to_skip(gpu, nonfinite, prefetch):
    """``'skip'`` reads the window's loss before the step (it must not step on a NaN), so
    ``update()`` returns only after the device finished what was queued before it.
    ``'raise'`` (the default; its check one step late: mgpu_updater/_late_check.py) and
    ``'ignore'`` read nothing: ``update()`` returns while a long computation queued before
    it still runs, and reports device arrays."""
    b, k = 8, 2
    data = dataset(b * k * 4, seed=3)
    model = classifier(seed=3)
    opt = setup_optimizer('momentum+decay', model)
    it = chainer.iterators.SerialIterator(data, b, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@cupy:0'], accumulate_steps=k,
                                          prefetch=prefetch, nonfinite=nonfinite)
    try:
        run_updates(updater, model, 1)    # start-up, lazy parameters, the first step
        gpu.cuda.Device(0).synchronize()
        busy = gpu.ones((4096, 4096), dtype=np.float32)
        for _ in range(60):               # about 0.1 s of matrix products on the null stream
            busy = (busy @ busy) * np.float32(1e-4)
        queued = gpu.cuda.Event()
        queued.record()
        observation = run_updates(updater, model, 1)[0]
        finished = queued.done
        gpu.cuda.Device(0).synchronize()
    finally:
        updater.finalize()
    assert finished == (nonfinite == 'skip')
    if nonfinite != 'skip':
        assert isinstance(observation['main/loss'], gpu.ndarray)
    else:
        assert type(observation['main/loss']) is float


def test_a_nan_loss_on_the_gpu_raises_by_the_next_step(gpu):
    """The default check, one step late on a GPU (mgpu_updater/_late_check.py): update 2's
    loss is NaN; update 2 returns with its step applied; update 3 raises naming update 2,
    through the loss's copy to pinned memory and its event (tests/test_late_check.py
    runs the rest of the protocol on the CPU)."""
    from mgpu_updater import NonFiniteLossError
    b = 8
    data = dataset(b * 4, seed=4)
    model = classifier(seed=4)
    opt = setup_optimizer('momentum+decay', model)

    def loss_func(x, t):
        loss = model(x, t)
        return loss * np.float32('nan') if updater.iteration == 1 else loss   # update 2

    it = chainer.iterators.SerialIterator(data, b, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@cupy:0'], loss_func=loss_func,
                                          prefetch=0)
    try:
        run_updates(updater, model, 2)
        assert updater.iteration == 2
        assert bool(gpu.isnan(model.predictor.l1.W.array).any())   # its step was applied
        with pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2; '
                                                     r'its step was applied') as info:
            run_updates(updater, model, 1)
        assert info.value.iteration == 2 and info.value.applied
    finally:
        updater.finalize()


def test_a_gpu_masters_window_leaves_the_host_blas_alone(gpu):
    """``blas_threads`` limits the master's libraries while it computes a CPU replica's
    window; a GPU window runs no host BLAS, so there they keep their count (and the update
    makes no call to change it and back)."""
    import threadpoolctl

    def blas():
        return {p['num_threads'] for p in threadpoolctl.threadpool_info()
                if p['user_api'] == 'blas'}
    before = blas()
    model = classifier(seed=3)
    seen = []

    def loss(x, t):
        seen.append(blas())
        return model(x, t)
    it = chainer.iterators.SerialIterator(dataset(32, seed=3), 8, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@cupy:0'], loss_func=loss,
                                          blas_threads=max(before) + 1)
    try:
        run_updates(updater, model, 2)
    finally:
        updater.finalize()
    assert len(seen) == 2 and all(s == before for s in seen), (before, seen)
