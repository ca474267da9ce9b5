"""Pins for :mod:`mgpu_updater._chainer_private`, the one module that touches Chainer's and
ChainerMN's private names (issue 13, R3).

Three kinds of test, all against the installed Chainer 7.8.1:

- every ``file:line`` the seam module cites holds what it is cited for (so a citation
  cannot drift from the source it names);
- the upstream behaviour each function relies on (backward stamps ``_loss_scale`` on the
  leaves, ``UpdateRule.update`` divides by it, ``MultiprocessIterator.serialize`` resets its
  pool, ...), and that the function gives what the upstream code path gives;
- no module of the package other than the seam uses these names (``_ALLOWED`` would list
  exceptions; it is empty).
"""
from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Dict, Set, Tuple

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizers
from chainer.iterators import MultiprocessIterator, SerialIterator, ShuffleOrderSampler
from chainer.training.updaters import StandardUpdater

from mgpu_updater import _chainer_private as private

from _processes import SINGLETON_MPI_ENV

PACKAGE = Path(private.__file__).parent
SITE = Path(chainer.__file__).parent.parent   # where chainer/ and chainermn/ are installed


# --------------------------------------------------------------------------------------
# Every citation holds what it is cited for

# (file, line or 'first-last') -> text found on that line or within those lines.
_CITED: Dict[Tuple[str, str], str] = {
    ('chainer/reporter.py', '82'): 'self._observer_names = {}',
    ('chainer/reporter.py', '131'): 'self._observer_names[id(observer)] = name',
    ('chainer/reporter.py', '144'): 'self._observer_names[id(observer)] = prefix + name',
    ('chainer/link.py', '148-149'): 'self._persistent = set()',
    ('chainer/link.py', '301'): 'self._params.add(name)',
    ('chainer/link.py', '882'): 'self._children = set()',
    ('chainer/link.py', '914'): 'self._children.add(name)',
    ('chainer/link.py', '1051'): 'self._children = []',
    ('chainer/__init__.py', '219'): 'global_config.schedule_func = None',
    ('chainer/__init__.py', '235-236'): 'global_config._will_recompute = False',
    ('chainer/_backprop.py', '262'): 'x_var._loss_scale = loss_scale',
    ('chainer/variable.py', '1568-1571'): 'self.grad *= loss_scale',
    ('chainer/variable.py', '1558'): 'if self.array.size == 1 and self.grad_var is None:',
    ('chainer/backends/cuda.py', '77-78'): '_resolution_error = e',
    ('chainer/backends/cuda.py', '133-134'): '_resolution_error = e',
    ('chainer/configuration.py', '66'): "'_local', threading.local()",
    ('chainer/__init__.py', '127-132'): 'ret = _thread_local.link_hooks',
    ('chainer/link_hook.py', '137-141'): 'link_hooks[self.name] = self',
    ('chainer/link_hooks/spectral_normalization.py', '165'): 'self._initialized = False',
    ('chainer/link_hooks/spectral_normalization.py', '198-199'): 'if not self._initialized:',
    ('chainer/link_hooks/spectral_normalization.py', '252'): 'self._initialized = True',
    ('chainer/link_hooks/spectral_normalization.py', '215'):
        'def _prepare_parameters(self, link, input_variable=None):',
    ('chainer/link_hooks/spectral_normalization.py', '224-226'):
        'if input_variable is not None:',
    ('chainer/configuration.py', '102'): 'set(self._local.__dict__)',
    ('chainer/dataset/convert.py', '125-144'): 'def _call_converter(converter, batch, device)',
    ('chainer/datasets/dict_dataset.py', '27'): 'self._datasets = datasets',
    ('chainer/datasets/dict_dataset.py', '30-38'):
        'for key, dataset in six.iteritems(self._datasets)}',
    ('chainer/datasets/sub_dataset.py', '50-59'): 'self._order = order',
    ('chainer/datasets/sub_dataset.py', '64-76'): 'index = self._order[index]',
    ('chainer/datasets/transform_dataset.py', '44-45'): 'self._transform = transform',
    ('chainer/datasets/transform_dataset.py', '50-52'): 'return self._transform(in_data)',
    ('chainer/datasets/tuple_dataset.py', '38'): 'self._datasets = datasets',
    ('chainer/datasets/tuple_dataset.py', '41-48'):
        'batches = [dataset[index] for dataset in self._datasets]',
    ('chainer/device_resident.py', '29'): 'class DeviceResident(utils.enable_final(',
    ('chainer/functions/util/forget.py', '35'): 'self.func = func',
    ('chainer/functions/util/forget.py', '55-57'):
        'outs = _call_func(self.func, dummy_inputs)',
    ('chainer/graph_optimizations/static_graph.py', '667-669'):
        'self.params_list[params_list_index].grad = \\',
    ('chainer/graph_optimizations/static_graph.py', '914-918'): 'set_grad=True,',
    ('chainer/graph_optimizations/static_graph.py', '1274-1275'): 'def wrapped_func(',
    ('chainer/graph_optimizations/static_graph.py', '1308-1317'):
        'chain.schedule_manager = ScheduleManager(',
    ('chainer/iterators/multithread_iterator.py', '76-77'): 'self._previous_epoch_detail = -1.',
    ('chainer/iterators/multithread_iterator.py', '124-137'): 'self._next = None',
    ('chainer/iterators/multithread_iterator.py', '159-160'): 'self._state = self._next_state',
    ('chainer/iterators/multiprocess_iterator.py', '157-158'): 'self._state = state',
    ('chainer/iterators/multiprocess_iterator.py', '216-238'): 'def serialize(self, serializer)',
    ('chainer/iterators/multiprocess_iterator.py', '253'):
        'self._state = _statemachine.IteratorState(',
    ('chainer/iterators/multiprocess_iterator.py', '253-255'): 'self._comm.reset(self._state)',
    ('chainer/iterators/multiprocess_iterator.py', '266-288'): 'def __getstate__(self)',
    ('chainer/iterators/multiprocess_iterator.py', '266-298'): 'def __setstate__(self, state)',
    ('chainer/iterators/multiprocess_iterator.py', '279-281'): "del init['_prefetch_loop']",
    ('chainer/iterators/multiprocess_iterator.py', '290-298'): 'def __setstate__(self, state)',
    ('chainer/iterators/order_samplers.py', '56'): 'self._random = random_state',
    ('chainer/iterators/order_samplers.py', '59'): 'self._random.permutation(',
    ('chainer/link.py', '149'): 'self._persistent = set()',
    ('chainer/link.py', '361'): 'self._persistent.add(name)',
    ('chainer/link.py', '361-363'): 'd[name] = value',
    ('chainer/link.py', '363'): 'd[name] = value',
    ('chainer/link.py', '381'): 'self._persistent.add(name)',
    ('chainer/link.py', '663-664'): 'd[name] = serializer(name, d[name])',
    ('chainer/optimizer.py', '196'): 'self._use_fp32_update = False',
    ('chainer/optimizer.py', '252-270'):
        'if self._use_fp32_update and param_dtype == numpy.float16:',
    ('chainer/optimizer.py', '259'): 'loss_scale = param._loss_scale',
    ('chainer/optimizer.py', '291'): 'param_.grad /= loss_scale',
    ('chainer/optimizer.py', '433-462'): 'self_copy.init_state(variable.Variable(arr, grad=arr))',
    ('chainer/optimizer.py', '473-484'): 'self.init_state(param)',
    ('chainer/optimizer.py', '29-30'): 'self._post_update_hooks = collections.OrderedDict()',
    ('chainer/optimizer.py', '591'): 'self._hookable = _OptimizerHookable(self)',
    ('chainer/optimizer.py', '560'): '_loss_scale = None',
    ('chainer/link.py', '184'): 'self._local_link_hooks = collections.OrderedDict()',
    ('chainer/link.py', '882'): 'self._children = set()',
    ('chainer/link.py', '1051'): 'self._children = []',
    ('chainer/sequential.py', '123'): 'self._layers = []',
    ('chainer/optimizer.py', '562'): '_loss_scaling_is_dynamic = False',
    ('chainer/optimizer.py', '746'): 'self._loss_scaling_is_dynamic = True',
    ('chainer/optimizer.py', '750'): 'self._loss_scale = 1.0',
    ('chainer/optimizer.py', '757'): 'self._loss_scale = scale',
    ('chainer/optimizer.py', '782'): 'if not self._loss_scaling_is_dynamic:',
    ('chainer/optimizer.py', '879'): 'loss.backward(loss_scale=self._loss_scale)',
    ('chainer/reporter.py', '172-173'): 'Given observer is not registered to the reporter.',
    ('chainer/training/updaters/standard_updater.py', '246'): 'convert._call_converter(',
    ('chainer/utils/meta.py', '78'): "base_metaclass = type('base_metaclass'",
    ('chainermn/communicators/pure_nccl_communicator.py', '54-57'):
        'self.nccl_comm = _communication_utility.init_nccl_comm(self.mpi_comm)',
    ('chainermn/extensions/allreduce_persistent.py', '5-10'): 'for pname in link._persistent:',
}

