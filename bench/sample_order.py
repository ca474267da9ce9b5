"""What the sample order alone does to an update's time: StandardUpdater against itself.

    python bench/sample_order.py [--rounds N] [--model cnn] [--out DIR]

Five ``StandardUpdater`` runs in one process over the same synthetic dataset, every model
starting from the same weights, the updates alternating (the order rotating each round, as
``paired.py`` does): two with the iterator shuffling with seed 0 (the same work twice: the
control), two with seeds 1 and 2, and one reading the one shard ``shard_iterators(dataset,
n=1)`` gives (seed 0). Each ratio is a run's time over seed 0's in the same round, its
median with a 95% bootstrap interval. Only what the updates compute on differs, so a ratio
away from 1 is the data's doing: why ``paired.py`` and ``paired_replicas.py`` give every
method the same samples in the same order. Prints a Markdown table; with ``--out`` writes
``sample_order.json`` and ``sample_order.md`` there.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402  (imports Chainer through the shim)
from bench._case import _observed_step  # noqa: E402

import chainer  # noqa: E402
import numpy  # noqa: E402

from mgpu_updater import shard_iterators  # noqa: E402

SCHEMA = 'mgpu_updater.bench.sample_order/1'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=400, help='timed rounds (default 400)')
    p.add_argument('--warmup', type=int, default=5, help='untimed rounds first (default 5)')
    p.add_argument('--model', default='cnn', choices=_common.MODELS)
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--out', help='folder for sample_order.json and sample_order.md')
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        p.error('--rounds and --warmup must be >= 1')
    return args


def iterators(dataset, b):
    """name -> the iterator that run reads; 'seed 0' is the baseline."""
    def seeded(seed):
        return chainer.iterators.SerialIterator(
            dataset, b, order_sampler=chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState(seed)))
    return {'seed 0': seeded(0), 'seed 0 again': seeded(0), 'seed 1': seeded(1),
            'seed 2': seeded(2),
            'shard_iterators, n=1': shard_iterators(
                dataset, n=1, batch_size=b, iterator_class=chainer.iterators.SerialIterator,
                seed=0, shuffle=True)[0]}


def measure(args):
    dataset = _common.make_dataset(_common.dataset_size(args.micro_batch))
    runs = {}
    for name, iterator in iterators(dataset, args.micro_batch).items():
        model = _common.make_model(args.model)
        updater = chainer.training.updaters.StandardUpdater(
            iterator, _common.make_optimizer(model), device='@numpy')
        runs[name] = _observed_step(updater, model)
    names = list(runs)
    times = {name: [] for name in names}
    for i in range(args.warmup + args.rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    rows = []
    for name in names[1:]:
        s = _common.ratio_summary([a / b for a, b in zip(times[name], times['seed 0'])])
        rows.append({'run': name, 'ms': 1e3 * statistics.median(times[name]),
                     'ratio_median': s['median'], 'ratio_ci95': s['ci95'],
                     'ratio_q1': s['q1'], 'ratio_q3': s['q3']})
    return 1e3 * statistics.median(times['seed 0']), rows


def markdown(result):
    lines = ['# The sample order alone: StandardUpdater against itself', '',
             '`{}`'.format(result['command']), '',
             'Model `{}`, batch {}, one process, the runs alternating update by update; '
             'ratio = the run\'s time / seed 0\'s in the same round, its median with a 95% '
             'bootstrap interval. Seed 0: {:.1f} ms per update. Machine: {}.'.format(
                 result['model'], result['micro_batch'], result['seed0_ms'],
                 result['machine']['cpu']), '',
             '| run | ms/update | ratio to seed 0 | 95% interval | quartiles |',
             '|---|---:|---:|---:|---:|']
    for r in result['rows']:
        lines.append('| {} | {:.1f} | {:.3f} | {:.3f}-{:.3f} | {:.3f}-{:.3f} |'.format(
            r['run'], r['ms'], r['ratio_median'], r['ratio_ci95'][0], r['ratio_ci95'][1],
            r['ratio_q1'], r['ratio_q3']))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    seed0_ms, rows = measure(args)
    result = {
        'schema': SCHEMA,
        'command': 'python bench/sample_order.py ' + ' '.join(
            sys.argv[1:] if argv is None else argv),
        'model': args.model, 'micro_batch': args.micro_batch,
        'machine': {'cpu': _common.cpu_model(), 'loadavg': _common.loadavg()},
        'versions': _common.versions(), 'seed0_ms': seed0_ms, 'rows': rows,
    }
    _common.save_results(args.out, 'sample_order', result, markdown(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
