"""Bad input is refused at construction: at once, before any process starts, with a
``ValueError`` or ``TypeError`` (never ``AssertionError``) whose message names the argument,
echoes the value and says what to do. And a loss that becomes NaN or infinite."""
import multiprocessing
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy
import pytest

import chainer
import chainer.links as L
from chainer.backends import cuda

import mgpu_updater
from mgpu_updater import NonFiniteLossError, ParallelAccumulatingUpdater

from _models import run_updates
from _processes import SINGLETON_MPI_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent / 'scripts' / 'faults'))
import faulty  # noqa: E402


def dataset(n=16):
    return chainer.datasets.TupleDataset(numpy.zeros((n, 4), numpy.float32),
                                         numpy.zeros(n, numpy.int32))


def iterators(n=2):
    return [chainer.iterators.SerialIterator(dataset(), 4) for _ in range(n)]


def set_up(model=None):
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model if model is not None else L.Classifier(L.Linear(4, 3)))
    return optimizer


def build(**overrides):
    kwargs = dict(iterators=iterators(), optimizer=set_up(), devices=['@numpy', '@numpy'])
    kwargs.update(overrides)
    return ParallelAccumulatingUpdater(kwargs.pop('iterators'), kwargs.pop('optimizer'),
                                       **kwargs)


def rejected(error, match, **overrides):
    """Building with ``overrides`` raises ``error`` matching ``match``, in under 1 s,
    with no process started."""
    t0 = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        build(**overrides)
    assert time.perf_counter() - t0 < 1.0
    assert type(info.value) is error          # not a subclass such as AssertionError
    assert multiprocessing.active_children() == []
    return str(info.value)


# ------------------------------------------------------------------ accumulate_steps
@pytest.mark.parametrize('value, error', [(0, ValueError), (-2, ValueError),
                                          (2.5, TypeError), ('3', TypeError),
                                          (True, TypeError), (None, TypeError)])
def test_accumulate_steps(value, error):
    shown = re.escape(repr(value))
    rejected(error, rf'^accumulate_steps must be an int >= 1 \({shown}( of type \w+)? given\); '
                    r'pass e\.g\. accumulate_steps=1$', accumulate_steps=value)


def test_prefetch_and_policies():
    rejected(ValueError, r"^prefetch must be 'auto' or an int >= 0 \(-1 given\); pass e\.g\. "
             r"prefetch='auto'", prefetch=-1)
    rejected(TypeError, r"^prefetch must be 'auto' or an int >= 0 \('fast' given\)",
             prefetch='fast')
    rejected(TypeError, r"^prefetch must be 'auto' or an int >= 0 \(True given\)",
             prefetch=True)
    rejected(ValueError, r"^nonfinite must be one of 'raise', 'skip', 'ignore' \('warn' given\)",
             nonfinite='warn')
    rejected(ValueError, r"^start_method must be one of 'spawn', 'forkserver' \('fork' given\)",
             start_method='fork')


# ------------------------------------------------------------------ other updaters' arguments
@pytest.mark.parametrize('name, value, fix', [
    ('input_device', '@numpy', r"drop it: each replica's converter sends its batch"),
    ('loss_scale', 8.0, r'set it on the optimizer, optimizer\.set_loss_scale\(8\.0\)'),
    ('iterator', [], r'pass the iterators by position or as iterators=\[\.\.\.\]'),
])
def test_a_standard_updater_argument_is_refused_with_what_replaces_it(name, value, fix):
    rejected(TypeError, rf'^{name} is an argument of StandardUpdater, not of '
                        rf'ParallelAccumulatingUpdater \({name}={re.escape(repr(value))} of '
                        rf'type \w+ given\): {fix}', **{name: value})


def test_standard_updaters_device_is_refused_with_what_replaces_it():
    with pytest.raises(TypeError, match=r"^device is an argument of StandardUpdater, not of "
                                        r"ParallelAccumulatingUpdater \(device=0 of type int "
                                        r"given\): pass devices=\[0\] for one replica, or "
                                        r"one entry per device \(devices=\[0, 1\]\)$"):
        ParallelAccumulatingUpdater(iterators(), set_up(), device=0)
    rejected(TypeError, r"^device is an argument of StandardUpdater, not of "
                        r"ParallelAccumulatingUpdater \(device=0 of type int given\): drop it: "
                        r"devices=\[\.\.\.\] names every replica's device", device=0)


def test_the_signature_is_that_of_init():
    import inspect
    names = list(inspect.signature(ParallelAccumulatingUpdater).parameters)
    assert names[:4] == ['iterators', 'optimizer', 'devices', 'accumulate_steps']


def test_parallel_updaters_models_and_a_converter_by_position_are_refused():
    model = L.Classifier(L.Linear(4, 3))
    rejected(TypeError, r'^models is an argument of ParallelUpdater, not of '
                        r"ParallelAccumulatingUpdater \(models=.* given\): give the one model "
                        r"as the optimizer's target", models={'main': model},
             optimizer=set_up(model))
    with pytest.raises(TypeError, match=r'^ParallelAccumulatingUpdater takes only the '
                                        r'iterators and the optimizer by position \(3 '
                                        r'positional arguments given; after the optimizer: '
                                        r'_ArbitraryCallableConverter\): pass the rest by '
                                        r'keyword, e\.g\. converter=\.\.\., devices'):
        ParallelAccumulatingUpdater(iterators(), set_up(), chainer.dataset.concat_examples,
                                    devices=['@numpy', '@numpy'])
    assert multiprocessing.active_children() == []


def test_a_subclass_keeps_its_own_keywords():
    """Chainer's GAN example pops ``models`` in its updater subclass's __init__: the
    check of other updaters' arguments leaves a subclass's arguments to it."""
    class TwoModels(ParallelAccumulatingUpdater):
        def __init__(self, *args, **kwargs):
            self.models = kwargs.pop('models')
            super().__init__(*args, **kwargs)

    model = L.Classifier(L.Linear(4, 3))
    updater = TwoModels(iterators(), set_up(model), models=(model,), devices=['@numpy'] * 2)
    updater.finalize()
    assert updater.models == (model,)


