"""Run benchmark cases in this process and print one JSON line per finished case.

Usage (by ``bench/scaling.py``): ``python bench/_case.py '<json plan>'``; the plan holds
``common`` settings and a list of ``cases``. The orchestrator starts one such process per
thread setting, because BLAS reads its thread count once, when numpy is imported.

Methods (all train the same model on the same data for the same global batch ``n*k*b``):

- ``standard``: ``StandardUpdater``, one batch of ``n*k*b`` samples per update.
- ``hand``: the hand-written accumulation loop: ``cleargrads``; ``n*k`` micro-batches of ``b``,
  each ``forward``, loss scaled by ``1/(n*k)``, ``backward``; one ``optimizer.update()``.
- ``limit``: what ``n`` replicas could reach at best: ``n`` independent processes, each the
  hand-written loop with ``k`` micro-batches of ``b`` (no communication, nothing shared),
  started together; samples/s summed over them. BLAS threads as for ``n`` replicas.
- ``parallel``: Chainer's ``ParallelUpdater`` over ``n`` replicas, ``k*b`` samples each.
- ``multiprocess``: Chainer's ``MultiprocessParallelUpdater`` (NCCL, GPUs only).
- ``ours``: ``ParallelAccumulatingUpdater`` with ``n`` devices, ``k`` micro-batches of ``b``.
- ``memory``: peak memory of one update as ``k`` micro-batches of ``b`` versus one batch of
  ``k*b`` (tracemalloc on CPU, CuPy's memory pool on GPU).
- ``micro_batch`` (``bench/micro_batch.py``): ours with ``micro_batch_size`` set, samples/s
  and the peak memory of one update.
"""
import gc
import json
import multiprocessing
import os
import queue
import sys
import time
import traceback
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _common  # noqa: E402  (imports Chainer through the package's shim)

import chainer  # noqa: E402

TIME_KEYS = ('data', 'compute', 'comm', 'update')


def _observed_step(updater, model, others=()):
    """``updater.update()`` inside a reporter scope, as under a Trainer; returns the report.

    ``others``: (name, model) pairs of further replicas that report, as registered by
    ``ParallelUpdater.connect_trainer``.
    """
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    reporter.add_observers('main', model.namedlinks(skipself=True))
    for name, other in others:
        reporter.add_observer(name, other)

    def step():
        observation = {}
        with reporter.scope(observation):
            updater.update()
        return observation
    return step


def _float(value):
    try:
        return float(value)
    except TypeError:  # a 0-dim array or a Variable
        return float(getattr(value, 'array', value))


def _run_timed(step, global_batch, common, sync, collect=None):
    return _common.time_rounds(step, global_batch, common['warmup'], common['rounds'],
                               common['updates'], sync=sync, on_timed=collect)


def run_standard(case, common, dataset, kind):
    n, k, b = case['n'], case['k'], common['micro_batch']
    model = _common.make_model(common['model'])
    device = _common.device_spec(kind, 0)
    model.to_device(device)
    optimizer = _common.make_optimizer(model)
    iterator = chainer.iterators.SerialIterator(dataset, n * k * b, shuffle=True)
    updater = chainer.training.updaters.StandardUpdater(iterator, optimizer, device=device)
    step = _observed_step(updater, model)
    return {'samples_per_s': _run_timed(step, n * k * b, common,
                                        lambda: _common.synchronize(kind))}


def _hand_step(model, optimizer, iterator, micro_batches, device, fwd_bwd=None):
    """The hand-written loop's update; with a list ``fwd_bwd``, each update appends the
    seconds its forwards and backwards took (not the loading, not the step)."""
    convert = chainer.dataset.concat_examples
    clock = time.perf_counter

    def update():
        model.cleargrads()
        seconds = 0.0
        for _ in range(micro_batches):
            x, t = convert(iterator.next(), device)
            start = clock()
            loss = model(x, t) / micro_batches
            loss.backward()
            seconds += clock() - start
            del loss
        optimizer.update()
        if fwd_bwd is not None:
            fwd_bwd.append(seconds)
    return update


