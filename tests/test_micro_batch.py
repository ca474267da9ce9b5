"""``micro_batch_size=m``: a loaded batch runs as chunks of at most m samples, and the
update stays that of StandardUpdater on the global batch (issue 12)."""
from __future__ import annotations

import collections
import functools
import random
import types

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError
from mgpu_updater._loader import Loader

from _dropin_models import CappedMLP, SumLoss, seeded
from _models import dataset, params, run_updates, setup_optimizer

UPDATES = 2


def _run(model, datasets, b, k, opt_kind='momentum+decay', updates=UPDATES, **kwargs):
    opt = setup_optimizer(opt_kind, model)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * len(datasets),
                                          accumulate_steps=k, **kwargs)
    try:
        return run_updates(updater, model, updates)
    finally:
        updater.finalize()


def _standard(model, datasets, b, k, opt_kind='momentum+decay', updates=UPDATES):
    opt = setup_optimizer(opt_kind, model)
    out = []
    for u in range(updates):
        batch = []
        for d in datasets:
            batch.extend(d[u * k * b:(u + 1) * k * b])
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        out.append(run_updates(StandardUpdater(it, opt), model, 1)[0])
    return out


def _assert_params(ours, ref):
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize('n,opt_kind', [(1, 'momentum+decay'), (2, 'clip')])
def test_chunks_match_standard_updater_on_the_global_batch(n, opt_kind):
    """b=5 samples per loaded batch, m=2: chunks of 2, 2 and 1; a model that cannot hold
    more than 2 samples at once trains exactly as StandardUpdater on all of them."""
    b, k, m = 5, 2, 2
    datasets = [dataset(b * k * UPDATES, seed=110 + r) for r in range(n)]
    ours, ref = seeded(lambda: CappedMLP(cap=m), 1), seeded(lambda: CappedMLP(cap=10 ** 6), 1)
    ours_obs = _run(ours, datasets, b, k, opt_kind, micro_batch_size=m)
    ref_obs = _standard(ref, datasets, b, k, opt_kind)
    _assert_params(ours, ref)
    assert ours.largest == m
    for key in ('main/loss', 'main/accuracy'):
        np.testing.assert_allclose([o[key] for o in ours_obs],
                                   [float(o[key].array) for o in ref_obs], rtol=1e-5,
                                   err_msg=key)


def test_without_chunks_the_capped_model_fails():
    """The test above could fail: the cap is real (the worker's copy has it too, so its
    exact result there means the worker ran chunks as well)."""
    datasets = [dataset(20, seed=120)]
    with pytest.raises(MemoryError, match='5 samples do not fit'):
        _run(seeded(lambda: CappedMLP(cap=2)), datasets, 5, 1)


def test_chunks_with_a_summed_loss_and_summed_replicas():
    b, k, m = 5, 2, 3
    datasets = [dataset(b * k * UPDATES, seed=130 + r) for r in range(2)]
    ours, ref = seeded(SumLoss, 2), seeded(SumLoss, 2)
    ours_obs = _run(ours, datasets, b, k, micro_batch_size=m, loss_reduction='sum',
                    replica_reduction='sum')
    ref_obs = _standard(ref, datasets, b, k)
    _assert_params(ours, ref)
    np.testing.assert_allclose([o['main/loss'] for o in ours_obs],
                               [float(o['main/loss'].array) for o in ref_obs], rtol=1e-5)


def test_chunks_in_pipelined_mode_match_whole_batches():
    b, k = 6, 2
    datasets = [dataset(b * k * 3, seed=140)]
    chunked, whole = seeded(lambda: CappedMLP(cap=4), 3), seeded(lambda: CappedMLP(cap=99), 3)
    _run(chunked, datasets, b, k, updates=3, pipelined=True, micro_batch_size=4)
    _run(whole, datasets, b, k, updates=3, pipelined=True)
    _assert_params(chunked, whole)


def _opaque_converter(batch, device=None):
    x, t = chainer.dataset.concat_examples(batch, device)
    return x, t, 'not per sample'


def _first_update_refuses_to_split(model, b, converter, match, error=TypeError):
    """The first update of ``model`` on batches of ``b`` with ``micro_batch_size=2``
    raises ``error`` matching ``match``; its ExceptionInfo."""
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(2 * b, seed=0), b)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], micro_batch_size=2,
                                          converter=converter)
    try:
        with pytest.raises(error, match=match) as info:
            run_updates(updater, model, 1)
    finally:
        updater.finalize()
    return info