# ------------------------------------------------------------------ devices
def test_devices_empty():
    rejected(ValueError, r"^devices must name at least one device \(\[\] given\); "
                         r"e\.g\. devices=\['@numpy'\]", devices=[], iterators=[])


def test_devices_not_a_list():
    rejected(TypeError, r"^devices must be a list of device specifiers \('@numpy' given\)",
             devices='@numpy')


@pytest.mark.parametrize('sizes, batch_sizes, warned', [
    ((5, 7), (2, 2), True),     # 3 batches against 4: the worker's last comes after the epoch
    ((7, 5), (2, 2), False),    # the master's shard the largest (shard_iterators' way)
    ((5, 6), (2, 2), False),    # 3 batches each: the master's last is short, nothing lost
    ((6, 10), (3, 5), False),   # unequal batch sizes, 2 batches each
    ((5, 7), (numpy.int64(2), 2), True),   # a numpy integer batch size
])
def test_a_master_shard_with_fewer_batches_than_another_is_warned(sizes, batch_sizes,
                                                                   warned):
    """The updater's epoch follows the master's iterator: where another shard makes more
    batches per pass, an epoch ends before it is used up (under repeat=False its last
    batches are trained only after the master's epoch ended, which a stop_trigger at that
    epoch never reaches: StandardUpdater on the same samples trains them all)."""
    its = [chainer.iterators.SerialIterator(dataset(n), b, repeat=False)
           for n, b in zip(sizes, batch_sizes)]
    optimizer = set_up()
    if warned:
        with pytest.warns(RuntimeWarning, match=r"iterators\[0\], the master's, makes 3 "
                                                r"batches of its shard per epoch, fewer than "
                                                r"iterators\[1\] \(4\).*largest shard"):
            ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'])
    else:
        ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'])


class _Budgeted(chainer.dataset.Iterator):
    """Chainer's attributes, but batches as many samples as fit a budget (a token-budget
    iterator): how many batches a pass makes, its batch size does not tell."""

    def __init__(self, dataset, batch_size):
        self.dataset, self.batch_size = dataset, batch_size

    def __next__(self):
        raise StopIteration


class _SubclassedSerial(chainer.iterators.SerialIterator):
    """A SerialIterator subclass (a bucketing one overrides ``__next__``)."""


@pytest.mark.parametrize('kind', [_Budgeted, _SubclassedSerial])
def test_iterators_whose_batches_per_pass_are_unknown_are_not_warned_about(kind):
    """The count of batches per pass, ceil(size / batch_size), is Chainer's iterators':
    another made 11 and 12 where it read 8 and 14, and warned so, or said nothing."""
    its = [kind(dataset(n), 2) for n in (5, 7)]
    ParallelAccumulatingUpdater(its, set_up(), devices=['@numpy', '@numpy'])   # no warning


def _build_warned():
    its = [chainer.iterators.SerialIterator(dataset(n), 2, repeat=False) for n in (5, 7)]
    return ParallelAccumulatingUpdater(its, set_up(), devices=['@numpy', '@numpy'])


@pytest.mark.parametrize('action, times', [('default', 3), ('once', 1), ('module', 1)])
def test_each_updater_shows_its_warnings_under_pythons_default_filters(action, times):
    """Python shows a warning once per text and place: a sweep building updater after
    updater in one process saw the first trial's warning only, though every trial trained
    the same way. Each updater built shows its own; within one, a warning is not repeated;
    'once' and 'module' keep their meaning for the process."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for _ in range(3):
            _build_warned().finalize()
    shown = [w for w in caught if "the master's, makes 3 batches" in str(w.message)]
    assert len(shown) == times
    assert {w.filename for w in shown} == {__file__}


def test_building_an_updater_while_another_thread_warns_is_safe():
    """Trials in threads (a sweep with n_jobs > 1): one thread's warnings go into the
    registries while another's updater is built and clears them."""
    import warnings
    from mgpu_updater import _warning
    errors, stop = [], threading.Event()

    def warning():
        i = 0
        with warnings.catch_warnings():
            warnings.simplefilter('default')   # each new text recorded in a registry
            warnings.showwarning = lambda *args, **kwargs: None
            while not stop.is_set():
                i += 1
                _warning.warn(f'w{i}', RuntimeWarning)
    thread = threading.Thread(target=warning)
    thread.start()
    try:
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            try:
                _warning.new_updater()
            except Exception as exc:  # noqa: BLE001 - the failure looked for
                errors.append(exc)
                break
    finally:
        stop.set()
        thread.join()
    assert errors == []


def test_a_warning_attributed_to_a_main_module_without_a_file_is_shown():
    """``python -c`` (or a script from stdin): the module's loader has no source to give,
    and the warning is printed all the same."""
    code = ('import chainer, numpy\n'
            'from mgpu_updater import ParallelAccumulatingUpdater\n'
            'd = lambda n: chainer.datasets.TupleDataset(numpy.zeros((n, 4), numpy.float32), '
            'numpy.zeros(n, numpy.int32))\n'
            'its = [chainer.iterators.SerialIterator(d(n), 2, repeat=False) for n in (5, 7)]\n'
            'opt = chainer.optimizers.SGD()\n'
            'opt.setup(chainer.links.Classifier(chainer.links.Linear(4, 3)))\n'
            "ParallelAccumulatingUpdater(its, opt, devices=['@numpy', '@numpy']).finalize()\n"
            "print('built')\n")
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == 'built\n'
    assert "<string>:7: RuntimeWarning: iterators[0], the master's, makes 3" in done.stderr


class _Twice(chainer.iterators.OrderSampler):
    """Every example twice an epoch (oversampling)."""

    def __call__(self, current_order, current_position):
        return numpy.concatenate([numpy.arange(5)] * 2)


def test_an_order_sampler_of_ones_own_is_not_judged_by_the_datasets_length():
    """Chainer takes an epoch's length from the order such a sampler gives (here 10
    examples of a dataset of 5): nothing can be said from the dataset's length."""
    its = [chainer.iterators.SerialIterator(dataset(5), 2, order_sampler=_Twice()),
           chainer.iterators.SerialIterator(dataset(7), 2)]
    ParallelAccumulatingUpdater(its, set_up(), devices=['@numpy', '@numpy'])