def run_hand(case, common, dataset, kind):
    n, k, b = case['n'], case['k'], common['micro_batch']
    model = _common.make_model(common['model'])
    device = _common.device_spec(kind, 0)
    model.to_device(device)
    optimizer = _common.make_optimizer(model)
    iterator = chainer.iterators.SerialIterator(dataset, b, shuffle=True)
    update = _hand_step(model, optimizer, iterator, n * k, device)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)

    def step():
        with reporter.scope({}):
            update()
    return {'samples_per_s': _run_timed(step, n * k * b, common,
                                        lambda: _common.synchronize(kind))}


def _limit_rank(rank, case, common, kind, barrier, results):
    """One of the ``limit`` case's independent loops: the hand-written loop at ``k`` x ``b``,
    each timed round started together with the other ranks' (a barrier), timed on its own.
    Puts (rank, samples/s of every round) or (rank, traceback) on ``results``."""
    try:
        k, b = case['k'], common['micro_batch']
        dataset = _common.make_dataset(common['dataset_size'], seed=0)
        model = _common.make_model(common['model'])
        device = _common.device_spec(kind, rank)   # GPU: one device per rank
        model.to_device(device)
        optimizer = _common.make_optimizer(model)
        iterator = chainer.iterators.SerialIterator(dataset, b, shuffle=True)
        update = _hand_step(model, optimizer, iterator, k, device)
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)

        def step():
            with reporter.scope({}):
                update()
        for _ in range(common['warmup']):
            step()
        rates = []
        for _ in range(common['rounds']):
            barrier.wait(timeout=_LIMIT_WAIT)
            rates += _common.time_rounds(step, k * b, 0, 1, common['updates'],
                                         sync=lambda: _common.synchronize(kind))
        results.put((rank, rates))
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it
        barrier.abort()
        results.put((rank, traceback.format_exc()))


_LIMIT_WAIT = 600.0   # seconds a rank of the limit case waits for the others


def run_limit(case, common, dataset, kind):
    """``n`` independent hand-written loops (this process is rank 0, the others are spawned,
    inheriting the BLAS thread setting); samples/s of each round summed over the ranks."""
    n = case['n']
    ctx = multiprocessing.get_context('spawn')
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_limit_rank, args=(r, case, common, kind, barrier, results))
             for r in range(1, n)]
    for p in procs:
        p.start()
    try:
        _limit_rank(0, case, common, kind, barrier, results)
        by_rank = {}
        while len(by_rank) < n:
            try:
                rank, rates = results.get(timeout=_LIMIT_WAIT)
            except queue.Empty:
                raise RuntimeError('a rank of the limit case sent nothing') from None
            if isinstance(rates, str):
                raise RuntimeError('limit rank {} failed:\n{}'.format(rank, rates))
            by_rank[rank] = rates
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return {'samples_per_s': [sum(r) for r in zip(*by_rank.values())],
            'samples_per_s_by_rank': [by_rank[r] for r in sorted(by_rank)]}


def run_parallel(case, common, dataset, kind):
    n, k, b = case['n'], case['k'], common['micro_batch']
    model = _common.make_model(common['model'])
    optimizer = _common.make_optimizer(model)
    devices = {'main': _common.device_spec(kind, 0)}
    devices.update({'replica{}'.format(i): _common.device_spec(kind, i) for i in range(1, n)})
    iterator = chainer.iterators.SerialIterator(dataset, n * k * b, shuffle=True)
    updater = chainer.training.updaters.ParallelUpdater(iterator, optimizer, devices=devices)
    others = [(name, m) for name, m in updater._models.items() if m is not model]
    step = _observed_step(updater, model, others)
    return {'samples_per_s': _run_timed(step, n * k * b, common,
                                        lambda: _common.synchronize(kind))}