def test_a_batch_that_cannot_be_split_says_why():
    _first_update_refuses_to_split(
        CappedMLP(cap=99), 4, _opaque_converter,
        r'micro_batch_size cannot split this batch of 4 samples: the converter returned '
        r'element 2 as str of length 14')


def _time_major(batch, device=None):
    """Features time-major: (5, b), whose first axis only is as long as the batch when
    b is 5."""
    x, t = chainer.dataset.concat_examples(batch, device)
    return x.T, t


def _flat_tuple(batch, device=None):
    """One array per sample, then the labels: a tuple of b + 1 elements, each of
    length 5 (the features), and the labels, of length b."""
    x, t = chainer.dataset.concat_examples(batch, device)
    return tuple(x) + (t,)


class _TimeMajorNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(5, 3)

    def forward(self, *inputs):
        x = inputs[0].T if len(inputs) == 2 else np.stack(inputs[:-1])
        return chainer.functions.softmax_cross_entropy(self.l1(x), inputs[-1])


@pytest.mark.parametrize('converter,seen,alone', [
    (_time_major, r'a tuple of 2 elements of lengths \[2, 2\]',
     r'a tuple of 2 elements of lengths \[5, 2\]'),
    (_flat_tuple, r'a tuple of 6 elements of lengths \[2, 2, 2, 2, 2, 2\]',
     r'a tuple of 3 elements of lengths \[5, 5, 2\]')])
def test_a_first_axis_as_long_as_the_batch_by_chance_is_not_cut(converter, seen, alone):
    """A batch of 5 samples whose converter's output is 5 long along a first axis that is
    no sample axis (time-major features; a flat tuple of one array per sample, each 5
    features long): every length checks out, so the cut alone cannot tell. The first
    chunk is compared with the converter's own output for its samples, and differs."""
    _first_update_refuses_to_split(
        _TimeMajorNet(), 5, converter,
        r'micro_batch_size cannot split this batch of 5 samples: cut into chunks of 2 along '
        r'the first axis of what the converter returned, the first chunk is ' + seen +
        r', but the converter given those 2 samples returns ' + alone)