_CITATION = re.compile(r'(chainer(?:mn)?/[\w/]+\.py):(\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)')


def _citations() -> Set[Tuple[str, str]]:
    text = Path(private.__file__).read_text()
    found = set()
    for match in _CITATION.finditer(text):
        for item in match.group(2).split(', '):
            found.add((match.group(1), item))
    return found


def test_the_seam_cites_chainer_lines_that_are_pinned_here():
    found = _citations()
    assert len(found) >= 30   # the regular expression still finds them
    unpinned = sorted(found - set(_CITED))
    assert not unpinned, f'cited in _chainer_private.py but not pinned in _CITED: {unpinned}'


@pytest.mark.parametrize('cited', sorted(_CITED), ids=lambda c: f'{c[0]}:{c[1]}')
def test_each_cited_line_holds_what_it_is_cited_for(cited):
    path, lines = cited
    first, _, last = lines.partition('-')
    source = (SITE / path).read_text().splitlines()
    start, end = int(first), int(last or first)
    assert end <= len(source)
    assert _CITED[cited] in '\n'.join(source[start - 1:end]), (
        f'{path}:{lines} no longer holds {_CITED[cited]!r}')


def test_chainer_is_the_release_the_citations_are_for():
    assert chainer.__version__ == '7.8.1'