def test_iterators_count_differs_from_devices():
    rejected(ValueError, r'^iterators has 3 iterator\(s\) but devices has 2; give exactly '
                         r'one iterator per device \(mgpu_updater\.shard_iterators',
             iterators=iterators(3))


@pytest.mark.parametrize('spec', ['gpu0', '@cupy:x', 'cuda:0', '@intel64', True, -2, 1.0])
def test_unknown_device(spec):
    rejected(ValueError, rf"^devices\[1\] is {re.escape(repr(spec))}, which is not a device "
                         r"specifier this updater supports; use a GPU id \(0, 1, \.\.\.\), "
                         r"'@cupy:N', or '@numpy' / -1", devices=['@numpy', spec])


def test_gpu_without_cuda(monkeypatch):
    monkeypatch.setattr(cuda, 'available', False)
    rejected(ValueError, r"^devices\[0\] is '@cupy:0', a GPU, but CuPy is not installed or "
                         r"cannot use CUDA: chainer\.backends\.cuda\.available is False "
                         r"\(.*\); use '@numpy' for CPU replicas or install the "
                         r'cuda12/cuda13 extra', devices=['@cupy:0', '@cupy:1'])


# A GPU listed twice is allowed: two replicas on one GPU (tests/test_staged.py).


@pytest.mark.parametrize('devices', [['@numpy', 0], [0, -1], ['@cupy:0', '@numpy']])
def test_cpu_and_gpu_mixed(devices):
    rejected(ValueError, rf'^devices mixes CPU and GPU devices \({re.escape(repr(devices))}\); '
                         r"use only GPUs or only '@numpy' replicas", devices=devices)


def test_device_checks_run_before_cuda(monkeypatch):
    """With CUDA present the same specifiers fail the same way (parse first, CUDA last)."""
    from mgpu_updater import _validate
    monkeypatch.setattr(_validate, '_cuda_available', lambda: (True, ''))
    rejected(ValueError, r'^devices mixes CPU and GPU', devices=[0, '@numpy'])


# ------------------------------------------------------------------ iterators
def test_not_an_iterator():
    rejected(TypeError, r'^iterators\[0\] is <object object at 0x[0-9a-f]+>, not a '
                        r'chainer\.dataset\.Iterator; wrap the dataset in e\.g\. '
                        r'chainer\.iterators\.SerialIterator',
             iterators=[object(), iterators(1)[0]])


def test_a_dataset_instead_of_iterators():
    rejected(TypeError, r'^iterators must be a chainer iterator or a list of them, one per '
                        r'device \(<chainer\.datasets\.tuple_dataset\.TupleDataset object .*'
                        r'given\); wrap the dataset in e\.g\. chainer\.iterators\.SerialIterator',
             iterators=dataset())


def test_same_iterator_twice():
    it = iterators(1)[0]
    rejected(ValueError, r'^iterators holds the same iterator object more than once',
             iterators=[it, it])

def test_an_empty_shard_is_refused_naming_its_device():
    """Chainer's iterators divide by their dataset's length (a bare ZeroDivisionError at
    the first update, on the master without a word of which replica)."""
    its = iterators(1) + [chainer.iterators.SerialIterator(
        chainer.datasets.SubDataset(dataset(), 0, 0), 2)]
    rejected(ValueError, r'^iterators\[1\] iterates over an empty dataset \(device 1 would '
                         r'have no sample to train on.*give every device a shard of at '
                         r'least one batch', iterators=its)


# ------------------------------------------------------------------ optimizer and model
def test_optimizer_not_set_up():
    rejected(ValueError, r'^optimizer \(SGD\) was not set up; call optimizer\.setup\(model\) '
                         'before building the updater', optimizer=chainer.optimizers.SGD())


def test_not_an_optimizer():
    rejected(TypeError, r'^optimizer must be a chainer\.Optimizer set up on the model '
                        r'\(<chainer\.links\.model\.classifier\.Classifier object .* given\); '
                        r'e\.g\. optimizer = chainer\.optimizers\.Adam\(\); '
                        r'optimizer\.setup\(model\)$',
             optimizer=L.Classifier(L.Linear(4, 3)))


def test_an_object_answering_every_attribute_is_no_multi_node_optimizer():
    from unittest import mock
    rejected(TypeError, r'^optimizer must be a chainer\.Optimizer set up on the model',
             optimizer=mock.MagicMock())


def test_a_chainermn_multi_node_optimizer_is_told_to_pass_the_one_it_wraps():
    class _MultiNodeOptimizer:   # what create_multi_node_optimizer returns, in short
        def __init__(self, actual_optimizer, communicator):
            self.actual_optimizer, self.communicator = actual_optimizer, communicator

    rejected(TypeError, r"^optimizer must be a plain chainer\.Optimizer, not ChainerMN's "
                        r'multi-node one \(_MultiNodeOptimizer given\): pass the optimizer it '
                        r'wraps and the communicator, optimizer=opt, communicator=comm',
             optimizer=_MultiNodeOptimizer(set_up(), object()))


def test_devices_left_out_is_named_with_examples():
    with pytest.raises(TypeError, match=r"^ParallelAccumulatingUpdater needs devices=\[\.\.\.\], "
                                        r"one per replica: e\.g\. devices=\['@numpy'\]"):
        ParallelAccumulatingUpdater(iterators(), set_up())


def test_auto_new_epoch_is_a_flag():
    rejected(TypeError, r"^auto_new_epoch must be True or False \('no' of type str given\)",
             auto_new_epoch='no')
    assert build(auto_new_epoch=0).auto_new_epoch is False   # as StandardUpdater takes it
    assert build(auto_new_epoch=numpy.bool_(True)).auto_new_epoch is True


def test_the_updater_copies_and_pickles_as_before():
    """copy and pickle make the object with a bare __new__: no argument is missing there."""
    import copy
    import pickle
    updater = build(devices=['@numpy'], iterators=iterators(1))
    assert type(copy.copy(updater)) is ParallelAccumulatingUpdater
    assert pickle.loads(pickle.dumps(updater)).accumulate_steps == 1
    updater.finalize()