class _OwnGenerator:
    """A converter object that draws noise from a generator of its own."""

    def __init__(self):
        self.rng = np.random.RandomState(0)

    def __call__(self, batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + self.rng.normal(0, 0.1, x.shape).astype(x.dtype), t


class _NestedGenerator:
    """A converter object whose generator sits in an object it holds (an augmentation
    pipeline), in a list, drawn through a bound method of its own."""

    def __init__(self):
        self.steps = [types.SimpleNamespace(rng=np.random.default_rng(1))]

    def convert(self, batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + self.steps[0].rng.normal(0, 0.1, x.shape).astype(x.dtype), t


class _Counting:
    """A converter object whose output depends on how many batches it converted (a
    schedule it keeps itself)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch, device=None):
        self.calls += 1
        x, t = chainer.dataset.concat_examples(batch, device)
        return x * np.float32(1 + self.calls / 10), t


def _keyword_default_generator():
    def convert(batch, device=None, *, rng=np.random.RandomState(4)):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + rng.normal(0, 0.1, x.shape).astype(x.dtype), t
    return convert


def _noise_from(batch, device=None, table=None):
    x, t = chainer.dataset.concat_examples(batch, device)
    return x + table['rng'].normal(0, 0.1, x.shape).astype(x.dtype), t


_MODULE_RNG = np.random.RandomState(5)   # reset by _module_generator


def _module_generator():
    _MODULE_RNG.seed(5)

    def convert(batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + _MODULE_RNG.normal(0, 0.1, x.shape).astype(x.dtype), t
    return convert


class _SeededRandom(random.Random):
    """A Random whose constructor needs an argument (a copy cannot be made)."""

    def __init__(self, seed):
        super().__init__(seed)


def _uncopyable_generator():
    rng = _SeededRandom(6)

    def convert(batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + np.float32(rng.gauss(0, 0.1)), t
    return convert


class _SlotsCounting:
    """:class:`_Counting` with ``__slots__`` and a generator of its own."""
    __slots__ = ('calls', 'rng')

    def __init__(self):
        self.calls = 0
        self.rng = np.random.RandomState(3)

    def __call__(self, batch, device=None):
        self.calls += 1
        x, t = chainer.dataset.concat_examples(batch, device)
        noise = self.rng.normal(0, 0.1, x.shape).astype(x.dtype)
        return x * np.float32(1 + self.calls / 10) + noise, t


def _closing_over_a_generator():
    rng = random.Random(2)

    def convert(batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + np.float32(rng.gauss(0, 0.1)), t
    return convert


class _WholeBatchesOnly:
    def __call__(self, batch, device=None):
        if len(batch) != 4:
            raise ValueError(f'this converter takes batches of 4, not {len(batch)}')
        return chainer.dataset.concat_examples(batch, device)


def test_a_converter_that_takes_whole_batches_only_is_named_with_the_check():
    info = _first_update_refuses_to_split(CappedMLP(cap=99), 4, _WholeBatchesOnly(),
                                          'takes batches of 4, not 2', ValueError)
    assert any('micro_batch_size=2 compares with its first cut' in note
               for note in info.value.__notes__)


def _drawing_converter(batch, device=None):
    """concat_examples plus a draw from numpy's global generator (noise on the
    features), as an augmenting converter does."""
    x, t = chainer.dataset.concat_examples(batch, device)
    return x + np.random.normal(0, 0.1, x.shape).astype(x.dtype), t


@pytest.mark.parametrize('make_converter', [
    lambda: _drawing_converter, _OwnGenerator, lambda: _NestedGenerator().convert,
    _closing_over_a_generator, _Counting, _SlotsCounting, _keyword_default_generator,
    lambda: functools.partial(_noise_from, table=collections.OrderedDict(
        rng=np.random.RandomState(7))),
    _module_generator, _uncopyable_generator],
    ids=['numpy_global', 'own_generator', 'method_nested_generator', 'closure', 'counter',
         'slots', 'keyword_default', 'partial_ordered_dict', 'module_global',
         'uncopyable'])
def test_the_split_check_does_not_move_a_drawing_converters_draws(make_converter):
    """The check calls the converter once more on the first chunk's samples: a copy of a
    converter object (or of a bound method's), with every generator it reaches set back
    after it, and numpy's; so a converter that draws gives StandardUpdater's noise."""
    b, k, m = 5, 1, 2
    datasets = [dataset(b * k * UPDATES, seed=150)]
    ours, ref = seeded(lambda: CappedMLP(cap=m), 4), seeded(lambda: CappedMLP(cap=99), 4)
    np.random.seed(9)
    _run(ours, datasets, b, k, 'sgd', micro_batch_size=m, converter=make_converter(),
         prefetch=0)
    np.random.seed(9)
    opt = setup_optimizer('sgd', ref)
    it = chainer.iterators.SerialIterator(datasets[0], b, shuffle=False)
    run_updates(StandardUpdater(it, opt, converter=make_converter()), ref, UPDATES)
    _assert_params(ours, ref)


_MEANWHILE = []   # what another thread does while a converter converts (not held by it)


class _DrawsWhileConverting:
    def __init__(self):
        self.rng = np.random.RandomState(0)

    def __call__(self, batch, device=None):
        for call in _MEANWHILE:
            call()
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + self.rng.normal(0, 0.1, x.shape).astype(x.dtype), t


def test_the_split_checks_call_leaves_draws_made_meanwhile_by_others():
    """The loader's thread may convert while the check's call runs: what it draws from
    the converter's generator then stays drawn (the check's call draws from a copy; one
    that set the generator back afterwards repeated the thread's noise)."""
    converter = _DrawsWhileConverting()
    shared = converter.rng
    data = dataset(4, seed=0)
    loader = Loader(chainer.iterators.SerialIterator(data, 4), converter,
                    chainer.get_device('@numpy'))
    _MEANWHILE.append(shared.normal)   # the loader's thread, meanwhile
    try:
        loader.convert_aside([data[i] for i in range(2)])
    finally:
        _MEANWHILE.clear()
    expected = np.random.RandomState(0)
    expected.normal()
    assert shared.normal() == expected.normal()


def test_a_converter_drawing_from_the_systems_entropy_is_split():
    """``random.SystemRandom`` has no state to copy or set back."""
    system = random.SystemRandom()

    def convert(batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x + np.float32(system.random() * 1e-3), t
    model = seeded(lambda: CappedMLP(cap=99), 4)
    _run(model, [dataset(8 * UPDATES, seed=150)], 4, 1, 'sgd', micro_batch_size=2,
         converter=convert, prefetch=0)


@pytest.mark.parametrize('value,error,shown', [
    (0, ValueError, r'\(0 given\)'), (-3, ValueError, r'\(-3 given\)'),
    (2.5, TypeError, r'\(2.5 of type float given\)'),
    (True, TypeError, r'\(True of type bool given\)'),
    ('16', TypeError, r"\('16' of type str given\)"),
    ('Auto', TypeError, r"\('Auto' of type str given\)")])
def test_bad_micro_batch_size_is_refused_at_construction(value, error, shown):
    model = CappedMLP(cap=99)
    it = chainer.iterators.SerialIterator(dataset(8, seed=0), 4)
    with pytest.raises(error, match=r"micro_batch_size must be None, 'auto' or an int >= 1 "
                                    + shown + '; pass e.g. micro_batch_size=16'):
        ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model), devices=['@numpy'],
                                    micro_batch_size=value)


# ---------------------------------------------------------------------- 'auto'
def _updater(model, datasets, b, k, opt_kind='momentum+decay', **kwargs):
    opt = setup_optimizer(opt_kind, model)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    return ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * len(datasets),
                                       accumulate_steps=k, **kwargs)