# --------------------------------------------------------------------------------------
# Loss scaling


def _tiny():
    model = chainer.Chain()
    with model.init_scope():
        model.used = L.Linear(3, 2)
        model.unused = L.Linear(3, 2)   # no backward reaches it
    return model


def test_backward_stamps_its_loss_scale_on_the_leaves_it_reached():
    model = _tiny()
    x = np.ones((4, 3), dtype=np.float32)
    F.sum(model.used(x)).backward(loss_scale=8.0)
    assert [p._loss_scale for p in model.used.params()] == [8.0, 8.0]
    assert [p._loss_scale for p in model.unused.params()] == [None, None]


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('scale', [1.0, 0.5, 1 / 3, 1024.0 / 7])
def test_backward_scaled_gives_backward_loss_scale_gradients_without_stamps(dtype, scale):
    """The same gradient bits as ``backward(loss_scale=scale)``, in every float dtype and
    for factors that do not round alike in them; every leaf reached stamped None."""
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3).astype(dtype)
    grads = []
    for scaled in (False, True):
        with chainer.using_config('dtype', dtype):
            model = _tiny()
        model.used.W.array[...] = np.arange(6).reshape(2, 3) / 5
        loss = F.sum(model.used(x) ** 2) / 3
        if scaled:
            private.backward_scaled(loss, scale)
            assert [p._loss_scale for p in model.used.params()] == [None, None]
        else:
            loss.backward(loss_scale=scale)
        grads.append([p.grad for p in model.used.params()])
    for ours, chainers in zip(*grads[::-1]):
        assert ours.dtype == chainers.dtype == dtype
        np.testing.assert_array_equal(ours, chainers)
    assert any(g.any() for g in grads[1])


def test_set_update_loss_scale_writes_every_parameter_reached_or_not():
    model = _tiny()
    F.sum(model.used(np.ones((4, 3), dtype=np.float32))).backward(loss_scale=8.0)
    private.set_update_loss_scale(model, 2.0)
    assert {p._loss_scale for p in model.params()} == {2.0}
    private.set_update_loss_scale(model, None)
    assert {p._loss_scale for p in model.params()} == {None}


@pytest.mark.parametrize('scale', [None, 4.0])
def test_update_rule_divides_the_gradient_by_the_written_scale(scale):
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(np.array([1.0, 2.0], dtype=np.float32))
    optimizer = optimizers.SGD(lr=1.0)
    optimizer.setup(link)
    link.w.grad = np.array([4.0, 8.0], dtype=np.float32)
    private.set_update_loss_scale(link, scale)
    optimizer.update()
    step = np.array([4.0, 8.0]) / (scale or 1.0)
    np.testing.assert_allclose(link.w.array, np.array([1.0, 2.0]) - step)


