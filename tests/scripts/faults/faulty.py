"""Pieces that fail on purpose, in one chosen worker only, at one chosen call.

A :class:`Fault` travels (pickled) with the model, the dataset or the converter into every
replica; it fires only in the process named ``mgpu-worker-<replica>`` (never in the master,
whose pid it was given; ``replica=0`` means the master itself) at the ``at``-th call of its
site in that process. Before firing it
writes ``time.time()`` to ``stamp`` so the driver can measure the time to error.

Sites: ``'forward'``, ``'backward'``, ``'iterator'`` (dataset ``__getitem__``, called by
the iterator), ``'converter'``, ``'start'`` (unpickling the dataset in the worker), and
two in the package's own code, which the fault wraps in the chosen worker when it is
unpickled there: ``'reduce'`` (the worker's ``reduce`` of its gradient, after its window)
and ``'post'`` (just after its post at the board: its update is complete).
Actions: ``'raise'``, ``'kill'`` (SIGKILL itself), ``'nan'`` / ``'inf'`` (the loss of
that forward becomes NaN / infinite).

``once``: fire in one process of the run only (the ``stamp`` file says it fired), so that
the worker that replaces a killed one (``max_worker_restarts``) does not fire again.
"""
import multiprocessing
import os
import signal
import time

import numpy

import mgpu_updater  # noqa: F401  (its compat shim first: Python 3.12, numpy 2)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer.dataset import concat_examples

N_IN, N_OUT = 4, 3


class FaultInjected(RuntimeError):
    """The error a fault raises (its name is looked for in the remote traceback)."""


class Fault:
    def __init__(self, site=None, action='raise', replica=1, at=1, master_pid=None,
                 stamp=None, once=False):
        self.site, self.action, self.replica, self.at = site, action, replica, at
        self.master_pid = os.getpid() if master_pid is None else master_pid
        self.stamp = stamp
        self.once = once
        self.calls = 0

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.site in _WRAPPED and self.armed_here():
            _wrap(self)

    def armed_here(self):
        if self.replica == 0:
            return os.getpid() == self.master_pid
        return (os.getpid() != self.master_pid and multiprocessing.current_process().name
                == f'mgpu-worker-{self.replica}')

    def hit(self, site):
        """Called by each site; returns the action when ``'nan'`` / ``'inf'`` fires."""
        if site != self.site or not self.armed_here():
            return False
        if self.once and self.stamp and os.path.exists(self.stamp):
            return False
        self.calls += 1
        if self.calls != self.at:
            return False
        if self.stamp:
            with open(self.stamp, 'w') as f:
                f.write(repr(time.time()))
        if self.action == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)   # not reached
        if self.action in ('nan', 'inf'):
            return self.action
        raise FaultInjected(f'injected fault in {site}, call {self.calls}, pid {os.getpid()}')


_WRAPPED = ('reduce', 'post')
_wrapped_by = []   # the fault whose hits the wrappers count, in this process


def _wrap(fault):
    """In the chosen worker: make the package's ``reduce`` (of the gradient buffers) or
    the board's ``post`` a site of ``fault`` (once per process)."""
    if _wrapped_by:
        return
    _wrapped_by.append(fault)
    if fault.site == 'reduce':
        from mgpu_updater.comm.shm import ShmCommunicator
        reduce = ShmCommunicator.reduce

        def reducing(self, name, root=0):
            if name.startswith('grad'):
                fault.hit('reduce')
            return reduce(self, name, root)
        ShmCommunicator.reduce = reducing
    else:
        from mgpu_updater._local.board import Board
        post = Board.post

        def posting(self, count=None, loss=None):
            post(self, count, loss)
            fault.hit('post')
        Board.post = posting


class _BoomOnBackward(chainer.FunctionNode):
    """Identity whose backward lets the fault fire."""

    def __init__(self, fault):
        self.fault = fault

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grad_outputs):
        self.fault.hit('backward')
        return grad_outputs


class Net(chainer.Chain):
    """A small classifier; ``delay`` seconds of sleep per forward make updates last;
    ``dropout``: the ratio of a dropout on the hidden layer (random numbers drawn from
    numpy's global generator, in every replica)."""

    def __init__(self, fault=None, delay=0.0, dropout=0.0):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(N_IN, 8)
            self.l2 = L.Linear(8, N_OUT)
        self.fault = fault or Fault()
        self.delay = delay
        self.dropout = dropout

    def forward(self, x, t):
        if self.delay:
            time.sleep(self.delay)
        poison = self.fault.hit('forward')
        h = _BoomOnBackward(self.fault).apply((F.relu(self.l1(x)),))[0]
        if self.dropout:
            h = F.dropout(h, self.dropout)
        loss = F.softmax_cross_entropy(self.l2(h), t)
        if poison:
            loss = loss * numpy.float32(poison)
        chainer.report({'loss': loss}, self)
        return loss


class Dataset:
    """Random (x, t) pairs; the fault may fire in ``__getitem__`` or when unpickled."""

    def __init__(self, n, fault=None, seed=0):
        rng = numpy.random.RandomState(seed)
        self.x = rng.rand(n, N_IN).astype(numpy.float32)
        self.t = rng.randint(0, N_OUT, n).astype(numpy.int32)
        self.fault = fault or Fault()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.fault.hit('iterator')
        return self.x[i], self.t[i]

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fault.hit('start')


class Converter:
    """``concat_examples`` with a fault."""

    def __init__(self, fault=None):
        self.fault = fault or Fault()

    def __call__(self, batch, device=None):
        self.fault.hit('converter')
        return concat_examples(batch, device)


def build(n_replicas=2, fault=None, accumulate_steps=2, batch_size=4, n=64, delay=0.0,
          prefetch='auto', iterator='serial', dropout=0.0, own_orders=False, **kwargs):
    """An updater over ``n_replicas`` CPU replicas with ``fault`` planted everywhere.

    ``iterator='multiprocess'``: every replica reads through a ``MultiprocessIterator``
    with two processes of its own (the workers' grandchildren). Every iterator shuffles
    (Chainer's default, from numpy's global generator in the master; ``own_orders``: each
    from a generator of its own, seeded by its replica); ``dropout`` as for :class:`Net`.
    """
    from mgpu_updater import ParallelAccumulatingUpdater
    fault = fault or Fault()
    model = Net(fault, delay, dropout)
    optimizer = chainer.optimizers.SGD(lr=0.1)
    optimizer.setup(model)
    def orders(r):
        return (chainer.iterators.ShuffleOrderSampler(numpy.random.RandomState(r))
                if own_orders else None)
    if iterator == 'multiprocess':
        def make(dataset, r):
            return chainer.iterators.MultiprocessIterator(dataset, batch_size, n_processes=2,
                                                          order_sampler=orders(r))
    else:
        def make(dataset, r):
            return chainer.iterators.SerialIterator(dataset, batch_size,
                                                    order_sampler=orders(r))
    iterators = [make(Dataset(n, fault, seed=r), r) for r in range(n_replicas)]
    return ParallelAccumulatingUpdater(
        iterators, optimizer, devices=['@numpy'] * n_replicas,
        accumulate_steps=accumulate_steps, converter=Converter(fault), prefetch=prefetch,
        **kwargs)


def own_segments():
    """Names of the shared-memory segments this process has mapped (``mgpu_*``)."""
    names = set()
    with open('/proc/self/maps') as f:
        for line in f:
            if '/dev/shm/mgpu_' in line:
                names.add(line.split('/dev/shm/', 1)[1].split()[0])
    return sorted(names)