@pytest.mark.parametrize('n,in_backward', [(1, False), (2, True)])
def test_auto_finds_the_size_that_fits_and_stays_exact(n, in_backward):
    """b=8, a cap of 3 samples: 8 fails, 4 fails, 2 fits. The failed attempts' partial
    gradients (in backward, the last layer's are already there) are thrown away."""
    b, k = 8, 2
    datasets = [dataset(b * k * UPDATES, seed=150 + r) for r in range(n)]
    ours = seeded(lambda: CappedMLP(cap=3, in_backward=in_backward), 4)
    ref = seeded(lambda: CappedMLP(cap=10 ** 6), 4)
    ours_obs = _run(ours, datasets, b, k, micro_batch_size='auto')
    ref_obs = _standard(ref, datasets, b, k)
    _assert_params(ours, ref)
    assert ours.tried[:3] == [8, 4, 2] and set(ours.tried[3:]) == {2}
    assert [o['main/micro_batch_size'] for o in ours_obs] == [2] * UPDATES
    for key in ('main/loss', 'main/accuracy'):
        np.testing.assert_allclose([o[key] for o in ours_obs],
                                   [float(o[key].array) for o in ref_obs], rtol=1e-5,
                                   err_msg=key)


def test_auto_replicas_settle_at_their_own_sizes_and_resume_there(tmp_path):
    """The master fits 5 samples, the worker 2: sizes 4 and 2 (from 8); the reported size
    is the smallest; a snapshot keeps both, and a resumed run starts at them."""
    b, k = 8, 1
    datasets = [dataset(b * k * 4, seed=160 + r) for r in range(2)]
    model = seeded(lambda: CappedMLP(cap=5, worker_cap=2), 5)
    updater = _updater(model, datasets, b, k, micro_batch_size='auto')
    try:
        obs = run_updates(updater, model, 2)
        assert updater.micro_batch_sizes == [4, 2]
        assert [o['main/micro_batch_size'] for o in obs] == [2, 2]
        chainer.serializers.save_npz(str(tmp_path / 'snap.npz'), updater)
        after_two = params(model)
        expected = run_updates(updater, model, 2)
        expected_params = params(model)
    finally:
        updater.finalize()

    resumed_model = seeded(lambda: CappedMLP(cap=5, worker_cap=2), 5)
    resumed = _updater(resumed_model, datasets, b, k, micro_batch_size='auto')
    try:
        chainer.serializers.load_npz(str(tmp_path / 'snap.npz'), resumed)
        for name, value in after_two.items():
            np.testing.assert_array_equal(params(resumed_model)[name], value)
        assert resumed.micro_batch_sizes == [4, 2]
        got = run_updates(resumed, resumed_model, 2)
        assert resumed_model.tried and set(resumed_model.tried) == {4}   # no failure
        assert resumed.micro_batch_sizes == [4, 2]
    finally:
        resumed.finalize()
    assert [o['main/loss'] for o in got] == [o['main/loss'] for o in expected]
    for name, value in expected_params.items():
        np.testing.assert_allclose(params(resumed_model)[name], value, rtol=1e-6)