def test_update_rule_divides_also_on_its_float32_copy_of_a_float16_parameter():
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(np.array([1.0, 2.0], dtype=np.float16))
    optimizer = optimizers.SGD(lr=1.0)
    optimizer.setup(link)
    optimizer.use_fp32_update()
    link.w.grad = np.array([512.0, 1024.0], dtype=np.float16)
    private.set_update_loss_scale(link, 1024.0)
    optimizer.update()
    np.testing.assert_array_equal(link.w.array, np.array([0.5, 1.0], dtype=np.float16))


def test_loss_scale_and_dynamic_without_static_and_dynamic_scaling():
    optimizer = optimizers.SGD()
    optimizer.setup(_tiny())
    assert private.loss_scale(optimizer) is None
    assert private.loss_scaling_is_dynamic(optimizer) is False
    optimizer.loss_scaling(scale=128.0)
    assert private.loss_scale(optimizer) == 128.0
    assert private.loss_scaling_is_dynamic(optimizer) is False
    optimizer = optimizers.SGD()
    optimizer.setup(_tiny())
    optimizer.loss_scaling()
    assert private.loss_scale(optimizer) == 1.0
    assert private.loss_scaling_is_dynamic(optimizer) is True


def test_loss_scale_is_what_optimizer_update_passes_to_backward_and_moves_when_dynamic():
    model = _tiny()
    optimizer = optimizers.SGD(lr=0.0)
    optimizer.setup(model)
    optimizer.loss_scaling(interval=1)   # dynamic: x2 after each finite step
    x = np.ones((4, 3), dtype=np.float32)
    before = private.loss_scale(optimizer)
    optimizer.update(lambda: F.sum(model.used(x)))
    assert [p._loss_scale for p in model.used.params()] == [before, before]
    assert private.loss_scale(optimizer) == 2 * before
    static = optimizers.SGD(lr=0.0)
    static.setup(model)
    static.loss_scaling(scale=16.0)
    static.update(lambda: F.sum(model.used(x)))
    assert [p._loss_scale for p in model.used.params()] == [16.0, 16.0]
    assert private.loss_scale(static) == 16.0


# --------------------------------------------------------------------------------------
# Converters


