"""Small models and data shared by the tests (importable by spawned workers)."""
from __future__ import annotations

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L


class MLP(chainer.Chain):
    def __init__(self, n_in=5, n_hidden=16, n_out=3, batchnorm=False, lazy=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None if lazy else n_in, n_hidden)
            self.bn = L.BatchNormalization(n_hidden) if batchnorm else None
            self.l2 = L.Linear(n_hidden, n_out)

    def forward(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(F.relu(h))


def classifier(seed=0, **kwargs):
    np.random.seed(seed)
    return L.Classifier(MLP(**kwargs))


def dataset(n, seed, n_in=5, n_out=3, dtype=np.float32):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, n_in).astype(dtype)
    t = rng.randint(0, n_out, n).astype(np.int32)
    return chainer.datasets.TupleDataset(x, t)


def make_optimizer(kind):
    if kind == 'sgd':
        return chainer.optimizers.SGD(0.1), []
    if kind == 'momentum+decay':
        return chainer.optimizers.MomentumSGD(0.05), [chainer.optimizer_hooks.WeightDecay(1e-3)]
    if kind == 'adam':
        return chainer.optimizers.Adam(1e-2), []
    if kind == 'clip':
        return chainer.optimizers.SGD(0.5), [chainer.optimizer_hooks.GradientClipping(0.05)]
    raise ValueError(kind)


def setup_optimizer(kind, model):
    opt, hooks = make_optimizer(kind)
    opt.setup(model)
    for hook in hooks:
        opt.add_hook(hook)
    return opt


def two_cpu_replicas(n_samples=32, model=None, **kwargs):
    """``model`` (default: ``classifier(seed=0)``) with SGD on two '@numpy' replicas, each
    reading its shard of ``dataset(n_samples, seed=1)`` in micro-batches of 4; ``kwargs`` go
    to the updater. Returns (model, updater)."""
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators
    model = classifier(seed=0) if model is None else model
    optimizer = setup_optimizer('sgd', model)
    its = shard_iterators(dataset(n_samples, seed=1), 2, 4)
    return model, ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'],
                                              **kwargs)


def params(model):
    return {name: np.array(p.array) for name, p in model.namedparams()}


def persistents(model):
    out = {}
    for path, link in model.namedlinks():
        for name in link._persistent:
            value = link.__dict__[name]
            if isinstance(value, np.ndarray):
                out[f'{path}/{name}'] = value.copy()
    return out


def run_updates(updater, model, n):
    """Run n updates inside a reporter; return the observations of each."""
    observations = []
    for _ in range(n):
        reporter = chainer.Reporter()   # the observers a Trainer registers
        reporter.add_observer('main', model)
        reporter.add_observers('main', model.namedlinks(skipself=True))
        obs = {}
        with reporter.scope(obs):
            updater.update()
        observations.append(obs)
    return observations


class TiedMLP(chainer.Chain):
    """An MLP whose last two layers share one weight, registered in both links
    (``self.l3.W = self.l2.W``), as language models tie their embedding and output."""

    def __init__(self, n_in=5, n_hidden=8, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_hidden)
            self.out = L.Linear(n_hidden, n_out)
        self.l3.W = self.l2.W

    def forward(self, x):
        h = F.tanh(self.l1(x))
        h = F.tanh(self.l2(h))
        h = F.tanh(self.l3(h))
        return self.out(h)


class TiedEmbedding(chainer.Chain):
    """A bag-of-words classifier whose output layer is its embedding matrix (one
    parameter used twice in forward, registered once), plus a bias."""

    def __init__(self, n_vocab=7, n_units=6):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.mid = L.Linear(n_units, n_units)

    def forward(self, x):
        h = F.tanh(self.mid(F.sum(self.embed(x), axis=1)))
        return F.linear(h, self.embed.W)


class RaisesAt(chainer.dataset.DatasetMixin):
    """A dataset whose example ``at`` raises ``error`` (a corrupt sample)."""

    def __init__(self, base, at, error):
        self.base, self.at, self.error = base, at, error

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        if i == self.at:
            raise self.error
        return self.base[i]


class StopsAt(RaisesAt):
    """A dataset whose example ``at`` raises StopIteration (a bug in user code: an
    iterator over it that repeats must not take that as the end of its data)."""

    def __init__(self, base, at):
        super().__init__(base, at, StopIteration('planted'))