class GrowingBatches(chainer.dataset.Iterator):
    """Batches of 2 samples for the first three, then of 7, as a bucketing iterator may
    give them; its position is what it serializes."""

    def __init__(self, dataset):
        self.dataset, self.batch_size = dataset, 7
        self.position = self.count = self.epoch = 0
        self.is_new_epoch = False

    def __next__(self):
        size = 2 if self.count < 3 else 7
        batch = [self.dataset[(self.position + i) % len(self.dataset)] for i in range(size)]
        self.position += size
        self.count += 1
        return batch

    @property
    def epoch_detail(self):
        return self.position / len(self.dataset)

    @property
    def previous_epoch_detail(self):
        return None

    def serialize(self, serializer):
        self.position = serializer('position', self.position)
        self.count = serializer('count', self.count)


def _growing(model):
    opt = setup_optimizer('momentum+decay', model)
    return ParallelAccumulatingUpdater(GrowingBatches(dataset(64, seed=171)), opt,
                                       devices=['@numpy'], micro_batch_size='auto')


@pytest.mark.parametrize('how', ['snapshot', 'finalize'])
def test_auto_never_out_of_memory_resumes_with_whole_batches(tmp_path, how):
    """No forward ran out of memory: every batch is taken whole. The largest batch so far
    (2, before the snapshot) is what ``main/micro_batch_size`` reports, no size found: a
    resumed run (or one that goes on after ``finalize()``) split the later batches of 7
    into 2, 2, 2, 1, silently (a BatchNorm, a loss averaged over tokens train otherwise)."""
    model = seeded(lambda: CappedMLP(cap=99), 5)
    updater = _growing(model)
    try:
        expected = run_updates(updater, model, 5)
    finally:
        updater.finalize()
    assert model.tried == [2, 2, 2, 7, 7]
    expected_params = params(model)

    model = seeded(lambda: CappedMLP(cap=99), 5)
    updater = _growing(model)
    try:
        run_updates(updater, model, 3)
        assert updater.micro_batch_sizes == [2]
        if how == 'snapshot':
            chainer.serializers.save_npz(str(tmp_path / 'snap.npz'), updater)
            updater.finalize()
            model = seeded(lambda: CappedMLP(cap=99), 5)
            updater = _growing(model)
            chainer.serializers.load_npz(str(tmp_path / 'snap.npz'), updater)
            assert updater.micro_batch_sizes == [0]   # whole batches
        else:
            updater.finalize()   # and on: the replicas start again
        del model.tried[:]
        got = run_updates(updater, model, 2)
    finally:
        updater.finalize()
    assert model.tried == [7, 7]
    assert [o['main/micro_batch_size'] for o in got] == [7, 7]
    assert [o['main/loss'] for o in got] == [o['main/loss'] for o in expected[3:]]
    for name, value in expected_params.items():
        np.testing.assert_array_equal(params(model)[name], value)


def test_auto_keeps_the_size_of_a_replica_whose_shard_ran_out():
    """repeat=False, the worker's shard one update shorter than the master's: in the last
    update the worker's window is empty, and the size it found stays (a snapshot then
    keeps it; 0 would start a resumed run from the whole batch again)."""
    b = 8
    model = seeded(lambda: CappedMLP(cap=5, worker_cap=2), 5)
    opt = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(dataset(n, seed=165 + r), b, repeat=False,
                                            shuffle=False) for r, n in enumerate((2 * b, b))]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          micro_batch_size='auto')
    try:
        obs = run_updates(updater, model, 2)
        assert updater.micro_batch_sizes == [4, 2]
        assert [o['main/micro_batch_size'] for o in obs] == [2, 4]
    finally:
        updater.finalize()


@pytest.mark.parametrize('cap, found', [(99, 4), (2, 2)])
def test_auto_keeps_its_size_through_a_short_last_batch(cap, found):
    """Shards of 9 in batches of 4 (repeat=False): each pass ends with a batch of 1, which
    is no size found (recorded, it made the next pass, or a resumed run, run in chunks of
    1)."""
    model = seeded(lambda: CappedMLP(cap=cap), 5)
    opt = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(dataset(9, seed=168 + r), 4, repeat=False,
                                            shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          micro_batch_size='auto')
    try:
        obs = run_updates(updater, model, 3)
        assert updater.micro_batch_sizes == [found, found]
        assert [o['main/micro_batch_size'] for o in obs] == [found] * 3
    finally:
        updater.finalize()