def run_multiprocess(case, common, dataset, kind):
    n, k, b = case['n'], case['k'], common['micro_batch']
    model = _common.make_model(common['model'])
    optimizer = _common.make_optimizer(model)
    shards = chainer.datasets.split_dataset_n_random(dataset, n, seed=0)
    iterators = [chainer.iterators.SerialIterator(shard, k * b, shuffle=True)
                 for shard in shards]
    updater = chainer.training.updaters.MultiprocessParallelUpdater(
        iterators, optimizer, devices=list(range(n)))
    try:
        step = _observed_step(updater, model)
        rates = _run_timed(step, n * k * b, common, lambda: _common.synchronize(kind))
    finally:
        updater.finalize()
    return {'samples_per_s': rates}


def _our_updater(model, dataset, kind, n, batch_size, **kwargs):
    """``ParallelAccumulatingUpdater`` for ``model`` on ``n`` devices, each reading its own
    shuffled shard of ``dataset`` in micro-batches of ``batch_size``."""
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators
    optimizer = _common.make_optimizer(model)
    iterators = shard_iterators(dataset, n=n, batch_size=batch_size,
                                iterator_class=chainer.iterators.SerialIterator,
                                seed=0, shuffle=True)
    devices = [_common.device_spec(kind, i) for i in range(n)]
    return ParallelAccumulatingUpdater(iterators, optimizer, devices=devices, **kwargs)


def run_ours(case, common, dataset, kind):
    n, k, b = case['n'], case['k'], common['micro_batch']
    model = _common.make_model(common['model'])
    updater = _our_updater(model, dataset, kind, n, b, accumulate_steps=k, report_times=True)
    timed = []
    try:
        step = _observed_step(updater, model)
        rates = _run_timed(step, n * k * b, common, lambda: _common.synchronize(kind),
                           collect=timed.append)
    finally:
        updater.finalize()
    result = {'samples_per_s': rates}
    times = {key: [_float(obs['main/time/' + key]) for obs in timed if 'main/time/' + key in obs]
             for key in TIME_KEYS}
    times = {key: values for key, values in times.items() if values}
    if times:
        result['times_per_update'] = times  # seconds, every timed update
    return result


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

def pool_footprint(fn):
    """(bytes CuPy's memory pool holds before ``fn``, after ``fn``): with the cached blocks
    freed first, the pool keeps every block ``fn`` needed at its peak, so the second is
    that peak."""
    import cupy
    pool = cupy.get_default_memory_pool()
    gc.collect()
    _common.synchronize('gpu')
    pool.free_all_blocks()
    before = pool.total_bytes()
    fn()
    _common.synchronize('gpu')
    return before, pool.total_bytes()


def _peak_bytes(fn, kind):
    """Peak bytes allocated on top of what was live when ``fn`` started."""
    if kind == 'gpu':
        before, after = pool_footprint(fn)
        return after - before
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_memory(case, common, dataset, kind):
    """One update as ``k`` micro-batches of ``b`` versus one batch of ``k*b``, same process."""
    k, b = case['k'], common['micro_batch']
    device = _common.device_spec(kind, 0)
    model = _common.make_model(common['model'])
    model.to_device(device)
    optimizer = _common.make_optimizer(model)
    param_bytes = sum(p.array.nbytes for p in model.params())

    micro = chainer.iterators.SerialIterator(dataset, b, shuffle=False)
    accumulate = _hand_step(model, optimizer, micro, k, device)
    big = chainer.iterators.SerialIterator(dataset, k * b, shuffle=False)

    def one_batch():
        model.cleargrads()
        x, t = chainer.dataset.concat_examples(big.next(), device)
        loss = model(x, t)
        loss.backward()
        del loss
        optimizer.update()

    # Warm up both paths: the optimizer state and any first-call caches exist before measuring.
    accumulate()
    one_batch()
    accumulated = _peak_bytes(accumulate, kind)
    single = _peak_bytes(one_batch, kind)
    result = {}
    ours = _ours_peak_bytes(common, dataset, kind, k)
    if ours is not None:
        result = {'ours_peak_bytes': ours, 'ratio_peak_ours': ours / single,
                  'ratio_activation_ours': (ours - param_bytes) / (single - param_bytes)}
    return dict(result, **{
        'accumulated_peak_bytes': accumulated,
        'one_batch_peak_bytes': single,
        'gradient_bytes': param_bytes,
        'ratio_peak': accumulated / single,
        'accumulated_activation_bytes': accumulated - param_bytes,
        'one_batch_activation_bytes': single - param_bytes,
        'ratio_activation': (accumulated - param_bytes) / (single - param_bytes),
        'measured_with': 'tracemalloc' if kind == 'cpu' else 'cupy memory pool',
    })


