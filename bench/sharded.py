"""Two CPU replicas, paired: the sharded optimizer step against the master's, in one process.

    python bench/sharded.py [--ks 1,4,8] [--pairs 60] [--model cnn] [--out DIR]

Two updaters on the same model and data, one with ``shard_optimizer=True`` (the default:
every replica sums and steps its slice, ``mgpu_updater._local.sharded_step``), one with
``shard_optimizer=False`` (the master sums and steps everything while the worker waits),
alternate update by update in one process (every other pair in the other order), so that
the machine's drift weighs on both alike; only one of them computes at a time (the other's
worker waits on its pipe). Each pair gives ratio = sharded time / master-step time (below
1: sharded is faster). Both use 2 ``'@numpy'`` replicas, micro-batches of b,
``accumulate_steps=k``, the bench's MomentumSGD. Prints a Markdown table; with ``--out``
writes ``sharded.json`` and ``sharded.md`` there.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402  (imports Chainer through the shim)
from bench._case import _observed_step, _our_updater  # noqa: E402

SCHEMA = 'mgpu_updater.bench.sharded/1'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--ks', default='1,4,8', help='accumulate_steps values (default 1,4,8)')
    p.add_argument('--pairs', type=int, default=60, help='timed pairs per k (default 60)')
    p.add_argument('--warmup', type=int, default=5, help='untimed pairs first (default 5)')
    p.add_argument('--model', default='cnn', choices=_common.MODELS)
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--out', help='folder for sharded.json and sharded.md')
    args = p.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.ks.split(',')]
    except ValueError:
        p.error(f'--ks must be comma-separated integers ({args.ks!r} given)')
    if min(args.ks) < 1 or args.pairs < 2 or args.warmup < 1 or args.micro_batch < 1:
        p.error('--ks values, --warmup and --micro-batch must be >= 1, --pairs >= 2')
    return args


def run_k(args, k):
    dataset = _common.make_dataset(_common.dataset_size(2 * k * args.micro_batch))
    runs = {}
    try:
        for shard in (True, False):
            model = _common.make_model(args.model)
            updater = _our_updater(model, dataset, 'cpu', 2, args.micro_batch,
                                   accumulate_steps=k, shard_optimizer=shard)
            runs[shard] = (updater, _observed_step(updater, model))
        times = {True: [], False: []}
        sharded_updates = 0
        for i in range(args.warmup + args.pairs):
            for shard in ((True, False) if i % 2 else (False, True)):
                start = time.perf_counter()
                runs[shard][1]()
                elapsed = time.perf_counter() - start
                if i >= args.warmup:
                    times[shard].append(elapsed)
            shards = runs[True][0]._group.shards
            sharded_updates += shards is not None and shards.reason is None
        if sharded_updates != args.warmup + args.pairs:
            raise RuntimeError(f'only {sharded_updates} updates were sharded: '
                               f'{runs[True][0]._group.shards.reason}')
    finally:
        for updater, _ in runs.values():
            updater.finalize()
    ratios = [a / b for a, b in zip(times[True], times[False])]
    q = statistics.quantiles(ratios)
    return {'k': k, 'pairs': args.pairs,
            'sharded_ms': round(1e3 * statistics.median(times[True]), 2),
            'master_ms': round(1e3 * statistics.median(times[False]), 2),
            'ratio_median': round(statistics.median(ratios), 4),
            'ratio_q1': round(q[0], 4), 'ratio_q3': round(q[2], 4),
            'saved_ms_median': round(1e3 * statistics.median(
                [b - a for a, b in zip(times[True], times[False])]), 3)}


def markdown(result):
    lines = ['# Sharded step against the master\'s step: 2 CPU replicas, paired', '',
             '`python bench/sharded.py`', '',
             'Model `{model}`, micro-batch {micro_batch} per replica; the two updaters '
             'alternate update by update in one process.'.format(**result['config']), '',
             '- Machine: {cpu} ({cores} usable cores); load average {load_start} at start, '
             '{load_end} at the end'.format(**result['machine']), '',
             '| k | pairs | sharded, ms/update | master step, ms/update | sharded / master '
             '(median) | quartiles | saved per update (median of pairs), ms |',
             '|---:|---:|---:|---:|---:|---|---:|']
    for r in result['rows']:
        lines.append('| {k} | {pairs} | {sharded_ms} | {master_ms} | {ratio_median} | '
                     '{ratio_q1}-{ratio_q3} | {saved_ms_median} |'.format(**r))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    load_start = _common.loadavg()
    rows = [run_k(args, k) for k in args.ks]
    result = {'schema': SCHEMA,
              'config': {'model': args.model, 'micro_batch': args.micro_batch,
                         'ks': args.ks, 'pairs': args.pairs, 'warmup': args.warmup},
              'machine': {'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
                          'load_start': load_start, 'load_end': _common.loadavg()},
              'rows': rows}
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / 'sharded.json').write_text(json.dumps(result, indent=1) + '\n')
        (out / 'sharded.md').write_text(text)
    return result


if __name__ == '__main__':
    main()