class _Recorder(chainer.Chain):
    """A model whose loss records the arrays it was given."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(2, 1)
        self.seen = []

    def forward(self, *arrays):
        self.seen.append(arrays)
        return F.sum(self.l(arrays[0]))


def _plain(batch, device):
    arrays = chainer.dataset.concat_examples(batch, device)
    return arrays + (repr(device),)


@chainer.dataset.converter()
def _new_style(batch, device):
    arrays = chainer.dataset.concat_examples(batch, device)
    return arrays + (repr(device),)


@pytest.mark.parametrize('converter', [chainer.dataset.concat_examples, _plain, _new_style],
                         ids=['concat_examples', 'plain', 'decorated'])
@pytest.mark.parametrize('device', [None, '@numpy'])
def test_call_converter_gives_what_standard_updater_converts(converter, device):
    data = [(np.array([i, i + 1], dtype=np.float32), np.int32(i)) for i in range(4)]
    model = _Recorder()
    optimizer = optimizers.SGD()
    optimizer.setup(model)
    updater = StandardUpdater(SerialIterator(data, 4, shuffle=False), optimizer,
                              converter=converter, device=device)
    updater.update()
    (theirs,) = model.seen
    ours = private.call_converter(converter, data,
                                  None if device is None else chainer.get_device(device))
    assert len(ours) == len(theirs)
    for mine, upstream in zip(ours, theirs):
        if isinstance(upstream, str):   # what the converter was given as its device
            assert mine == upstream
        else:
            np.testing.assert_array_equal(mine, upstream)
    if converter is not chainer.dataset.concat_examples:
        # old style gets an int (-1: CPU) or None, new style a chainer.backend.Device
        expected = {_plain: {None: 'None', '@numpy': '-1'},
                    _new_style: {None: 'None', '@numpy': repr(chainer.get_device('@numpy'))}}
        assert ours[-1] == expected[converter][device]


# --------------------------------------------------------------------------------------
# Persistents


def _with_batchnorm():
    model = chainer.Chain()
    with model.init_scope():
        model.bn = L.BatchNormalization(3)
        model.l = L.Linear(3, 2)
    model.add_persistent('count', 7)
    return model


def test_named_persistents_lists_batchnorm_statistics_with_their_paths():
    model = _with_batchnorm()
    named = list(private.named_persistents(model))
    assert [name for name, _ in named] == ['/count', '/bn/N', '/bn/avg_mean', '/bn/avg_var']
    values = dict(named)
    assert values['/bn/avg_mean'] is model.bn.avg_mean
    assert values['/bn/avg_var'] is model.bn.avg_var
    assert values['/bn/N'] == model.bn.N == 0
    assert values['/count'] == 7
    assert [n for n, _ in private.named_persistents(model.bn)] == ['/N', '/avg_mean', '/avg_var']


def test_named_persistents_are_what_chainer_serializes_beyond_the_parameters():
    model = _with_batchnorm()
    target: Dict[str, np.ndarray] = {}
    chainer.serializers.DictionarySerializer(target).save(model)
    params = {name.lstrip('/') for name, _ in model.namedparams()}
    assert set(target) - params == {n.lstrip('/') for n, _ in private.named_persistents(model)}


def test_set_persistent_is_what_link_serialize_reads_and_the_attribute_shows():
    model = _with_batchnorm()
    mean = np.arange(3, dtype=np.float32)
    private.set_persistent(model.bn, 'N', 5)
    private.set_persistent(model.bn, 'avg_mean', mean)
    assert model.bn.N == 5 and model.bn.avg_mean is mean
    assert dict(private.named_persistents(model))['/bn/N'] == 5
    target: Dict[str, np.ndarray] = {}
    chainer.serializers.DictionarySerializer(target).save(model)
    assert int(target['bn/N']) == 5
    np.testing.assert_array_equal(target['bn/avg_mean'], mean)


# --------------------------------------------------------------------------------------
# Iterators


class _Writes:
    """A serializer that records what is written and gives the value back."""

    def __init__(self):
        self.written: Dict[str, object] = {}

    def __call__(self, key, value):
        self.written[key] = value
        return value


def _multiprocess(shuffle=True):
    return MultiprocessIterator(list(range(10)), 3, shuffle=shuffle, n_processes=1)


def _count_resets(it):
    resets = []
    reset = it._comm.reset
    it._comm.reset = lambda state: (resets.append(state), reset(state))[1]
    return resets


def _assert_as_written(state, written):
    """The state read holds the keys and values the iterator's serialize wrote."""
    assert set(state) == set(written)
    for key, value in written.items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)


def test_multiprocess_serialize_resets_its_pool_and_the_state_read_does_not():
    it = _multiprocess()
    try:
        for _ in range(4):   # into the second epoch
            it.next()
        resets = _count_resets(it)
        state = private.multiprocess_iterator_state(it)
        assert resets == []
        serializer = _Writes()
        it.serialize(serializer)
        assert len(resets) == 1   # chainer/iterators/multiprocess_iterator.py:253-255
    finally:
        it.finalize()
    _assert_as_written(state, serializer.written)
    assert state['epoch'] == 1 and state['current_position'] == 2
    assert state['previous_epoch_detail'] == pytest.approx(0.9)


def test_multiprocess_state_copies_the_order_and_reads_one_without_shuffling():
    it = _multiprocess()
    unshuffled = _multiprocess(shuffle=False)
    try:
        it.next()
        state = private.multiprocess_iterator_state(it)
        assert state['order'] is not it._state.order
        np.testing.assert_array_equal(state['order'], it._state.order)
        unshuffled.next()
        plain = private.multiprocess_iterator_state(unshuffled)
        assert plain['order'] is None and plain['current_position'] == 3
        with pytest.raises(AttributeError):   # serialize copies the order, None has none
            unshuffled.serialize(_Writes())
    finally:
        it.finalize()
        unshuffled.finalize()


def test_multithread_serialize_drops_its_batch_ahead_and_the_state_read_does_not():
    it = chainer.iterators.MultithreadIterator(list(range(6)), 2, n_threads=1)
    unshuffled = chainer.iterators.MultithreadIterator(list(range(6)), 2, shuffle=False)
    try:
        for _ in range(4):   # into the second epoch
            it.next()
        ahead = it._next
        state = private.multithread_iterator_state(it)
        assert ahead is not None and it._next is ahead
        assert state['_order'] is not it._state.order
        serializer = _Writes()
        it.serialize(serializer)
        assert it._next is None   # chainer/iterators/multithread_iterator.py:137
        unshuffled.next()
        assert private.multithread_iterator_state(unshuffled)['_order'] is None
    finally:
        it.finalize()
        unshuffled.finalize()
    _assert_as_written(state, serializer.written)
    assert state['epoch'] == 1 and state['current_position'] == 2
    assert state['previous_epoch_detail'] == pytest.approx(1.0)


