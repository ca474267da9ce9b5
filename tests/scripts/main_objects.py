"""A script in the style of Chainer's examples whose objects live in ``__main__``.

    python main_objects.py [global]

Run as a script under ``spawn``: each worker imports this file as ``__mp_main__`` and never
runs the guarded block, so the model class, the loss lambda and the dataset class defined
there exist only in the master. With ``global`` the ``loss_func`` is a function of the
script that reaches the model through a global of the script (``NET``), which a worker's
import leaves None: it travels with the function, in the same payload as the model, and
is the worker's replica. Prints ``MAX_ABS_DIFF`` between two CPU replicas and
``StandardUpdater`` on the same samples, and ``MOVED`` (how far training moved the weights).
"""
import sys

import numpy

import mgpu_updater
import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater


NET = None   # the model, set in the guarded block (``global``)


def global_loss(x, t):
    """A loss_func that reaches the model through a global of the script."""
    return F.softmax_cross_entropy(NET(x), t)


def make_data(n, seed):
    rng = numpy.random.RandomState(seed)
    return (rng.rand(n, 4).astype(numpy.float32), rng.randint(0, 3, n).astype(numpy.int32))


if __name__ == '__main__':
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.fc = L.Linear(4, 3)

        def forward(self, x):
            return self.fc(x)

    class Pairs(chainer.dataset.DatasetMixin):
        def __init__(self, x, t):
            self.x, self.t = x, t

        def __len__(self):
            return len(self.x)

        def get_example(self, i):
            return self.x[i], self.t[i]

    def main():
        global NET
        k, b, updates = 2, 4, 2
        shards = [Pairs(*make_data(k * b * updates, seed)) for seed in (1, 2)]
        numpy.random.seed(0)
        model = Net()
        reference = model.copy(mode='copy')
        start = model.fc.W.array.copy()
        loss = lambda x, t: F.softmax_cross_entropy(model(x), t)   # noqa: E731
        if sys.argv[1:] == ['global']:
            NET, loss = model, global_loss

        optimizer = chainer.optimizers.SGD(0.5)
        optimizer.setup(model)
        updater = mgpu_updater.ParallelAccumulatingUpdater(
            [chainer.iterators.SerialIterator(s, b, shuffle=False) for s in shards],
            optimizer, devices=['@numpy', '@numpy'], accumulate_steps=k, loss_func=loss)
        try:
            for _ in range(updates):
                updater.update()
        finally:
            updater.finalize()

        ref_loss = lambda x, t: F.softmax_cross_entropy(reference(x), t)   # noqa: E731
        ref_opt = chainer.optimizers.SGD(0.5)
        ref_opt.setup(reference)
        for u in range(updates):
            batch = [s[i] for s in shards for i in range(u * k * b, (u + 1) * k * b)]
            StandardUpdater(chainer.iterators.SerialIterator(batch, len(batch), shuffle=False),
                            ref_opt, loss_func=ref_loss).update()
        diff = max(float(abs(p.array - q.array).max())
                   for p, q in zip(model.params(), reference.params()))
        print('MAX_ABS_DIFF', diff, flush=True)
        print('MOVED', float(abs(model.fc.W.array - start).max()), flush=True)

    main()
