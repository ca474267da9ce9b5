"""A script that trains at module level, without ``if __name__ == '__main__':``.

    python no_guard.py N_SAMPLES [START_METHOD]

Every worker process imports this file again and so tries to train too. The master must
raise a WorkerError that says the script needs the guard, within seconds, whatever the
size of the payload (N_SAMPLES rows of 256 floats per replica's shard).
"""
import pickle
import sys
import time

import numpy

import mgpu_updater
import chainer
import chainer.links as L

n = int(sys.argv[1])
method = sys.argv[2] if len(sys.argv) > 2 else 'spawn'
rng = numpy.random.RandomState(0)
data = [chainer.datasets.TupleDataset(rng.rand(n, 256).astype(numpy.float32),
                                      rng.randint(0, 3, n).astype(numpy.int32))
        for _ in range(2)]
model = L.Classifier(L.Linear(256, 3))
optimizer = chainer.optimizers.SGD()
optimizer.setup(model)
updater = mgpu_updater.ParallelAccumulatingUpdater(
    [chainer.iterators.SerialIterator(d, 4) for d in data], optimizer,
    devices=['@numpy', '@numpy'], start_method=method)
print('PAYLOAD_BYTES', len(pickle.dumps(data[1])), flush=True)
t0 = time.monotonic()
try:
    updater.update()
except mgpu_updater.WorkerError as exc:
    print('SECONDS_TO_ERROR', round(time.monotonic() - t0, 2), flush=True)
    print('ERROR', exc, flush=True)
    updater.finalize()
    raise SystemExit(2)
updater.finalize()
print('NO ERROR', flush=True)
