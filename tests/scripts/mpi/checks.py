"""Run under ``mpiexec -n 2 python -m mpi4py checks.py OUT.json``; rank 0 writes OUT.json.

Every check runs on every rank; the results of all ranks are gathered and rank 0 writes
what the test asserts on:

- ``verbs``: MpiCommunicator's reduce / bcast / allreduce on float16/32/64 and int buffers,
  compared with the sum computed in numpy;
- ``cases``: ParallelAccumulatingUpdater over the ranks (unequal batch sizes, k=1 and k=3,
  a short last window) against a single-process StandardUpdater on the batch holding every
  sample of the update; the ranks' final parameters and reported values, bitwise;
- ``batchnorm``: BatchNorm running statistics equal the mean over the ranks of what each
  rank's micro-batches would have made alone;
- ``pipelined``: ``pipelined=True`` keeps the ranks bitwise identical;
- ``model_mismatch``: different models on the ranks raise on every rank;
- ``lazy_mismatch``: a lazy link one rank's initialising pass reaches and another's does
  not raises on every rank, naming it;
- ``debug_sync``: under ``chainer.set_debug(True)`` a rank whose parameters drifted is named;
- ``order_mismatch``: a rank that issues its allreduces in another order than the declared
  one makes every rank raise CollectiveOrderError, naming both sequences;
- ``settings_mismatch``: a rank given another ``loss_reduction`` (or ``replica_reduction``,
  ``pipelined``, ``nonfinite``) raises on every rank, naming it;
- ``optimizer_mismatch``: a rank whose optimizer has another hyperparameter, given so
  or set so later on that rank alone, raises on every rank before the step, naming it;
- ``counters``: integer persistents a forward moves (a counter of samples, a Python int
  counter) hold rank 0's on every rank, and ``set_debug(True)`` sees the ranks agree.
- ``made_once``: a projection each rank's forward draws at its first call (from its own
  seed) is named by rank 0, after the third update; rank 1 warns of nothing.
- ``value_persistent``: a number persistent that rank 0 gives a 0-d array between updates
  holds it on every rank after the next update (it was dropped).
- ``lost_kept``: an int array persistent that every rank gives a number raises on every
  rank, naming it (rank 0 raised a bare KeyError before the exchange; rank 1 waited).
"""
import copy
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))   # tests/

import mgpu_updater  # noqa: E402,F401  (applies the compat shim before chainer)
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import chainermn  # noqa: E402
from chainer.training.updaters import StandardUpdater  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater  # noqa: E402
from mgpu_updater import _multihost  # noqa: E402
from mgpu_updater.comm.base import CollectiveOrderError  # noqa: E402
from mgpu_updater.comm.mpi import MpiCommunicator  # noqa: E402

from _models import (classifier, dataset, params, persistents, run_updates,  # noqa: E402
                     setup_optimizer)

comm = chainermn.create_communicator('naive')
RANK, SIZE = comm.rank, comm.size


def gathered(obj):
    return comm.mpi_comm.allgather(obj)


def bitwise_equal(dicts):
    first = dicts[0]
    return all(d.keys() == first.keys() and all(
        np.array_equal(np.asarray(d[k]), np.asarray(first[k])) for k in first) for d in dicts)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))))
               for k in a)


# ---------------------------------------------------------------------------- verbs
def check_verbs():
    out = {}
    for dtype in ['float16', 'float32', 'float64', 'int32']:
        spec = {'grad/x': (dtype, 7), 'param/x': (dtype, 7)}
        mpi = MpiCommunicator(comm, spec, '@numpy')
        mine = (np.arange(7) + 10 * RANK).astype(dtype)
        total = sum((np.arange(7) + 10 * r).astype(dtype) for r in range(SIZE))
        ok = {}
        mpi.buffer('grad/x')[...] = mine
        mpi.reduce('grad/x', root=0)
        ok['reduce'] = bool(np.array_equal(mpi.buffer('grad/x'), total)) if RANK == 0 else True
        mpi.buffer('grad/x')[...] = mine
        mpi.allreduce('grad/x')
        ok['allreduce'] = bool(np.array_equal(mpi.buffer('grad/x'), total))
        mpi.buffer('param/x')[...] = mine
        mpi.bcast('param/x', root=SIZE - 1)
        ok['bcast'] = bool(np.array_equal(mpi.buffer('param/x'),
                                          (np.arange(7) + 10 * (SIZE - 1)).astype(dtype)))
        mpi.finalize()
        mpi.finalize()   # twice is fine
        try:
            mpi.buffer('grad/x')
            ok['use_after_finalize_raises'] = False
        except RuntimeError:
            ok['use_after_finalize_raises'] = True
        out[dtype] = ok
    return out