@pytest.mark.parametrize('batch_size', [0, -2])
def test_an_iterator_without_samples_per_batch_is_refused(batch_size):
    its = iterators()
    its[1].batch_size = batch_size
    rejected(ValueError, rf'^iterators\[1\] has batch_size={batch_size}: each batch must hold '
                         r'at least one sample; build the iterator with batch_size >= 1$',
             iterators=its)


def test_a_list_dataset_given_as_iterators_is_named_as_such():
    examples = [(numpy.zeros(4, numpy.float32), 0)] * 20
    rejected(TypeError, r'^iterators\[0\] is .*, not a chainer\.dataset\.Iterator; wrap the '
                        r'dataset in e\.g\. chainer\.iterators\.SerialIterator, one per device',
             iterators=examples)


def test_model_without_parameters():
    rejected(ValueError, r'^the model \(Chain\) has no parameters: there is nothing to train; '
                         r'check that its links are registered inside init_scope\(\)',
             optimizer=set_up(chainer.Chain()))


@pytest.mark.parametrize('name, value, error, shown', [
    ('converter', 3, TypeError, r'3 of type int'),
    ('converter', None, TypeError, r'None'),
    ('loss_func', 'abc', TypeError, r"'abc' of type str"),
])
def test_not_callable(name, value, error, shown):
    rejected(error, rf'^{name} must be callable \({shown} given\)', **{name: value})