def test_multiprocess_pickle_state_is_what_getstate_returns():
    it = _multiprocess()
    try:
        for _ in range(2):
            it.next()
        ours = private.multiprocess_iterator_pickle_state(it)
        theirs = it.__getstate__()   # resets ``it``: read ours first
    finally:
        it.finalize()
    assert set(ours) == set(theirs)
    for key in set(ours) - {'init'}:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    assert set(ours['init']) == set(theirs['init'])
    # __getstate__'s serialize writes None into _previous_epoch_detail before copying the
    # attributes (its serializer returns None); __setstate__ then sets the real value.
    assert theirs['init']['_previous_epoch_detail'] is None
    for key in set(ours['init']) - {'_previous_epoch_detail'}:
        assert ours['init'][key] is theirs['init'][key], key


def test_order_sampler_rng_is_the_generator_that_draws_the_next_order():
    rng = np.random.RandomState(3)
    it = SerialIterator(list(range(6)), 2, order_sampler=ShuffleOrderSampler(rng))
    assert private.order_sampler_rng(it) is rng
    it.next(), it.next()
    clone = np.random.RandomState()
    clone.set_state(private.order_sampler_rng(it).get_state())
    expected = clone.permutation(6)   # what the end of this epoch will draw
    it.next()                         # ends the epoch: the next order is drawn from rng
    assert rng.get_state()[2] == clone.get_state()[2]
    np.testing.assert_array_equal(rng.get_state()[1], clone.get_state()[1])
    assert [x for _ in range(3) for x in it.next()] == list(expected)


def test_order_sampler_rng_defaults_to_numpys_global_generator_and_none_without_shuffle():
    assert private.order_sampler_rng(SerialIterator([1, 2], 1)) is np.random.mtrand._rand
    assert private.order_sampler_rng(SerialIterator([1, 2], 1, shuffle=False)) is None


# --------------------------------------------------------------------------------------
# ChainerMN, configuration, CUDA, reporter, Link


_NCCL_PIN = textwrap.dedent('''
    from mgpu_updater import _compat
    _compat.apply()
    from chainermn.communicators import _communication_utility, pure_nccl_communicator
    from mgpu_updater._chainer_private import chainermn_nccl_comm
    made = []
    _communication_utility.init_nccl_comm = lambda mpi_comm: made.append(mpi_comm) or 'nccl'
    comm = object.__new__(pure_nccl_communicator.PureNcclCommunicator)
    comm.mpi_comm, comm.nccl_comm = 'mpi', None
    assert chainermn_nccl_comm(comm) == 'nccl' and made == ['mpi'], made
    assert chainermn_nccl_comm(comm) == 'nccl' and made == ['mpi'], made   # once only
    print('ok')
''')


@pytest.mark.skipif(importlib.util.find_spec('mpi4py') is None, reason='mpi4py not installed '
                    '(pip install -e .[mpi]): ChainerMN needs it to import')
def test_chainermn_nccl_comm_is_made_once_by_init_comms():
    # A fresh interpreter: importing ChainerMN initialises MPI, not in the test process.
    done = subprocess.run([sys.executable, '-c', _NCCL_PIN], capture_output=True, text=True,
                          timeout=120, env=SINGLETON_MPI_ENV)
    assert done.returncode == 0 and done.stdout.strip() == 'ok', done.stderr


def test_config_entry_names_are_the_global_ones_and_this_threads_own():
    chainer.config.seam_test_entry = 1   # this thread only
    try:
        names = private.config_entry_names()
        shown = io.StringIO()
        chainer.config.show(shown)
        assert names == {line.split()[0] for line in shown.getvalue().splitlines()}
        assert 'seam_test_entry' in names and 'train' in names
        other: Set[str] = set()
        thread = threading.Thread(target=lambda: other.update(private.config_entry_names()))
        thread.start()
        thread.join()
        assert 'seam_test_entry' not in other and 'train' in other
    finally:
        del chainer.config.seam_test_entry