def _ours_peak_bytes(common, dataset, kind, k):
    """Peak of one ``ParallelAccumulatingUpdater`` update on one device (the master computes
    in this process; prefetched micro-batches included). None without the package."""
    try:
        from mgpu_updater import ParallelAccumulatingUpdater
    except ImportError:
        return None
    model = _common.make_model(common['model'])
    optimizer = _common.make_optimizer(model)
    iterator = chainer.iterators.SerialIterator(dataset, common['micro_batch'], shuffle=False)
    updater = ParallelAccumulatingUpdater([iterator], optimizer,
                                          devices=[_common.device_spec(kind, 0)],
                                          accumulate_steps=k, report_times=False)
    try:
        updater.update()  # warm-up: optimizer state, prefetch thread
        return _peak_bytes(updater.update, kind)
    finally:
        updater.finalize()


def run_micro_batch(case, common, dataset, kind):
    """``ParallelAccumulatingUpdater`` on ``n`` devices, a global batch of ``G`` (``G/n``
    loaded per device), each loaded batch run as chunks of ``micro_batch_size`` (None:
    whole): samples/s, then the peak memory of one more update (tracemalloc on CPU, which
    sees the master's replica only; CuPy's pool on GPU)."""
    n, global_batch = case['n'], common['global_batch']
    model = _common.make_model(case['model'])
    updater = _our_updater(model, dataset, kind, n, global_batch // n, report_times=False,
                           micro_batch_size=case['micro_batch_size'])
    try:
        rates = _run_timed(_observed_step(updater, model), global_batch, common,
                           lambda: _common.synchronize(kind))
        peak = _peak_bytes(updater.update, kind)
    finally:
        updater.finalize()
    return {'samples_per_s': rates, 'peak_bytes': peak,
            'gradient_bytes': sum(p.array.nbytes for p in model.params()),
            'measured_with': 'tracemalloc' if kind == 'cpu' else 'cupy memory pool'}


RUNNERS = {
    'standard': run_standard,
    'standard_1t': run_standard,  # the orchestrator runs it with one BLAS thread
    'hand': run_hand,
    'limit': run_limit,
    'parallel': run_parallel,
    'multiprocess': run_multiprocess,
    'ours': run_ours,
    'memory': run_memory,
    'micro_batch': run_micro_batch,  # bench/micro_batch.py
}


def main(argv):
    plan = json.loads(argv[1])
    common = plan['common']
    kind = common['device_kind']
    dataset = _common.make_dataset(common['dataset_size'], seed=0)
    _common.emit({'event': 'started', 'pid': os.getpid(),
                  'threads': _common.current_thread_env(),
                  'blas': _common.blas_info()})
    for case in plan['cases']:
        gc.collect()
        start = time.perf_counter()
        record = dict(case)
        try:
            record.update(RUNNERS[case['method']](case, common, dataset, kind))
        except Exception:
            record['error'] = traceback.format_exc()
        record['wall_s'] = time.perf_counter() - start
        record['event'] = 'case'
        _common.emit(record)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
