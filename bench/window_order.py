"""One replica, in one process: what the order inside ours' window costs, against
``StandardUpdater``.

    python bench/window_order.py [--rounds 300] [--model cnn] [--out DIR]

Four methods alternate update by update (the order rotating each round), every one
reading the same samples in the same order (``bench.paired._iterator``), k=1, micro-batch
32:

- ``StandardUpdater``, the baseline: Chainer's ``Optimizer.update`` runs the forward, then
  ``cleargrads()``, then the backward (chainer/optimizer.py:874-876);
- ours as it comes (``ParallelAccumulatingUpdater(it, opt, devices=['@numpy'])``): since
  this bench, its window clears the last update's gradients after its first forward too;
- ours with the gradients cleared *before* each forward (a ``loss_func`` that calls
  ``cleargrads()`` and then the model: the order ours had before);
- ours with ``prefetch=0`` (no loader thread loading the next batch during the forward).

Each row gives the method's time over ``StandardUpdater``'s in the same round, and its
forward passes' time over ``StandardUpdater``'s (``bench.paired._timed_forward``), medians
with 95% bootstrap intervals. Prints Markdown; with ``--out`` writes ``window_order.json``
and ``window_order.md`` there.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402  (imports Chainer through the shim)
from bench._case import _observed_step  # noqa: E402
from bench.paired import _iterator, _timed_forward  # noqa: E402

import chainer  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater  # noqa: E402

SCHEMA = 'mgpu_updater.bench.window_order/1'
METHODS = ('standard', 'ours', 'ours_cleared_before_forward', 'ours_prefetch_0')
LABELS = {'standard': 'StandardUpdater', 'ours': 'ours (as it comes)',
          'ours_cleared_before_forward': 'ours, gradients cleared before the forward',
          'ours_prefetch_0': 'ours, prefetch=0'}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=300, help='timed rounds (default 300)')
    p.add_argument('--warmup', type=int, default=5, help='untimed rounds first (default 5)')
    p.add_argument('--model', default='cnn', choices=_common.MODELS)
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--out', help='folder for window_order.json and window_order.md')
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        p.error('--rounds and --warmup must be >= 1')
    return args


def _cleared_first(model):
    """A loss_func that clears the model's gradients before every forward."""
    def loss_func(*args):
        model.cleargrads()
        return model(*args)
    return loss_func


def measure(args):
    b = args.micro_batch
    dataset = _common.make_dataset(_common.dataset_size(b), seed=0)
    steps, models, updaters = {}, {}, []
    forward_seconds = {name: [0.0] for name in METHODS}
    for name in METHODS:
        model = models[name] = _common.make_model(args.model)
        _timed_forward(model, forward_seconds[name])
        optimizer = _common.make_optimizer(model)
        if name == 'standard':
            updater = chainer.training.updaters.StandardUpdater(
                _iterator(dataset, b), optimizer, device='@numpy')
        else:
            kwargs = {'ours_cleared_before_forward': {'loss_func': _cleared_first(model)},
                      'ours_prefetch_0': {'prefetch': 0}}.get(name, {})
            updater = ParallelAccumulatingUpdater(_iterator(dataset, b), optimizer,
                                                  devices=['@numpy'], **kwargs)
            updaters.append(updater)
        steps[name] = _observed_step(updater, model)
    times = {name: [] for name in METHODS}
    forwards = {name: [] for name in METHODS}
    order = list(METHODS)
    try:
        for i in range(args.warmup + args.rounds):
            shift = i % len(order)   # each method first and last in turn
            for name in order[shift:] + order[:shift]:
                forward_seconds[name][0] = 0.0
                start = time.perf_counter()
                steps[name]()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                    forwards[name].append(forward_seconds[name][0])
    finally:
        for updater in updaters:
            updater.finalize()
    reference = dict(models['standard'].namedparams())
    rows = []
    for name in METHODS:
        rows.append({
            'method': name, 'ms': 1e3 * statistics.median(times[name]),
            'forward_ms': 1e3 * statistics.median(forwards[name]),
            'ratio': _common.ratio_summary(
                [a / s for a, s in zip(times[name], times['standard'])]),
            'forward_ratio': _common.ratio_summary(
                [a / s for a, s in zip(forwards[name], forwards['standard'])]),
            # the same work: every method ends with StandardUpdater's weights, bitwise
            'weights_max_abs_diff': max(
                float(abs(p.array - reference[n].array).max())
                for n, p in models[name].namedparams())})
    return rows


def markdown(result):
    lines = ['# One replica: the order inside ours\' window, against StandardUpdater', '',
             '`{}`'.format(result['command']), '',
             'Model `{}`, micro-batch {}, k=1, one process, {} rounds, the methods '
             'alternating update by update (the order rotating), all on the same samples. '
             'Ratio: the method\'s time / StandardUpdater\'s in the same round, median '
             '(95% bootstrap interval). Machine: {}; load average {} at start, {} at the '
             'end.'.format(result['model'], result['micro_batch'], result['rounds'],
                           result['machine']['cpu'], result['machine']['loadavg_start'],
                           result['machine']['loadavg_end']), '',
             '| method | ms/update | update / StandardUpdater\'s | forward ms | forwards / '
             'StandardUpdater\'s | weights apart |',
             '|---|---:|---|---:|---|---:|']
    for r in result['rows']:
        lines.append('| {} | {:.2f} | {} | {:.2f} | {} | {:.2g} |'.format(
            LABELS[r['method']], r['ms'], _common.ratio_cell(r['ratio']), r['forward_ms'],
            _common.ratio_cell(r['forward_ratio']), r['weights_max_abs_diff']))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    result = {
        'schema': SCHEMA,
        'command': 'python bench/window_order.py ' + ' '.join(
            sys.argv[1:] if argv is None else argv),
        'model': args.model, 'micro_batch': args.micro_batch, 'rounds': args.rounds,
        'machine': {'cpu': _common.cpu_model(), 'loadavg_start': _common.loadavg()},
        'versions': _common.versions(),
    }
    result['rows'] = measure(args)
    result['machine']['loadavg_end'] = _common.loadavg()
    _common.save_results(args.out, 'window_order', result, markdown(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