# ---------------------------------------------------------------------------- updates
def reference(model, datasets, batch_sizes, k, updates, opt_kind):
    """StandardUpdater on one batch holding every sample of each update."""
    opt = setup_optimizer(opt_kind, model)
    losses = []
    for u in range(updates):
        batch = []
        for d, b in zip(datasets, batch_sizes):
            batch.extend(d[u * k * b:(u + 1) * k * b])
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        obs = run_updates(StandardUpdater(it, opt), model, 1)[0]
        losses.append(float(obs['main/loss'].array))
    return losses


def ours(model, data, batch_size, k, opt_kind, repeat, updates=None):
    opt = setup_optimizer(opt_kind, model)
    it = chainer.iterators.SerialIterator(data, batch_size, shuffle=False, repeat=repeat)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], accumulate_steps=k,
                                          communicator=comm, report_times=True)
    observations = []
    try:
        while updates is None or len(observations) < updates:
            try:
                observations.extend(run_updates(updater, model, 1))
            except StopIteration:
                break
        nominal_samples = updater._nominal_samples
    finally:
        updater.finalize()
    return observations, nominal_samples


CASES = [
    # name, per-rank batch sizes, accumulate_steps, per-rank sample counts, updates, repeat
    ('k1_unequal', (3, 5), 1, (12, 20), 4, True),
    ('k3_unequal', (2, 4), 3, (18, 36), 3, True),
    ('short_last_window', (2, 3), 2, (10, 15), None, False),
]


def check_case(name, batch_sizes, k, counts, updates, repeat, opt_kind='momentum+decay'):
    with chainer.using_config('dtype', np.float64):
        datasets = [dataset(n, seed=100 + r, dtype=np.float64) for r, n in enumerate(counts)]
        n_ref = updates or -(-counts[0] // (k * batch_sizes[0]))
        ref_model = classifier(seed=0)
        ref_losses = reference(ref_model, datasets, batch_sizes, k, n_ref, opt_kind)
        # Rank 1 starts from other weights: the broadcast at start must fix that.
        model = classifier(seed=RANK)
        observations, nominal_samples = ours(model, datasets[RANK], batch_sizes[RANK], k,
                                         opt_kind, repeat, updates)
    mine = params(model)
    reported = [{key: float(v) for key, v in o.items() if not key.startswith('main/time/')}
                for o in observations]
    everyone = gathered((mine, reported))
    return {
        'updates': len(observations),
        'reference_updates': n_ref,
        'nominal_samples': nominal_samples,
        'expected_nominal_samples': float(k * sum(batch_sizes)),
        'params_bitwise_equal_across_ranks': bitwise_equal([p for p, _ in everyone]),
        'reports_equal_across_ranks': all(r == everyone[0][1] for _, r in everyone),
        'max_param_diff_vs_reference': max_diff(mine, params(ref_model)),
        'losses': [o['main/loss'] for o in reported],
        'reference_losses': ref_losses,
        'time_keys': sorted(k for k in observations[0] if k.startswith('main/time/')),
    }


def check_batchnorm(k=2, batch_sizes=(4, 6)):
    datasets = [dataset(40, seed=200 + r) for r in range(SIZE)]
    model = classifier(seed=0, batchnorm=True)
    alone = copy.deepcopy(model)    # what this rank's micro-batches do to BN by themselves
    b = batch_sizes[RANK]
    with chainer.using_config('train', True), chainer.no_backprop_mode():
        for j in range(k):
            x, t = chainer.dataset.concat_examples(datasets[RANK][j * b:(j + 1) * b])
            alone(x, t)
    alone_stats = persistents(alone)
    observations, _ = ours(model, datasets[RANK], b, k, 'sgd', True, updates=1)
    stats = persistents(model)
    everyone = gathered((alone_stats, stats))
    mean = {key: np.mean([a[key] for a, _ in everyone], axis=0) for key in alone_stats}
    floats = sorted(key for key in mean if mean[key].dtype.kind == 'f')
    return {
        'stats_bitwise_equal_across_ranks': bitwise_equal([s for _, s in everyone]),
        'max_diff_vs_mean_of_ranks': max_diff({k_: stats[k_] for k_ in floats},
                                              {k_: mean[k_] for k_ in floats}),
        'float_stats': floats,
        'ranks_alone_differ': not bitwise_equal([a for a, _ in everyone]),
    }


def check_debug_sync():
    """Under chainer.set_debug(True) every update first checks the ranks agree."""
    model = classifier(seed=0)
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(20, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], communicator=comm)
    out = {}
    try:
        with chainer.using_config('debug', True):
            run_updates(updater, model, 2)
            out['in_sync_passes'] = True
            if RANK == 1:
                model.predictor.l1.W.array[0, 0] += 1.0
            try:
                run_updates(updater, model, 1)
                out['drift_raises'] = None
            except RuntimeError as e:
                out['drift_raises'] = str(e)
    finally:
        updater.finalize()
    return gathered(out)