def test_cuda_resolution_error_is_what_chainer_reports():
    from chainer.backends import cuda
    error = private.cuda_resolution_error()
    if cuda.available:
        # CUDA works: at most cuDNN failed to load, and Chainer says so by disabling it.
        assert error is None or not cuda.cudnn_enabled
        return
    assert isinstance(error, Exception)
    with pytest.raises(RuntimeError, match=re.escape(str(error))):
        cuda.check_cuda_available()


def test_is_unregistered_observer_error_recognises_the_reporters_key_error():
    reporter = chainer.Reporter()
    known, stranger = L.Linear(1, 1), L.Linear(1, 1)
    reporter.add_observer('main', known)
    with reporter.scope({}):
        chainer.report({'x': 1.0}, known)
        with pytest.raises(KeyError) as caught:
            chainer.report({'x': 1.0}, stranger)
    assert private.is_unregistered_observer_error(caught.value)
    assert not private.is_unregistered_observer_error(KeyError('x'))
    assert not private.is_unregistered_observer_error(
        RuntimeError('not registered to the reporter'))


def test_link_metaclass_is_every_links_and_importable_by_no_name():
    assert type(chainer.Link) is private.LINK_METACLASS
    assert type(L.Linear) is private.LINK_METACLASS
    meta = private.LINK_METACLASS
    module = sys.modules[meta.__module__]
    assert getattr(module, meta.__qualname__, None) is not meta


# --------------------------------------------------------------------------------------
# Datasets


def _rows(n=10):
    return np.arange(n * 3, dtype=np.float32).reshape(n, 3)


@pytest.mark.parametrize('order', [None, np.random.RandomState(0).permutation(10),
                                   list(np.random.RandomState(1).permutation(10))])
def test_sub_dataset_indices_are_where_get_example_reads(order):
    base = [('example', i) for i in range(10)]
    sub = chainer.datasets.SubDataset(base, 3, 8, order=order)
    positions = np.array([4, 0, 2, 2])
    found, indices = private.sub_dataset_indices(sub, positions)
    assert found is base
    assert [base[i] for i in indices] == [sub[int(p)] for p in positions]


def test_tuple_and_dict_dataset_columns_are_what_they_index():
    x, t = _rows(), np.arange(10, dtype=np.int32)
    tuples = chainer.datasets.TupleDataset(x, t)
    columns = private.tuple_dataset_columns(tuples)
    assert len(columns) == 2 and columns[0] is x and columns[1] is t
    for i in (0, 7, -1):
        assert all(np.array_equal(a, b) for a, b in zip(tuples[i], (x[i], t[i])))
    named = chainer.datasets.DictDataset(x=x, t=t)
    assert private.dict_dataset_columns(named) == {'x': x, 't': t}
    assert all(np.array_equal(named[4][k], {'x': x, 't': t}[k][4]) for k in ('x', 't'))


def test_transform_dataset_parts_are_what_get_example_calls():
    base = _rows()

    def transform(row):
        return row * 2

    dataset = chainer.datasets.TransformDataset(base, transform)
    found, function = private.transform_dataset_parts(dataset)
    assert found is base and function is transform
    np.testing.assert_array_equal(dataset[3], function(found[3]))


def test_static_graph_links_are_the_decorated_ones_and_their_backward_sets_gradients():
    """Chainer's ``@static_graph``: a backward sets the decorated link's gradients, at its
    first call and at the schedule's later ones, and adds to the others'; its schedules
    are the machinery's own classes."""
    import chainer.links as L
    from _models import PartlyStatic

    model = PartlyStatic()
    assert private.static_graph_links(model) == [model.body]
    assert private.static_graph_links(L.Classifier(L.Linear(2, 2))) == []
    rng = np.random.RandomState(0)
    x, t = rng.randn(4, 5).astype(np.float32), rng.randint(0, 3, 4).astype(np.int32)
    for call in range(3):   # the define-by-run first call, then the schedule's
        model.cleargrads()
        model(x[:2], t[:2]).backward()
        first = {name: p.grad.copy() for name, p in model.namedparams()}
        model(x[2:], t[2:]).backward()
        model_second = {name: p.grad.copy() for name, p in model.namedparams()}
        model.cleargrads()
        model(x[2:], t[2:]).backward()
        alone = {name: p.grad for name, p in model.namedparams()}
        for name in first:
            expected = alone[name] if name.startswith('/body/') else first[name] + alone[name]
            np.testing.assert_allclose(model_second[name], expected, rtol=1e-6, atol=1e-7,
                                       err_msg=f'{name}, call {call}')
    assert private.is_static_graph_machinery(type(model.body.schedule_manager))
    assert private.is_static_graph_machinery(type(model.body.static_schedule))
    assert not private.is_static_graph_machinery(type(model.body))
    assert not private.is_static_graph_machinery(int)