def test_auto_when_one_sample_does_not_fit_says_so():
    model = seeded(lambda: CappedMLP(cap=0), 6)
    updater = _updater(model, [dataset(8, seed=0)], 4, 1, micro_batch_size='auto')
    try:
        with pytest.raises(MemoryError, match=r'replica 0 \(@numpy\): one sample alone does '
                                              r'not fit in memory'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()
    assert model.tried == [4, 2, 1]


def test_auto_in_a_worker_when_one_sample_does_not_fit_says_so():
    model = seeded(lambda: CappedMLP(cap=99, worker_cap=0), 6)
    updater = _updater(model, [dataset(8, seed=r) for r in range(2)], 4, 1,
                       micro_batch_size='auto')
    try:
        with pytest.raises(WorkerError, match=r'(?s)replica 1 .*MemoryError: replica 1 '
                                              r"\(@numpy\): one sample alone does not fit"):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_auto_with_pipelined_mode_matches_whole_batches():
    b, k = 6, 2
    datasets = [dataset(b * k * 3, seed=170)]
    auto, whole = seeded(lambda: CappedMLP(cap=3), 7), seeded(lambda: CappedMLP(cap=99), 7)
    _run(auto, datasets, b, k, updates=3, pipelined=True, micro_batch_size='auto')
    _run(whole, datasets, b, k, updates=3, pipelined=True)
    _assert_params(auto, whole)


def test_auto_with_loss_scaling_matches_standard_updater():
    b, k, n = 8, 1, 2
    datasets = [dataset(b * k * UPDATES, seed=180 + r) for r in range(n)]
    ours = seeded(lambda: CappedMLP(cap=3, in_backward=True), 8)
    ref = seeded(lambda: CappedMLP(cap=10 ** 6), 8)
    opt, ref_opt = setup_optimizer('sgd', ours), setup_optimizer('sgd', ref)
    opt.loss_scaling(scale=64.0)
    ref_opt.loss_scaling(scale=64.0)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n,
                                          accumulate_steps=k, micro_batch_size='auto')
    try:
        run_updates(updater, ours, UPDATES)
    finally:
        updater.finalize()
    for u in range(UPDATES):
        batch = [s for d in datasets for s in d[u * b:(u + 1) * b]]
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        run_updates(StandardUpdater(it, ref_opt), ref, 1)
    _assert_params(ours, ref)
    assert updater.micro_batch_sizes == [2, 2]


class _CappedBN(chainer.Chain):
    """BatchNorm before the point where more than ``cap`` samples run out of memory, and
    dropout (numpy's generator) after it."""

    def __init__(self, cap):
        super().__init__()
        self.cap = cap
        with self.init_scope():
            self.l1 = chainer.links.Linear(5, 6)
            self.bn = chainer.links.BatchNormalization(6)
            self.l2 = chainer.links.Linear(6, 3)

    def forward(self, x, t):
        h = self.bn(self.l1(x))   # moves the running statistics, then runs out
        if len(x) > self.cap:
            raise MemoryError(f'{len(x)} samples do not fit (cap {self.cap})')
        h = chainer.functions.dropout(chainer.functions.relu(h), 0.3)
        return chainer.functions.softmax_cross_entropy(self.l2(h), t)


@pytest.mark.parametrize('n', [1, 2])
def test_auto_redoes_a_window_from_the_statistics_and_random_state_it_began_with(n):
    """The attempts that ran out of memory moved BatchNorm's running statistics and drew
    dropout masks: the window redone must start from where the window began, as a run
    at the size that fits from the start does."""
    b, k = 8, 2
    datasets = [dataset(b * k * UPDATES, seed=170 + r) for r in range(n)]
    models = {}
    for name, cap, size in (('auto', 2, 'auto'), ('fixed', 10 ** 6, 2)):
        models[name] = seeded(lambda: _CappedBN(cap), 5)
        np.random.seed(9)
        _run(models[name], datasets, b, k, micro_batch_size=size)
    for name, value in params(models['fixed']).items():
        np.testing.assert_array_equal(params(models['auto'])[name], value, err_msg=name)
    for stat in ('avg_mean', 'avg_var'):
        np.testing.assert_array_equal(getattr(models['auto'].bn, stat),
                                      getattr(models['fixed'].bn, stat), err_msg=stat)