def check_pipelined(updates=3):
    """pipelined=True across ranks: the ranks stay bitwise identical."""
    model = classifier(seed=0)
    opt = setup_optimizer('adam', model)
    it = chainer.iterators.SerialIterator(dataset(24, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], accumulate_steps=2,
                                          pipelined=True, communicator=comm)
    try:
        run_updates(updater, model, updates)
    finally:
        updater.finalize()
    start = params(classifier(seed=0))
    mine = params(model)
    return {'ranks_equal': bitwise_equal(gathered(mine)),
            'moved': max_diff(mine, start) > 0, 'iteration': updater.iteration}


def _refused_at_start(model, **kwargs):
    """The ValueError one update raises on this rank (None: none)."""
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(8, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], communicator=comm,
                                          **kwargs)
    try:
        run_updates(updater, model, 1)
        return None
    except ValueError as e:
        return str(e)
    finally:
        updater.finalize()


class _ReachedOnSomeRanks(chainer.Chain):
    """Lazy links that only some ranks' inputs reach (here: flags), in every mode."""

    def __init__(self, reach_extra, reach_other=False):
        super().__init__()
        np.random.seed(0)
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
            self.extra = L.Linear(None, 3)
            self.other = L.Linear(None, 3)
        self.reach_extra, self.reach_other = reach_extra, reach_other

    def forward(self, x, t):
        h = self.l1(x)
        if self.reach_extra:
            h = h + self.extra(x)
        if self.reach_other:
            h = h + self.other(x)
        return F.softmax_cross_entropy(h, t)


def check_lazy_mismatch():
    """A lazy link that rank 1's initialising pass reaches and rank 0's does not (and,
    crossed, one that only rank 0's reaches): every rank raises, naming them and the
    fix."""
    return (_refused_at_start(_ReachedOnSomeRanks(RANK == 1)),
            _refused_at_start(_ReachedOnSomeRanks(RANK == 1, RANK == 0)))


def check_model_mismatch():
    """Rank 1 builds another model: every rank raises when the group starts."""
    return _refused_at_start(classifier(seed=0, n_hidden=16 + RANK))


class BatchNormOnly(chainer.Chain):
    """As many gradient values as float statistics (8 and 8 float32): allreduces issued in
    a swapped order pass through MPI without an error, pairing one buffer with the other."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.bn = L.BatchNormalization(4)

    def forward(self, x, t):
        return F.mean_squared_error(self.bn(x), t)


def check_order_mismatch():
    """Rank 1 reduces the gradients before the statistics (the order bug of the local
    workers): every rank raises after its update's collectives, naming both sequences."""
    declared = _multihost.collective_order

    def grads_first(layouts, parity=None, across_hosts=False):
        order = declared(layouts, parity, across_hosts)
        if not across_hosts:
            return order
        return (tuple(c for c in order if c.buffer.startswith('grad'))
                + tuple(c for c in order if not c.buffer.startswith('grad')))

    rng = np.random.RandomState(RANK)
    data = chainer.datasets.TupleDataset(rng.randn(16, 4).astype(np.float32),
                                         rng.randn(16, 4).astype(np.float32))
    model = BatchNormOnly()
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(data, 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], communicator=comm)
    before = params(model)
    if RANK == 1:
        _multihost.collective_order = grads_first
    out = {}
    try:
        run_updates(updater, model, 1)
        out['raised'] = None
    except CollectiveOrderError as e:
        out['raised'] = str(e)
        out['update'] = e.update
    finally:
        _multihost.collective_order = declared
        updater.finalize()
    out['model_untouched'] = bitwise_equal([before, params(model)])
    return gathered(out)


def check_settings_mismatch():
    """Rank 1 sums its loss where rank 0 averages: every rank raises at the start."""
    return _refused_at_start(classifier(seed=0),
                             loss_reduction='sum' if RANK == 1 else 'mean')