def test_forgets_node_lists_its_inputs_only_and_its_backward_reaches_the_parameters():
    """``F.forget``'s node has the inputs of the function it forgets, not the parameters
    that function uses; its backward calls that function again and reaches them."""
    link = L.Linear(3, 2)
    x = chainer.Variable(np.ones((4, 3), np.float32))

    def forgotten(x_):
        return F.sum(link(x_))
    loss = F.forget(forgotten, x)
    node = loss.creator_node
    assert private.forgotten_function(node) is forgotten
    assert [v.get_variable_or_none() for v in node.inputs] == [x]
    loss.backward()
    assert link.W.grad is not None and link.W.grad.any()
    plain = F.sum(link(x))
    assert private.forgotten_function(plain.creator_node) is None


# --------------------------------------------------------------------------------------
# No other module uses these names

# Private names of Chainer's and ChainerMN's objects: none may be read or written outside
# _chainer_private.py, as an attribute (``x._state``) or a string (``getattr(x, '_random')``).
_PRIVATE = frozenset({
    '_loss_scale', '_loss_scaling_is_dynamic', '_call_converter', '_persistent', '_state',
    '_previous_epoch_detail', '_prefetch_loop', '_random', '_init_comms',
    '_resolution_error', '_iterators', '_optimizers', '_hookable', '_pre_update_hooks',
    '_post_update_hooks', '_init_states', '_use_fp32_update', '_dataset', '_datasets',
    '_start', '_finish', '_order', '_transform', '_params', '_children',
    '_observer_names'})
# On ``self`` these name the package's own attributes, except StandardUpdater's.
_PRIVATE_ON_SELF_TOO = frozenset({'_iterators', '_optimizers'})
_REPORTER_TEXT = 'not registered to the reporter'

# Modules allowed a private name anyway, with the names (none: every reach goes through
# the seam).
_ALLOWED: Dict[str, Set[str]] = {}


def _private_uses(path: Path) -> Set[str]:
    tree = ast.parse(path.read_text(), str(path))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id == 'self'
            if node.attr in _PRIVATE and (not on_self or node.attr in _PRIVATE_ON_SELF_TOO):
                used.add(node.attr)
            if node.attr == '_local' and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == 'config':
                used.add('config._local')
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in _PRIVATE:
                used.add(node.value)
            if _REPORTER_TEXT in node.value:
                used.add(_REPORTER_TEXT)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == 'type' and len(node.args) == 1 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == 'DeviceResident':
            used.add('type(DeviceResident)')
    return used


def _package_uses() -> Dict[str, Set[str]]:
    uses = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative != '_chainer_private.py':
            uses[relative] = _private_uses(path)
    return uses


def test_no_module_but_the_seam_uses_chainers_private_names():
    offending = {module: sorted(used - _ALLOWED.get(module, set()))
                 for module, used in _package_uses().items()}
    offending = {module: used for module, used in offending.items() if used}
    assert not offending, (
        f'private Chainer names used outside mgpu_updater/_chainer_private.py: {offending}; '
        'call (or add) a function there, citing the upstream line')


def test_the_allow_list_holds_only_what_is_still_used():
    uses = _package_uses()
    stale = {module: sorted(names - uses.get(module, set()))
             for module, names in _ALLOWED.items()}
    stale = {module: names for module, names in stale.items() if names}
    assert not stale, f'no longer used, remove from _ALLOWED: {stale}'


def test_the_check_finds_each_kind_of_reach(tmp_path):
    module = tmp_path / 'm.py'
    module.write_text(textwrap.dedent('''
        def f(opt, it, self):
            opt._loss_scale
            getattr(it.order_sampler, '_random', None)
            chainer.config._local
            self._state          # the package's own attribute: fine
            self._iterators      # StandardUpdater's: not fine
            'was not registered to the reporter' in str(e)
            type(DeviceResident)
    '''))
    assert _private_uses(module) == {
        '_loss_scale', '_random', 'config._local', '_iterators', _REPORTER_TEXT,
        'type(DeviceResident)'}