class GrowsInForward(chainer.Chain):
    """Creates a link inside forward, on the first call (in ``init_scope``): each replica
    would draw that link's initial values itself."""

    def __init__(self, n_in=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_out)

    def forward(self, x):
        if not hasattr(self, 'extra'):
            with self.init_scope():
                self.extra = L.Linear(3, 3)
        return self.extra(F.relu(self.l1(x)))


def _sleep_in_forward(seconds):
    import time
    time.sleep(seconds)


class SleepsInWorker(chainer.Chain):
    """A classifier whose forward sleeps ``seconds`` in the worker processes (or, with
    ``in_master``, in the master) from its ``at``-th call on, once (every call with
    ``every``)."""

    def __init__(self, seconds, at=2, in_master=False, every=False):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=0)
        self.seconds, self.at, self.in_master, self.every = seconds, at, in_master, every
        self.calls = 0

    def forward(self, x, t):
        import multiprocessing
        in_worker = multiprocessing.current_process().name.startswith('mgpu-worker')
        self.calls += 1
        if in_worker != self.in_master and (
                self.calls == self.at or (self.every and self.calls > self.at)):
            _sleep_in_forward(self.seconds)
        return self.inner(x, t)


class SometimesExtra(chainer.Chain):
    """An MLP with a second head that only samples whose first feature is above
    ``threshold`` use, called only for a batch that holds such a sample: a parameter that
    a micro-batch, a replica or a whole update may leave without a gradient (``grad is
    None``, as a branch or a mixture of experts leaves one). Each sample's output depends
    on that sample alone, so one large batch and its micro-batches train alike."""

    def __init__(self, threshold, n_in=5, n_hidden=8, n_out=3):
        super().__init__()
        self.threshold = threshold
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_out)
            self.extra = L.Linear(n_hidden, n_out)

    def forward(self, x):
        h = F.relu(self.l1(x))
        y = self.l2(h)
        x0 = getattr(x, 'array', x)[:, 0]
        mask = (x0 > self.threshold).astype(x0.dtype)
        if mask.any():
            y = y + mask[:, None] * self.extra(h)
        return y


class SummedPrior(chainer.Chain):
    """``classifier(seed)`` plus a parameter that the loss only sums whole (``F.sum(c)``):
    Chainer's backward leaves ``c`` a read-only broadcast as its gradient."""

    def __init__(self, seed=0):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed)
            self.c = chainer.Parameter(np.zeros(3, np.float32))

    def forward(self, x, t):
        return self.inner(x, t) + 0.1 * F.sum(self.c)


class Annealed(chainer.Chain):
    """``classifier(seed)`` plus a penalty whose weight ``beta`` an extension anneals
    between updates: a plain attribute (``persistent=False``), which the workers' copies
    never receive, or a persistent, which every update sends. The forward also sets an
    attribute once, the same on every replica (``shape``)."""

    def __init__(self, seed=0, persistent=False):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed)
        if persistent:
            self.add_persistent('beta', 0.0)
        else:
            self.beta = 0.0
        self.shape = None

    def forward(self, x, t):
        self.shape = tuple(x.shape[1:])
        return self.inner(x, t) + self.beta * F.mean(self.inner.predictor.l2.W ** 2)


class TrainOnlyHead(chainer.Chain):
    """``classifier(seed)`` with a lazy auxiliary head only training mode calls."""

    def __init__(self, seed=0):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed)
            self.aux = L.Linear(None, 2)

    def forward(self, x, t):
        loss = self.inner(x, t)
        if chainer.config.train:
            loss = loss + 0.1 * F.mean(self.aux(x) ** 2)
        return loss


class UnusedLazyLink(chainer.Chain):
    """``classifier(seed)`` beside a lazy link that no forward calls (a library's model
    that registers a layer only some of its configurations use): it stays uninitialised,
    as under ``StandardUpdater``."""

    def __init__(self, seed=0):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed)
            self.unused = L.Linear(None, 2)

    def forward(self, x, t):
        return self.inner(x, t)


