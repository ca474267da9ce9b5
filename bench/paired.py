"""One replica, paired: ours against the hand-written accumulation loop in one process.

    python bench/paired.py [--ks 1,4,8] [--pairs 20] [--model cnn] [--out DIR]

On a machine whose speed drifts (a VM: the same code read 443 and 546 samples/s in two
fresh processes of one ``scaling.py`` run), separate runs cannot resolve a few percent.
Here both run in one process, alternating update by update (every other pair in the other
order), so the drift weighs on both alike; each pair gives ratio = ours' time / the loop's
time (above 1: ours is slower). Ours runs on one CPU replica (``'@numpy'``) with
``accumulate_steps=k`` and micro-batches of b; the loop is ``bench._case``'s (k
micro-batches of b, one optimizer step). Both models and optimizers start equal.

Ours sets the process's malloc thresholds at its first update (``reuse_host_memory``), which
the warm-up includes, so every timed update of both runs under the same malloc. Prints a
Markdown table; with ``--out`` writes ``paired.json`` and ``paired.md`` there.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402  (imports Chainer through the shim)
from bench._case import _hand_step, _observed_step, _our_updater  # noqa: E402

import chainer  # noqa: E402

SCHEMA = 'mgpu_updater.bench.paired/1'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--ks', default='1,4,8', help='accumulate_steps values (default 1,4,8)')
    p.add_argument('--pairs', type=int, default=20, help='timed pairs per k (default 20)')
    p.add_argument('--warmup', type=int, default=3, help='untimed pairs first (default 3)')
    p.add_argument('--model', default='cnn', choices=_common.MODELS)
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--out', help='folder for paired.json and paired.md')
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(',') if k]
    if args.pairs < 1 or args.warmup < 1 or not args.ks or min(args.ks) < 1:
        p.error('--pairs, --warmup and every k must be >= 1')
    return args


def quartiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def measure(k, args):
    """Timed pairs at ``k``: the loop's and ours' seconds per update."""
    b = args.micro_batch
    dataset = _common.make_dataset(_common.dataset_size(k * b), seed=0)
    model = _common.make_model(args.model)
    optimizer = _common.make_optimizer(model)
    iterator = chainer.iterators.SerialIterator(dataset, b, shuffle=True)
    update = _hand_step(model, optimizer, iterator, k, '@numpy')
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)

    def hand():
        with reporter.scope({}):
            update()

    ours_model = _common.make_model(args.model)
    updater = _our_updater(ours_model, dataset, 'cpu', 1, b, accumulate_steps=k)
    ours = _observed_step(updater, ours_model)
    times = {'hand': [], 'ours': []}
    try:
        for i in range(args.warmup + args.pairs):
            order = (('hand', hand), ('ours', ours)) if i % 2 == 0 else (('ours', ours),
                                                                        ('hand', hand))
            for name, step in order:
                start = time.perf_counter()
                step()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
    finally:
        updater.finalize()
    ratios = [o / h for o, h in zip(times['ours'], times['hand'])]
    low, high = quartiles(ratios)
    return {'k': k, 'pairs': args.pairs, 'ratio_median': statistics.median(ratios),
            'ratio_q1': low, 'ratio_q3': high,
            'hand_ms': 1e3 * statistics.median(times['hand']),
            'ours_ms': 1e3 * statistics.median(times['ours']),
            'ratios': ratios}


def markdown(result):
    lines = ['# One replica, paired: ours / the hand-written loop', '',
             '`{}`'.format(result['command']), '',
             'Model `{}`, micro-batch {}, one process, updates alternating; ratio = ours\' '
             'time / the loop\'s time per pair (above 1: ours is slower). Machine: {}; '
             'load average {} at start.'.format(result['model'], result['micro_batch'],
                                                result['machine']['cpu'],
                                                result['machine']['loadavg_start']), '',
             '| k | pairs | loop ms/update | ours ms/update | ratio (median) | quartiles |',
             '|---:|---:|---:|---:|---:|---:|']
    for r in result['rows']:
        lines.append('| {k} | {pairs} | {hand_ms:.1f} | {ours_ms:.1f} | {ratio_median:.3f} | '
                     '{ratio_q1:.3f}-{ratio_q3:.3f} |'.format(**r))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    result = {
        'schema': SCHEMA,
        'command': 'python bench/paired.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
        'model': args.model, 'micro_batch': args.micro_batch,
        'machine': {'cpu': _common.cpu_model(), 'loadavg_start': _common.loadavg()},
        'versions': _common.versions(),
        'rows': [measure(k, args) for k in args.ks],
    }
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / 'paired.json').write_text(
            _common.without_local_paths(json.dumps(result, indent=1)) + '\n')
        (out / 'paired.md').write_text(_common.without_local_paths(text))
    return 0


if __name__ == '__main__':
    sys.exit(main())