# ------------------------------------------------------------------ cannot be sent to a worker
# Lambdas, closures and __main__ objects travel (tests/test_payload.py); what holds an open
# file, a lock, a socket, a thread or a generator cannot, and the message names it.
class LockAttribute(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(4, 3)
        self.guard = threading.Lock()      # the problem

    def forward(self, x, t):
        return chainer.functions.softmax_cross_entropy(self.fc(x), t)


class GeneratorDataset:
    """A dataset that reads from a generator: it cannot be pickled."""

    def __init__(self, n=8):
        self.n = n
        self.rows = (numpy.zeros(4, numpy.float32) for _ in range(n))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return next(self.rows), numpy.int32(0)


def test_unpicklable_model():
    message = rejected(
        TypeError, r"^the model \(LockAttribute\) cannot be sent to a worker process: "
                   r"TypeError: cannot pickle '_thread.lock' object; the culprit is "
                   r'model\.guard \(<unlocked _thread.lock object', optimizer=set_up(LockAttribute()))
    assert message.endswith('Create such attributes lazily (e.g. open files in forward, not '
                            'in __init__) or drop them before building the updater.')


def test_unpicklable_model_is_fine_on_one_device():
    updater = build(optimizer=set_up(LockAttribute()), devices=['@numpy'],
                    iterators=iterators(1))
    updater.update()
    updater.finalize()
    assert multiprocessing.active_children() == []


def test_generator_dataset():
    its = [iterators(1)[0], chainer.iterators.SerialIterator(GeneratorDataset(), 2)]
    message = rejected(
        TypeError, r"^iterators\[1\] \(SerialIterator\) cannot be sent to a worker process: "
                   r"TypeError: cannot pickle 'generator' object; the culprit is "
                   r'iterators\[1\]\.dataset\.rows \(<generator object', iterators=its)
    assert 'open files lazily in get_example (or __getitem__)' in message


class _OverAGenerator(chainer.dataset.Iterator):
    """An iterator of the user's own that draws its batches from a generator it holds."""

    def __init__(self):
        self._gen = (dataset(4, seed=i)[:2] for i in range(100))
        self.epoch, self.is_new_epoch = 0, False

    def __next__(self):
        return next(self._gen)


def test_an_iterator_over_a_generator_of_its_own():
    """The advice spoke of the dataset, which this iterator does not have."""
    its = [iterators(1)[0], _OverAGenerator()]
    message = rejected(
        TypeError, r"^iterators\[1\] \(_OverAGenerator\) cannot be sent to a worker "
                   r"process: TypeError: cannot pickle 'generator' object; the culprit is "
                   r'iterators\[1\]\._gen \(<generator object', iterators=its)
    assert message.endswith('An iterator that holds it cannot go to a worker process as it '
                            'is: make it where it is used (at the first next()) and leave it '
                            'out of the pickle (a __getstate__ that drops it), or read the '
                            "data through a dataset (Chainer's iterators over a picklable "
                            'dataset), or train on one device.')
    assert 'dataset must be picklable' not in message


def test_closure_over_an_open_file(tmp_path):
    """A loss_func or converter that captures an open file: the captured name is shown."""
    with open(tmp_path / 'log.txt', 'w') as log:
        def loss(x, t):
            log.write('called\n')
            return x

        def convert(batch, device=None):
            log.write('converting\n')
            return chainer.dataset.concat_examples(batch, device)

        message = rejected(TypeError, r'^loss_func \(function\) cannot be sent to a worker '
                           r"process: TypeError: cannot pickle '_io.TextIOWrapper' object; "
                           r"the culprit is loss_func\.log \(<_io.TextIOWrapper name=",
                           loss_func=loss)
        assert message.endswith('Open files, locks or sockets inside the function or a '
                                'method of the model, not in the variables it captures.')
        message = rejected(TypeError, r'^converter \(function\) cannot be sent to a worker '
                           r'process: .*the culprit is converter\.log ', converter=convert)
        assert 'inside the call' in message


def test_converter_object_holding_a_socket():
    class SocketConverter:
        def __init__(self):
            self.sock = socket.socket()

        def __call__(self, batch, device=None):
            return chainer.dataset.concat_examples(batch, device)

    conv = SocketConverter()
    try:
        rejected(TypeError, r'^converter \(SocketConverter\) cannot be sent to a worker '
                 r"process: TypeError: cannot pickle 'socket' object; the culprit is "
                 r'converter\.sock \(<socket.socket', converter=conv)
    finally:
        conv.sock.close()


def test_lambda_loss_and_converter_are_accepted():
    """What StandardUpdater accepts, this updater accepts (they travel by value)."""
    updater = build(loss_func=lambda x, t: x, converter=lambda batch, device=None: batch)
    assert multiprocessing.active_children() == []
    updater.finalize()


# ------------------------------------------------------------------ NaN / inf loss
def params(updater):
    return {name: p.array.copy() for name, p in
            updater.get_optimizer('main').target.namedparams()}


def same(a, b):
    return all(numpy.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize('poison', ['nan', 'inf'])
@pytest.mark.parametrize('accumulate_steps', [1, 2])
def test_nonfinite_loss_raises_on_the_master(poison, accumulate_steps):
    """One device: the loss of update 2 is poisoned; the parameters stay as they were.
    With ``accumulate_steps=1`` the update is StandardUpdater's (``_update_direct``), its
    loss unscaled, and the step takes the short way of ``_apply``, which must look at the
    loss too. (Back-propagating inf makes numpy warn 'invalid value', an error under this
    suite's filterwarnings; errstate keeps that out of the way.)"""
    at = 2 if accumulate_steps == 1 else 3   # update 2's first forward
    updater = faulty.build(1, faulty.Fault('forward', poison, replica=0, at=at), prefetch=0,
                           accumulate_steps=accumulate_steps)
    updater.update()
    before = params(updater)
    with numpy.errstate(invalid='ignore'), pytest.raises(NonFiniteLossError, match=rf'^the loss became {poison} at update 2; '
                                                 r'parameters were not updated\. Lower the '
                                                 r"learning rate.*nonfinite='skip'") as info:
        updater.update()
    assert info.value.iteration == 2
    assert same(before, params(updater))
    updater.finalize()
    updater.finalize()


def test_nonfinite_loss_from_a_worker_raises():
    """The NaN comes from replica 1's window: the reduced loss is NaN, the master raises
    with the update number, stops the worker and cleans up."""
    updater = faulty.build(2, faulty.Fault('forward', 'nan', replica=1, at=3))
    updater.update()
    before = params(updater)
    with pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2;') as info:
        updater.update()
    assert info.value.iteration == 2 and numpy.isnan(info.value.loss)
    assert same(before, params(updater))
    assert multiprocessing.active_children() == []   # the failed update stopped them
    updater.finalize()
    updater.finalize()


def test_nonfinite_loss_skip_on_one_device_at_k1():
    """One device, one micro-batch per update (the short way of ``_apply``): under
    ``nonfinite='skip'`` the NaN update warns and leaves the parameters, the next steps."""
    updater = faulty.build(1, faulty.Fault('forward', 'nan', replica=0, at=2),
                           accumulate_steps=1, nonfinite='skip', prefetch=0)
    try:
        updater.update()
        before = params(updater)
        with numpy.errstate(invalid='ignore'), pytest.warns(RuntimeWarning,
                                                            match='skipping update 2'):
            updater.update()
        assert same(before, params(updater))
        updater.update()
        assert not same(before, params(updater))
    finally:
        updater.finalize()


def test_nonfinite_loss_skip():
    """``nonfinite='skip'``: a RuntimeWarning, no parameter change, training goes on."""
    updater = faulty.build(2, faulty.Fault('forward', 'nan', replica=1, at=3),
                           nonfinite='skip')
    try:
        updater.update()
        before = params(updater)
        t_before = updater.get_optimizer('main').t
        with pytest.warns(RuntimeWarning, match=r'^skipping update 2: the loss is nan$'):
            updater.update()
        assert same(before, params(updater))
        assert updater.get_optimizer('main').t == t_before
        updater.update()                   # the next update is finite and applies
        assert not same(before, params(updater))
        assert updater.iteration == 3
    finally:
        updater.finalize()
    assert multiprocessing.active_children() == []


def test_nonfinite_loss_ignore_steps_as_standard_updater_does():
    """``nonfinite='ignore'``: no error, no warning; the NaN step is applied, as
    StandardUpdater applies it. The master keeps its values as float64 arrays (on a GPU
    no host read: tests/test_gpu.py checks that), the same values ``'raise'`` reads as
    floats; numpy turns 0-dim results into numpy.float64, which is what a CPU shows."""
    runs = {}
    for policy in ('raise', 'ignore'):
        numpy.random.seed(0)   # the same initial parameters and shuffles in both runs
        updater = faulty.build(2, faulty.Fault('forward', 'nan', replica=1, at=5),
                               nonfinite=policy)
        try:
            runs[policy] = run_updates(updater, updater.get_optimizer('main').target, 2)
            if policy == 'ignore':
                with numpy.errstate(invalid='ignore'):
                    poisoned = run_updates(updater, updater.get_optimizer('main').target, 1)
                assert numpy.isnan(poisoned[0]['main/loss'])
                assert any(numpy.isnan(p).any() for p in params(updater).values())
        finally:
            updater.finalize()
    for raised, ignored in zip(runs['raise'], runs['ignore']):
        assert set(raised) == set(ignored) and raised
        for key, value in ignored.items():
            if key.startswith('main/time/'):   # wall-clock seconds: floats, not equal
                continue
            assert type(raised[key]) is float, key
            assert type(value) is not float, key      # never read into a Python float
            assert numpy.asarray(value).dtype == numpy.float64 and numpy.ndim(value) == 0
            assert float(value) == raised[key], key


def test_public_names():
    assert mgpu_updater.WorkerError.__module__ == 'mgpu_updater.errors'
    assert issubclass(NonFiniteLossError, FloatingPointError)


# ------------------------------------------------------------------ report_times
@pytest.mark.parametrize('value', ['no', 'False', 0, 1, None, 1.0])
def test_report_times_is_a_flag(value):
    """Validated as ``pipelined`` is: ``'no'`` used to read as True."""
    rejected(TypeError, rf'^report_times must be True or False \({re.escape(repr(value))} '
                        rf'of type {type(value).__name__} given\); pass report_times=True or '
                        r'report_times=False$', report_times=value)


@pytest.mark.parametrize('name', ['report_times', 'pipelined'])
@pytest.mark.parametrize('value', [True, False, numpy.bool_(True), numpy.bool_(False)])
def test_flags_take_python_and_numpy_bools(name, value):
    updater = build(**{name: value})
    assert getattr(updater, name) is bool(value)
    updater.finalize()


# ------------------------------------------------------------------ start_timeout
@pytest.mark.parametrize('value, error, shown', [
    (0, ValueError, '0'), (-5, ValueError, '-5'), (-0.5, ValueError, '-0.5'),
    (float('nan'), ValueError, 'nan'),
    (numpy.float32('nan'), ValueError, repr(numpy.float32('nan'))),   # numpy 2: np.float32(nan)
    ('60', TypeError, "'60' of type str"), (None, TypeError, 'None of type NoneType'),
    (True, TypeError, 'True of type bool'),
    (numpy.bool_(True), TypeError,   # numpy 1: True of type bool_; numpy 2: np.True_ of type bool
     f'{numpy.bool_(True)!r} of type {type(numpy.bool_(True)).__name__}'),
])
def test_start_timeout_must_be_positive_seconds(value, error, shown):
    rejected(error, rf'^start_timeout must be a number of seconds > 0 \({re.escape(shown)} '
                    r'given\); pass e\.g\. start_timeout=120', start_timeout=value)


@pytest.mark.parametrize('value', [float('inf'), numpy.inf, numpy.float32('inf'), 1e7,
                                   2147483.648])
def test_start_timeout_without_limit_is_refused(value):
    """Every wait of the start is bounded (a worker that hangs while starting is named).
    Waits beyond what the operating system's poll() takes (2147483.647 s) used to fail
    with OverflowError at the first update; infinity too."""
    message = rejected(
        ValueError, rf'^start_timeout must be at most 2147483 seconds, about 24 days '
                    rf'\({re.escape(repr(value))} given\): the start waits for the workers '
                    r'with a deadline, so that a worker that hangs while starting is named; '
                    r'pass a finite number of seconds, e\.g\. start_timeout=600',
        start_timeout=value)
    assert 'OverflowError' not in message


@pytest.mark.parametrize('name', ['stall_warning', 'update_timeout'])
@pytest.mark.parametrize('value', [float('inf'), 1e7])
def test_stall_waits_without_limit_are_refused_and_none_is_said(name, value):
    """Their waits have the same bound (poll()); None is their 'no limit'."""
    rejected(ValueError, rf'^{name} must be at most 2147483 seconds, about 24 days '
                         rf'\({re.escape(repr(value))} given\): the wait it bounds cannot be '
                         rf'longer; pass a finite number of seconds, e\.g\. {name}=600, or '
                         r'None for no limit$', **{name: value})


@pytest.mark.parametrize('name', ['stall_warning', 'update_timeout'])
def test_stall_waits_name_none_as_the_alternative(name):
    rejected(TypeError, rf"^{name} must be a number of seconds > 0 \('60' of type str given\); "
                        rf'pass e\.g\. {name}=120, or None for no limit$', **{name: '60'})
    rejected(ValueError, rf'^{name} must be a number of seconds > 0 \(0 given\); '
                         rf'pass e\.g\. {name}=120, or None for no limit$', **{name: 0})


def test_start_timeout_at_the_limit_is_accepted():
    updater = build(start_timeout=2147483)
    assert updater.start_timeout == 2147483.0
    updater.finalize()


# ------------------------------------------------------------------ communicator
class NotMpiComm:
    """Something with a rank and a size that is not a communicator."""
    rank = 0
    size = 1


class MpiCommLike:
    """What an mpi4py ``Intracomm`` offers (``rank``, ``size``, the buffer verbs), without
    the ``mpi_comm`` and ``bcast_obj`` of ChainerMN's communicators."""
    rank = 0
    size = 1

    def Allreduce(self, *args, **kwargs):
        raise AssertionError('not called')

    Bcast = Reduce = allgather = Allreduce


@pytest.mark.parametrize('value, shown, missing', [
    ('naive', "'naive' of type str", 'rank, size, mpi_comm, bcast_obj'),
    (3, '3 of type int', 'rank, size, mpi_comm, bcast_obj'),
    (NotMpiComm(), '<test_validation.NotMpiComm object at', 'mpi_comm, bcast_obj'),
])
def test_communicator_that_is_not_chainermn(value, shown, missing):
    """Refused at construction, not as an AttributeError at the first update."""
    rejected(TypeError, rf'^communicator must be a ChainerMN communicator \({re.escape(shown)}'
                        rf'.* given, which has no {missing}\); pass '
                        r"communicator=chainermn\.create_communicator\('naive'\) \(CPU\) or "
                        r"\('pure_nccl'\) \(GPU\) in every MPI rank, or None for the devices "
                        r'of this host', communicator=value, devices=['@numpy'],
             iterators=iterators(1))


def test_communicator_given_as_an_mpi4py_communicator():
    rejected(TypeError, r'^communicator must be a ChainerMN communicator \(.*MpiCommLike.* '
                        r'given, an mpi4py communicator\); wrap it: '
                        r"communicator=chainermn\.create_communicator\('naive', "
                        r'mpi_comm=<it>\)', communicator=MpiCommLike(), devices=['@numpy'],
             iterators=iterators(1))


class ChainerMnLike:
    """ChainerMN's shape: ``rank``, ``size``, ``mpi_comm``, ``bcast_obj``."""

    def __init__(self, rank=0, size=1, mpi_comm=None):
        self.rank, self.size = rank, size
        self.mpi_comm = MpiCommLike() if mpi_comm is None else mpi_comm

    def bcast_obj(self, obj, root=0):
        raise AssertionError('not called')


def test_communicator_whose_mpi_comm_has_not_the_verbs():
    rejected(TypeError, r'^communicator must be a ChainerMN communicator \(.*ChainerMnLike.* '
                        r'given, whose mpi_comm <object object at 0x[0-9a-f]+> '
                        r'has no Allreduce, Bcast, Reduce, allgather\); pass communicator=',
             communicator=ChainerMnLike(mpi_comm=object()), devices=['@numpy'],
             iterators=iterators(1))


@pytest.mark.parametrize('rank, size', [(1, 1), (-1, 2), (0, 0), (0.0, 2), (True, 2)])
def test_communicator_whose_rank_and_size_are_not_an_mpi_rank(rank, size):
    rejected(ValueError, rf'^communicator must be a ChainerMN communicator \(.* given, whose '
                         rf'rank {re.escape(repr(rank))} and size {size!r} are not those of an '
                         r'MPI rank\); pass communicator=',
             communicator=ChainerMnLike(rank, size), devices=['@numpy'],
             iterators=iterators(1))


def test_communicator_checked_before_the_devices_per_rank():
    """A string given for the communicator is named as such, not as 'one device per rank'."""
    rejected(TypeError, r"^communicator must be a ChainerMN communicator \('pure_nccl' ",
             communicator='pure_nccl')


def test_a_real_chainermn_communicator_passes_and_mpi4py_stays_unimported_without_one():
    """A ChainerMN communicator (MPI as a singleton, one rank) is accepted and trains one
    update; without a communicator, building the updater does not import mpi4py. In a fresh
    interpreter, so that this process never initialises MPI."""
    pytest.importorskip('chainermn')
    pytest.importorskip('mpi4py')   # create_communicator needs it (the mpi extra)
    script = r'''
import sys
import chainer, numpy
import chainer.links as L
from mgpu_updater import ParallelAccumulatingUpdater

def build(**kwargs):
    data = chainer.datasets.TupleDataset(numpy.zeros((8, 4), numpy.float32),
                                         numpy.zeros(8, numpy.int32))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(L.Classifier(L.Linear(4, 3)))
    return ParallelAccumulatingUpdater(chainer.iterators.SerialIterator(data, 4), optimizer,
                                       devices=['@numpy'], **kwargs)

build().finalize()
assert 'mpi4py' not in sys.modules, 'mpi4py imported without a communicator'
import chainermn
updater = build(communicator=chainermn.create_communicator('naive'))
updater.update()
updater.finalize()
print('trained', updater.iteration)
'''
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          timeout=120, env=SINGLETON_MPI_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == 'trained 1'


# ------------------------------------------------------------------ numpy counts and seconds
def _shard_its(**kwargs):
    args = dict(dataset=dataset(), n=2, batch_size=4)
    args.update(kwargs)
    return mgpu_updater.shard_iterators(args.pop('dataset'), args.pop('n'),
                                        args.pop('batch_size'))


_COUNTS = [
    # (argument, a numpy value, read back as, the Python value)
    ('accumulate_steps', numpy.int64(2), lambda u: u.accumulate_steps, 2),
    ('accumulate_steps', numpy.int32(3), lambda u: u.accumulate_steps, 3),
    ('accumulate_steps', numpy.uint8(1), lambda u: u.accumulate_steps, 1),
    ('prefetch', numpy.int64(0), lambda u: u.prefetch, 0),
    ('prefetch', numpy.int32(3), lambda u: u.prefetch, 3),
    ('micro_batch_size', numpy.int64(2), lambda u: u.micro_batch_size, 2),
    ('micro_batch_size', numpy.int16(8), lambda u: u.micro_batch_size, 8),
    ('blas_threads', numpy.int64(1), lambda u: u.blas_threads, 1),
    ('blas_threads', numpy.int32(2), lambda u: u.blas_threads, 2),
    ('start_timeout', numpy.int64(60), lambda u: u.start_timeout, 60.0),
    ('start_timeout', numpy.int32(30), lambda u: u.start_timeout, 30.0),
    ('start_timeout', numpy.float32(30.5), lambda u: u.start_timeout, 30.5),
    ('start_timeout', numpy.float64(0.25), lambda u: u.start_timeout, 0.25),
    ('stall_warning', numpy.float32(30.5), lambda u: u.stall_warning, 30.5),
    ('stall_warning', numpy.int64(60), lambda u: u.stall_warning, 60.0),
    ('update_timeout', numpy.int32(600), lambda u: u.update_timeout, 600.0),
    ('update_timeout', numpy.float64(1.5), lambda u: u.update_timeout, 1.5),
]


@pytest.mark.parametrize('name, value, read, expected', _COUNTS,
                         ids=[f'{c[0]}-{type(c[1]).__name__}' for c in _COUNTS])
def test_numpy_numbers_are_accepted_for_counts_and_seconds(name, value, read, expected):
    """Read back as Python numbers (what reaches the workers and the snapshots)."""
    updater = build(**{name: value})
    try:
        got = read(updater)
        assert got == expected and type(got) is type(expected)
    finally:
        updater.finalize()


@pytest.mark.parametrize('name, value', [('n', numpy.int64(2)), ('n', numpy.int32(3)),
                                         ('batch_size', numpy.int64(4)),
                                         ('batch_size', numpy.uint16(2))])
def test_numpy_integers_are_accepted_by_shard_iterators(name, value):
    its = _shard_its(**{name: value})
    assert len(its) == (int(value) if name == 'n' else 2)
    if name == 'batch_size':
        assert all(it.batch_size == int(value) and type(it.batch_size) is int for it in its)
        assert len(its[0].next()) == int(value)


@pytest.mark.parametrize('name', ['accumulate_steps', 'prefetch', 'micro_batch_size',
                                  'blas_threads', 'start_timeout', 'stall_warning',
                                  'update_timeout', 'n', 'batch_size'])
@pytest.mark.parametrize('value', [True, numpy.bool_(True)])
def test_bools_stay_refused_for_counts_and_seconds(name, value):
    # (numpy 2 writes numpy's True as np.True_)
    with pytest.raises(TypeError, match=rf'^{name} must be .*\((np\.)?True_?( of type '
                                        r'(bool|bool_))? given\); pass'):
        if name in ('n', 'batch_size'):
            _shard_its(**{name: value})
        else:
            build(**{name: value})


def test_numpy_counts_train_as_python_ones():
    """One update with every count and seconds given as numpy numbers."""
    updater = build(devices=['@numpy'], iterators=iterators(1),
                    accumulate_steps=numpy.int64(2), prefetch=numpy.int32(1),
                    micro_batch_size=numpy.int64(2), blas_threads=numpy.int64(1),
                    start_timeout=numpy.float32(60))
    try:
        updater.update()
        assert updater.iteration == 1
    finally:
        updater.finalize()


# ------------------------------------------------------------------ dicts, as StandardUpdater
def test_iterators_as_a_dict_with_main():
    """``{'main': it}`` as StandardUpdater takes it, on one device; ``{'main': [one per
    device]}`` on several."""
    it = iterators(1)[0]
    updater = build(iterators={'main': it}, devices=['@numpy'])
    assert updater.get_iterator('main') is it
    updater.finalize()
    its = iterators(2)
    updater = build(iterators={'main': its})
    assert updater.get_iterator('main') is its[0] and updater._worker_iterators == [its[1]]
    updater.finalize()
    updater = build(iterators={'main': tuple(its)})
    assert updater.get_iterator('main') is its[0]
    updater.finalize()


def test_iterators_dict_of_one_iterator_with_several_devices():
    rejected(ValueError, r"^iterators\['main'\] has 1 iterator\(s\) but devices has 2; give "
                         r"exactly one iterator per device, e\.g\. iterators=\{'main': "
                         r'\[it0, it1\]\} \(mgpu_updater\.shard_iterators builds them',
             iterators={'main': iterators(1)[0]})


def test_iterators_dict_without_main():
    rejected(ValueError, r"^iterators given as a dict needs a 'main' key \(keys \['train'\] "
                         r"given\); pass iterators=\{'main': \[it0, it1\]\}, one iterator per "
                         r'device, or the list itself', iterators={'train': iterators(2)})


def test_iterators_dict_with_other_keys():
    """StandardUpdater keeps other iterators for a custom update_core; this updater trains
    on 'main' only, so they would be carried along unused (and left out of snapshots)."""
    its = iterators(2)
    rejected(ValueError, r"^iterators has keys \['main', 'validation'\]; this updater reads "
                         r"only 'main' \(one iterator per device\): give the others to what "
                         r'uses them \(e\.g\. extensions\.Evaluator\(it, model\)\), not to the '
                         r'updater', iterators={'main': its, 'validation': iterators(1)[0]})
    rejected(ValueError, r"^iterators has keys \['main', 'second'\]; this updater reads only "
                         r"'main' \(one iterator per device\).*; for one iterator per device "
                         r"pass iterators=\{'main': \[it0, it1\]\}",
             iterators={'main': its[0], 'second': its[1]})


def test_optimizer_as_a_dict_with_main():
    optimizer = set_up()
    updater = build(optimizer={'main': optimizer})
    assert updater.get_optimizer('main') is optimizer
    assert list(updater.get_all_optimizers()) == ['main']
    updater.finalize()


def test_optimizer_dict_of_several():
    """A GAN's generator and discriminator: a custom update_core, not this updater."""
    rejected(ValueError, r"^optimizer has keys \['dis', 'gen'\]: this updater trains one "
                         r'model with one optimizer; several optimizers \(e\.g\. a GAN\'s '
                         r'generator and discriminator\) need their own update_core: '
                         r'subclass chainer\.training\.updaters\.StandardUpdater',
             optimizer={'gen': set_up(), 'dis': set_up()})
    rejected(ValueError, r"^optimizer has keys \['dis', 'main'\]: this updater trains one",
             optimizer={'main': set_up(), 'dis': set_up()})


def test_optimizer_dict_without_main_or_empty():
    rejected(ValueError, r"^optimizer given as a dict needs a 'main' key \(keys \[\] given\); "
                         r"pass the optimizer itself, or \{'main': optimizer\}", optimizer={})
    rejected(ValueError, r"^optimizer given as a dict needs a 'main' key \(keys \['gen'\] "
                         r'given\)', optimizer={'gen': set_up()})


def _build_in_this_process(queue):
    try:
        ParallelAccumulatingUpdater(
            [chainer.iterators.SerialIterator(dataset(4), 2) for _ in range(2)], set_up(),
            devices=['@numpy', '@numpy'])
    except RuntimeError as exc:
        queue.put(str(exc))
    else:
        queue.put('built')


def test_a_daemonic_process_is_refused_at_construction():
    """A multiprocessing.Pool worker is daemonic, and multiprocessing lets no daemonic
    process start children: the first update failed with its bare AssertionError
    ("daemonic processes are not allowed to have children"), deep in the pool."""
    import multiprocessing
    ctx = multiprocessing.get_context('spawn')
    queue = ctx.Queue()
    proc = ctx.Process(target=_build_in_this_process, args=(queue,), daemon=True)
    proc.start()
    try:
        said = queue.get(timeout=120)
    finally:
        proc.join(30)
    assert said.startswith('this process (') and 'is daemonic, as a multiprocessing.Pool ' \
        'worker or a Process(daemon=True) is' in said, said
    assert 'concurrent.futures.ProcessPoolExecutor' in said


class _OpensItsFileLazily(chainer.dataset.DatasetMixin):
    """Rows of float32 from a file it opens at its first read and keeps open (what the
    construction error advises, half of it)."""

    def __init__(self, path, n):
        self.path, self.n, self.handle = path, n, None

    def __len__(self):
        return self.n

    def get_example(self, i):
        if self.handle is None:
            self.handle = open(self.path, 'rb')
        self.handle.seek(12 * i)
        x = numpy.frombuffer(self.handle.read(12), numpy.float32).copy()
        return x, numpy.int32(i % 2)


def test_a_file_the_dataset_opened_since_construction_is_named_at_the_start(tmp_path):
    """The shards share one dataset object; the master reads its first batches before the
    workers' payloads are pickled, so the handle opened lazily is open by then: pickle's
    bare "cannot pickle '_io.BufferedReader' object" came from deep in the start."""
    path = tmp_path / 'rows.bin'
    numpy.arange(8 * 3, dtype=numpy.float32).tofile(path)
    data = _OpensItsFileLazily(str(path), 8)
    its = mgpu_updater.shard_iterators(data, 2, batch_size=2)
    model = L.Classifier(L.Linear(3, 2))
    updater = ParallelAccumulatingUpdater(its, set_up(model), devices=['@numpy', '@numpy'])
    try:
        with pytest.raises(TypeError, match=(
                r"^iterators\[1\] \(SerialIterator\) cannot be sent to a worker process: "
                r"TypeError: cannot pickle '(_io\.)?BufferedReader' (object|instances); "
                r"the culprit is "
                r"iterators\[1\]\..*handle .*It pickled when the updater was built: its "
                r"dataset opened this since")):
            updater.update()
    finally:
        updater.finalize()
        if data.handle is not None:
            data.handle.close()