class LazyRecurrent(chainer.Chain):
    """A lazy LSTM whose state carries from one update to the next (never reset): what
    its forward keeps from one call to the next, outside parameters and persistents."""

    def __init__(self, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.rnn = L.LSTM(None, 4)
            self.out = L.Linear(4, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.out(self.rnn(x)), t)


class LazyFixedProjection(chainer.Chain):
    """A lazy link beside what its first call makes once and keeps (from numpy's global
    generator): a random projection held as a Variable, and a mask an int flag marks as
    made. Every replica must start from the master's, as StandardUpdater's one model
    makes them at its first call."""

    def __init__(self, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.l1 = L.Linear(None, 3)
        self.proj, self.made, self.mask = None, 0, None

    def forward(self, x, t):
        if self.proj is None:
            self.proj = chainer.Variable(
                np.random.randn(x.shape[1], x.shape[1]).astype(np.float32),
                requires_grad=False)
        if not self.made:
            self.mask = (np.random.rand(x.shape[1]) > 0.5).astype(np.float32)
            self.made = 1
        return F.softmax_cross_entropy(self.l1(F.matmul(x * self.mask, self.proj)), t)


class Reservoir(chainer.Link):
    """A recurrent link of one's own: ``reset_state`` clears its state ``h``; its
    projection, a Variable drawn once at the first call (numpy's global generator), is no
    state."""

    def __init__(self):
        super().__init__()
        self.proj = None
        self.reset_state()

    def reset_state(self):
        self.h = None

    def forward(self, x):
        if self.proj is None:
            self.proj = chainer.Variable(
                np.random.randn(x.shape[1], 4).astype(np.float32), requires_grad=False)
        h = F.tanh(F.matmul(x, self.proj))
        if self.h is not None:
            h = h + 0.5 * self.h
        self.h = h
        return h


class LazyReservoir(chainer.Chain):
    """:class:`Reservoir` (its state carried from update to update) under a lazy head."""

    def __init__(self, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.res = Reservoir()
            self.out = L.Linear(None, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.out(self.res(x)), t)


class _Cell(chainer.Chain):
    """A recurrent cell of one's own, its state ``h`` carried from call to call:
    ``'argument'``: its ``reset_state`` needs an argument; ``'dict'``: the state lives in a
    dict the forward fills in place; ``'learned'``: ``reset_state`` starts from a learned
    initial state, a parameter."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        with self.init_scope():
            self.l = L.Linear(5, 5)
            if kind == 'learned':
                self.h0 = chainer.Parameter(np.zeros((1, 5), np.float32))
        if kind == 'argument':
            self.reset_state(None)
        else:
            self.reset_state()

    def reset_state(self, *size):
        if self.kind == 'argument' and not size:
            raise TypeError('reset_state() needs the batch size')
        if self.kind == 'dict':
            self.cache = {}
        elif self.kind == 'learned':
            self.h = self.h0
        else:
            self.h = None

    def forward(self, x):
        h = self.cache.get('h') if self.kind == 'dict' else self.h
        if h is not None and h.shape != x.shape:   # the learned initial state: one row
            h = F.broadcast_to(h, x.shape)
        y = F.tanh(self.l(x) if h is None else self.l(x) + h)
        if self.kind == 'dict':
            self.cache['h'] = y
        else:
            self.h = y
        return y


class LazyCell(chainer.Chain):
    """:class:`_Cell` of ``kind`` under a lazy head, its state never reset."""

    def __init__(self, kind, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.cell = _Cell(kind)
            self.out = L.Linear(None, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.out(self.cell(x)), t)


class LazyPairs(chainer.Chain):
    """A lazy model that compares the batch's even and odd samples: a batch of one
    sample cannot go through it. It counts its calls in a persistent."""

    def __init__(self, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.l1 = L.Linear(None, 4)
        self.add_persistent('calls', 0)

    def forward(self, x, t):
        self.calls += 1
        h = self.l1(x)
        return F.mean((h[0::2] - h[1::2]) ** 2) + 0.0 * F.sum(t.astype(np.float32))


class RaisesAtCall(chainer.Chain):
    """``classifier(0)``'s MLP whose forward raises at its ``at``-th call (each replica
    counts its own)."""

    def __init__(self, at, error=ValueError):
        super().__init__()
        np.random.seed(0)
        with self.init_scope():
            self.net = MLP()
        self.at, self.calls, self.error = at, 0, error

    def forward(self, x, t):
        self.calls += 1
        if self.calls == self.at:
            raise self.error(f'forward call {self.calls}')
        return F.softmax_cross_entropy(self.net(x), t)


class RaisesBesideUnusedLazyLink(RaisesAtCall):
    """:class:`RaisesAtCall` with a lazy link no forward calls: Chainer raises on reading
    that link's gradient until ``cleargrads()`` ran, which a failure before the first
    backward precedes."""

    def __init__(self, at):
        super().__init__(at)
        with self.init_scope():
            self.unused = L.Linear(None, 2)


class LazyRaisesInTestMode(chainer.Chain):
    """A lazy model whose forward cannot run in test mode."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, 3)

    def forward(self, x, t):
        if not chainer.config.train:
            raise ValueError('this model trains only')
        return F.softmax_cross_entropy(self.l1(x), t)


class BufferInForward(chainer.Chain):
    """``classifier(seed)`` with a persistent registered as None and made an array in its
    first forward."""

    def __init__(self, seed=0):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed)
        self.add_persistent('buf', None)

    def forward(self, x, t):
        if self.buf is None:
            self.buf = np.zeros(3, np.float32)
        return self.inner(x, t)


class StaticLazyMLP(chainer.Chain):
    """Chainer's static-graph MNIST model in small: ``@static_graph`` on a forward whose
    links have lazy input sizes (``L.Linear(None, n)``)."""

    def __init__(self, n_units=8, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_out)

    @chainer.static_graph
    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


class StaticLazyClassifier(chainer.Chain):
    """``L.Classifier(StaticLazyMLP())`` without the accuracy report, as a chain of its own
    (the test builds two alike)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.predictor = StaticLazyMLP()

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.predictor(x), t)


class PartlyStatic(chainer.Chain):
    """A ``@static_graph`` body under a plain head: a backward sets the body's gradients
    and adds to the head's."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.body = StaticLazyMLP()
            self.head = L.Linear(3, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.head(self.body(x)), t)


class ConstantWhenEmpty(chainer.Chain):
    """A loss that is 0 for samples labelled -1 (nothing to find there), summed over the
    others and divided by the batch size; a batch of nothing but such samples gives the
    constant 0, with no graph, as chainercv's ``multibox_loss`` does for images without
    objects."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        if (t < 0).all():
            return chainer.Variable(self.xp.zeros((), np.float32))
        loss = F.softmax_cross_entropy(self.l1(x), t, reduce='no')   # 0 where t == -1
        return F.sum(loss) / len(t)


def _zero_sum(x):
    return F.sum(x * 0.0)


class ConstantWhenEmptyForgotten(ConstantWhenEmpty):
    """:class:`ConstantWhenEmpty` whose constant comes out of ``F.forget`` over the input
    (a node whose inputs are not parameters, and whose function reaches none)."""

    def forward(self, x, t):
        if (t < 0).all():
            return F.forget(_zero_sum, chainer.Variable(x))
        return super().forward(x, t)


class ConstantWhenEmptyForgottenMethod(ConstantWhenEmpty):
    """:class:`ConstantWhenEmptyForgotten` forgetting a method of the model itself (a
    function that reaches the replica's own model, and gives no gradient)."""

    def _zero(self, x):
        return F.sum(x * 0.0)

    def forward(self, x, t):
        if (t < 0).all():
            return F.forget(self._zero, chainer.Variable(x))
        return super().forward(x, t)


class SharedCopies(chainer.Chain):
    """Chainer's ``repeat(3, mode='share')``: three blocks whose parameters are objects of
    their own over one array each (each with its own gradient and update rule)."""

    def __init__(self, n=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.mid = chainer.Sequential(L.Linear(n, n), F.tanh).repeat(3, mode='share')
            self.out = L.Linear(n, n_out)

    def forward(self, x):
        return self.out(self.mid(x))


class TiedAcrossStatic(chainer.Chain):
    """A ``@static_graph`` body whose last weight is also a plain head's (``head.W =
    body.l2.W``)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.body = StaticLazyMLP(n_units=3)
            self.head = L.Linear(3, 3)
        self.body.l2.W.initialize((3, 3))
        with self.head.init_scope():
            self.head.W = self.body.l2.W

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.head(self.body(x)), t)


class ReadsItsGradient(chainer.Chain):
    """A forward that back-propagates its own loss to read a gradient's norm (reported),
    as a model that logs or penalises it may: ``cleargrads()`` then ``backward()``."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        loss = F.softmax_cross_entropy(self.l1(x), t)
        self.cleargrads()
        loss.backward()
        chainer.report({'grad_norm': float(np.sqrt((self.l1.W.grad ** 2).sum()))}, self)
        return loss


class ReadsItsGradientNowAndThen(ReadsItsGradient):
    """:class:`ReadsItsGradient` that reads it at every third call only (logging now and
    then); the other calls are plain."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        if self.calls % 3 == 0:
            return super().forward(x, t)
        return F.softmax_cross_entropy(self.l1(x), t)


class LinkTiedAcrossStatic(chainer.Chain):
    """A ``@static_graph`` body whose last link is also a plain head (``self.head =
    self.body.l2``, registered in both)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.body = StaticLazyMLP(n_units=3)
            self.body.l2.W.initialize((3, 3))
            self.head = self.body.l2

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.head(self.body(x)), t)


class ShareThenView(chainer.Chain):
    """``b = a.copy(mode='share')`` (parameters of their own over one array) and a third
    layer whose weight is a view of that array, transposed."""

    def __init__(self, n=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(n, n)
            self.b = self.a.copy(mode='share')
            self.c = L.Linear(n, n)
            self.out = L.Linear(n, n_out)
        self.c.W.array = self.a.W.array.T

    def forward(self, x):
        return self.out(F.tanh(self.c(F.tanh(self.b(F.tanh(self.a(x)))))))


class SameArrayThenView(chainer.Chain):
    """Two layers that hold the very same weight array (``l2.W.array = l1.W.array``) and a
    third whose weight is a view of it, transposed."""

    def __init__(self, n=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n, n)
            self.l2 = L.Linear(n, n)
            self.l3 = L.Linear(n, n)
            self.out = L.Linear(n, n_out)
        self.l2.W.array = self.l1.W.array
        self.l3.W.array = self.l1.W.array.T

    def forward(self, x):
        return self.out(F.tanh(self.l3(F.tanh(self.l2(F.tanh(self.l1(x)))))))


class ViewTied(chainer.Chain):
    """Two square layers, the second's weight a view of the first's, transposed
    (``l2.W.array = l1.W.array.T``): parameters of their own over one memory."""

    def __init__(self, n=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n, n)
            self.l2 = L.Linear(n, n)
            self.out = L.Linear(n, n_out)
        self.l2.W.array = self.l1.W.array.T

    def forward(self, x):
        return self.out(F.tanh(self.l2(F.tanh(self.l1(x)))))


class FlatStorage(chainer.Chain):
    """Two layers whose weights are views of one flat array the model keeps in a plain
    attribute (``self.flat``), as code that packs its parameters does; the forward does
    not read it."""

    def __init__(self, n=5, n_out=3):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n, n)
            self.out = L.Linear(n, n_out)
        self.flat = np.concatenate([self.l1.W.array.ravel(), self.out.W.array.ravel()])
        self.l1.W.array = self.flat[:n * n].reshape(n, n)
        self.out.W.array = self.flat[n * n:].reshape(n_out, n)

    def forward(self, x):
        return self.out(F.tanh(self.l1(x)))


class WeightedLoss(chainer.Chain):
    """A classifier that weights its loss's gradient by setting it before the backward
    (``loss.grad = w``): ``Variable.backward`` seeds from it as it is, not with ones."""

    def __init__(self, weight=0.5):
        super().__init__()
        self.weight = weight
        with self.init_scope():
            self.predictor = MLP()

    def forward(self, x, t):
        loss = F.softmax_cross_entropy(self.predictor(x), t)
        loss.grad = np.array(self.weight, dtype=loss.dtype)
        return loss


class ConstrainsInForward(chainer.Chain):
    """A classifier whose forward applies a max-norm constraint to its first layer's
    rows in place, before using it (a constraint written into the model)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.predictor = MLP()

    def forward(self, x, t):
        W = self.predictor.l1.W.array
        W *= np.minimum(1.0, 0.5 / np.sqrt((W ** 2).sum(axis=1, keepdims=True)))
        return F.softmax_cross_entropy(self.predictor(x), t)


class SavesExtraState(chainer.Chain):
    """``classifier``'s MLP with state of its own that its ``serialize`` saves and loads,
    telling the two apart as Chainer's own code does (``LogReport``):
    ``isinstance(serializer, chainer.serializer.Serializer)``."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.mlp = MLP()
        self.count = 0

    def forward(self, x):
        return self.mlp(x)

    def serialize(self, serializer):
        super().serialize(serializer)
        if isinstance(serializer, chainer.serializer.Serializer):
            serializer('count', np.int64(self.count))
        else:
            self.count = int(serializer('count', 0))


class GrowsPersistent(chainer.Chain):
    """``MLP`` with a persistent queue of inputs that its forward grows by a row at its
    call ``at_call`` (in training) and rolls otherwise, as a memory bank would."""

    def __init__(self, at_call):
        super().__init__()
        with self.init_scope():
            self.mlp = MLP()
        self.at_call = at_call
        self.calls = 0
        self.add_persistent('queue', np.zeros((1, 5), np.float32))

    def forward(self, x):
        if chainer.config.train:
            self.calls += 1
            rows = x[:1] if self.calls == self.at_call else x[:0]
            self.queue = np.concatenate([self.queue, rows])
        return self.mlp(x)