def check_optimizer_mismatch(updates=3):
    """Rank 1 built its optimizer with another lr (raised at update 1); then an lr an
    'extension' halves on rank 0 alone after update 1 (raised at update 2, before its
    step: the ranks' parameters still equal). Each: (update raised at, message, this
    rank's parameters)."""
    out = []
    for drift in (False, True):
        model = classifier(seed=0)
        opt = setup_optimizer('sgd', model)
        if not drift and RANK == 1:
            opt.lr *= 2
        it = chainer.iterators.SerialIterator(dataset(16, seed=RANK), 4, shuffle=False)
        updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'],
                                              communicator=comm)
        raised = message = None
        try:
            for i in range(updates):
                try:
                    run_updates(updater, model, 1)
                except RuntimeError as e:
                    raised, message = i + 1, str(e)
                    break
                if drift and RANK == 0:
                    opt.lr /= 2   # as ExponentialShift under `if comm.rank == 0` would
        finally:
            updater.finalize()
        out.append((raised, message, params(model)))
    return out


class Counting(chainer.Chain):
    """Counts the samples (an int64 array) and the calls (a Python int) of its forward."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(5, 3)
        self.add_persistent('seen', np.zeros((), np.int64))
        self.add_persistent('calls', 0)

    def forward(self, x, t):
        self.seen += len(x)
        self.calls += 1
        return F.softmax_cross_entropy(self.fc(x), t)


def check_counters(batch_sizes=(3, 5), k=2, updates=3):
    model = Counting()
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(60, seed=RANK), batch_sizes[RANK],
                                          shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], communicator=comm,
                                          accumulate_steps=k)
    out = {}
    try:
        with chainer.using_config('debug', True):
            try:
                run_updates(updater, model, updates)
                out['debug_error'] = None
            except RuntimeError as e:
                out['debug_error'] = str(e)
    finally:
        updater.finalize()
    out['seen'], out['calls'] = int(model.seen), int(model.calls)
    return gathered(out)


class FirstCallProjection(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(5, 3)
        self.proj = None

    def forward(self, x, t):
        if self.proj is None:
            self.proj = np.random.randn(x.shape[1], x.shape[1]).astype(np.float32)
        return F.softmax_cross_entropy(self.fc(F.matmul(x, self.proj)), t)


def check_made_once(updates=3):
    import warnings
    np.random.seed(RANK)
    model = FirstCallProjection()
    it = chainer.iterators.SerialIterator(dataset(40, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], communicator=comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            run_updates(updater, model, updates)
        finally:
            updater.finalize()
    return gathered([str(w.message) for w in caught if 'made one once' in str(w.message)])


class Annealed(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(5, 3)
        self.add_persistent('beta', 1.0)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.fc(x) * float(self.beta), t)


def check_value_persistent():
    model = Annealed()
    it = chainer.iterators.SerialIterator(dataset(40, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], communicator=comm)
    try:
        run_updates(updater, model, 1)
        if RANK == 0:
            model.beta = np.array(0.5)
        run_updates(updater, model, 1)
    finally:
        updater.finalize()
    return gathered(float(model.beta))


class Counted(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(5, 3)
        self.add_persistent('count', np.zeros(3, np.int32))

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.fc(x), t)


def check_lost_kept():
    model = Counted()
    it = chainer.iterators.SerialIterator(dataset(40, seed=RANK), 4, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], communicator=comm)
    try:
        run_updates(updater, model, 1)
        model.count = 0
        try:
            run_updates(updater, model, 1)
            raised = None
        except RuntimeError as e:
            raised = str(e)
    finally:
        updater.finalize()
    return gathered(raised)


def main(out_path):
    result = {'size': SIZE, 'verbs': check_verbs(), 'cases': {}}
    for name, *args in CASES:
        result['cases'][name] = check_case(name, *args)
    result['batchnorm'] = check_batchnorm()
    result['debug_sync'] = check_debug_sync()
    result['pipelined'] = check_pipelined()
    result['model_mismatch'] = gathered(check_model_mismatch())
    result['lazy_mismatch'] = gathered(check_lazy_mismatch())
    result['order_mismatch'] = check_order_mismatch()
    result['settings_mismatch'] = gathered(check_settings_mismatch())
    mine = check_optimizer_mismatch()
    everyone = gathered(mine)
    result['optimizer_mismatch'] = [
        [(raised, message) for raised, message, _ in rank] for rank in everyone]
    result['optimizer_mismatch_params_equal'] = [
        bitwise_equal([rank[case][2] for rank in everyone]) for case in range(2)]
    result['counters'] = check_counters()
    result['made_once'] = check_made_once()
    result['value_persistent'] = check_value_persistent()
    result['lost_kept'] = check_lost_kept()
    if RANK == 0:
        with open(out_path, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main(sys.argv[1])
