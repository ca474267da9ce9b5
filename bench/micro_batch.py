"""What a smaller ``micro_batch_size`` costs in speed and saves in memory.

    python bench/micro_batch.py [--quick | --smoke] [--out DIR]

For each model (the example's CNN and a wide MLP, 784-1000-1000-10) and each replica count
(1 and 2, on the CPU unless CuPy sees GPUs), ``ParallelAccumulatingUpdater`` trains with a
fixed global batch G (256) and ``micro_batch_size`` in None (whole loaded batch: G/N samples
per forward), 128, 64, 32, 16 and 8. Each case runs in a fresh process (the runner is
``run_micro_batch`` of ``bench/_case.py``, started and scheduled as ``bench/scaling.py``
does): a warm-up update, timed rounds of updates, then the peak memory of one more update.
The whole grid runs ``--passes`` times, every other pass in reverse order, so that a machine
whose speed drifts weighs on every case alike. Each case is given as ratios against the
whole-batch case of the same model and replica count: per pass (the same pass's baseline),
then the median over passes with the spread (min-max).

Peak memory on the CPU is tracemalloc's peak of one update: numpy reports every array
buffer it allocates to tracemalloc, so this counts exactly the bytes a micro-batch size
changes (activations, their gradients and temporaries, the parameters' gradients) and
nothing else, and it does not depend on what the process did before. The other candidate,
the growth of ru_maxrss in a fresh process, mixes in the interpreter, Chainer's import, the
dataset and glibc's choices of when to return freed memory (its trim and mmap thresholds
adapt to the sizes freed), so it moves by megabytes from run to run for reasons unrelated to
the micro-batch. tracemalloc sees the process that measures it: with 2 replicas that is the
master's replica, which holds the same share (G/2 samples) as the worker. On GPU the figure
is CuPy's memory pool instead (the bytes the pool needed for one update).

Writes ``micro_batch.md`` (the table, also printed), ``micro_batch.json`` and
``micro_batch.png`` to ``--out`` (default ``bench/results``).
"""
import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common, scaling  # noqa: E402  (imports Chainer through the shim)

HERE = Path(__file__).resolve().parent
SCHEMA = 'mgpu_updater.bench.micro_batch/1'
WHOLE = None  # micro_batch_size of the baseline: every loaded batch in one forward

PROFILES = {
    #           models          replicas sizes                          G   warm rounds upd passes
    'default': (('cnn', 'mlp'), (1, 2), (WHOLE, 128, 64, 32, 16, 8), 256, 1, 2, 2, 3),
    'quick': (('cnn', 'mlp'), (1, 2), (WHOLE, 64, 16), 256, 1, 2, 1, 1),
    'smoke': (('cnn',), (1,), (WHOLE, 4), 16, 1, 2, 1, 2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--models', help='comma-separated subset of ' + ','.join(_common.MODELS))
    p.add_argument('--devices', help='replica counts, comma-separated (default 1,2)')
    p.add_argument('--sizes', help="micro_batch_size values, comma-separated; 'none' is the "
                                   'whole batch, always added (default none,128,64,32,16,8)')
    p.add_argument('--global-batch', type=int, help='samples per update (default 256)')
    p.add_argument('--out', default=str(HERE / 'results'), help='output folder')
    mode = p.add_mutually_exclusive_group()
    mode.add_argument('--quick', action='store_true', help='fewer sizes, one pass (~3 min)')
    mode.add_argument('--smoke', action='store_true', help='CNN, G=16, 1 replica (tests)')
    p.add_argument('--warmup', type=int, help='warm-up updates per case')
    p.add_argument('--rounds', type=int, help='timed rounds per case and pass')
    p.add_argument('--updates', type=int, help='updates per timed round')
    p.add_argument('--passes', type=int, help='times the grid runs (alternate ones reversed)')
    p.add_argument('--case-timeout', type=float, default=600,
                   help='seconds allowed for one case (one process)')
    args = p.parse_args(argv)
    profile = 'smoke' if args.smoke else 'quick' if args.quick else 'default'
    models, ns, sizes, global_batch, warmup, rounds, updates, passes = PROFILES[profile]
    args.profile = profile
    args.models = args.models.split(',') if args.models else list(models)
    unknown = set(args.models) - set(_common.MODELS)
    if unknown:
        p.error('unknown models: {}'.format(', '.join(sorted(unknown))))
    args.devices = scaling._int_list(args.devices) if args.devices else list(ns)
    args.sizes = _sizes(args.sizes) if args.sizes else list(sizes)
    args.global_batch = args.global_batch or global_batch
    bad = [n for n in args.devices if n < 1 or args.global_batch % n]
    if bad:
        p.error('--global-batch {} must split evenly over every replica count ({} given)'
                .format(args.global_batch, ','.join(map(str, args.devices))))
    args.warmup = warmup if args.warmup is None else args.warmup
    args.rounds = args.rounds or rounds
    args.updates = args.updates or updates
    args.passes = args.passes or passes
    return args


def _sizes(text):
    """'none,64,8' -> [None, 64, 8]; the whole batch first, always there (the baseline)."""
    sizes = [None if v.strip().lower() == 'none' else int(v) for v in text.split(',')
             if v.strip()]
    return [WHOLE] + [m for m in sizes if m is not WHOLE]


def build_groups(args, kind, cores):
    """One group (one fresh process) per (model, replicas, micro_batch_size); each replica
    gets cores // N BLAS threads on the CPU, as in the scaling benchmark."""
    groups = []
    for model in args.models:
        for n in args.devices:
            env = (_common.thread_env(_common.threads_per_process(n, cores))
                   if kind == 'cpu' else {})
            for m in args.sizes:
                groups.append({
                    'label': '{} N={} micro_batch_size={}'.format(model, n, m), 'env': env,
                    'processes': n, 'n': n,
                    'cases': [{'method': 'micro_batch', 'n': n, 'k': 1, 'model': model,
                               'micro_batch_size': m}]})
    return groups


def _key(record):
    return record['model'], record['n'], record['micro_batch_size']


def _spread(values):
    s = _common.summarize(values)
    return {'median': s['median'], 'min': s['min'], 'max': s['max']}


def summarize(records, global_batch):
    """One row per (model, replicas, micro_batch_size) from every pass's records.

    Ratios are taken within a pass, against that pass's whole-batch case of the same model
    and replica count (each case's samples/s in a pass is the median of its rounds); the
    row gives the median ratio over passes and its min-max.
    """
    by_pass = {(_key(r), r['pass']): r for r in records}
    rows = []
    for key in sorted({_key(r) for r in records},
                      key=lambda k: (k[0], k[1], -(k[2] or global_batch + 1))):
        model, n, m = key
        mine = sorted((r for r in records if _key(r) == key), key=lambda r: r['pass'])
        speed, memory, activation = [], [], []
        for r in mine:
            base = by_pass.get(((model, n, WHOLE), r['pass']))
            if base is None:
                continue
            speed.append(statistics.median(r['samples_per_s'])
                         / statistics.median(base['samples_per_s']))
            memory.append(r['peak_bytes'] / base['peak_bytes'])
            grads = r['gradient_bytes']
            activation.append((r['peak_bytes'] - grads) / (base['peak_bytes'] - grads))
        rounds = [v for r in mine for v in r['samples_per_s']]
        peaks = [r['peak_bytes'] for r in mine]
        per_forward = global_batch // n if m is None else min(m, global_batch // n)
        rows.append({
            'model': model, 'n': n, 'micro_batch_size': m, 'global_batch': global_batch,
            'samples_per_forward': per_forward,
            'chunks_per_replica': -(-(global_batch // n) // per_forward),
            'samples_per_s': _spread(rounds), 'rounds': rounds, 'passes': len(mine),
            'peak_bytes': _spread(peaks), 'gradient_bytes': mine[0]['gradient_bytes'],
            'speed_ratio': _spread(speed) if speed else None,
            'peak_ratio': _spread(memory) if memory else None,
            'activation_ratio': _spread(activation) if activation else None,
            'speed_ratio_per_pass': speed,
        })
    return rows


def _ratio(spread):
    if spread is None:
        return '-'
    return '{:.2f} ({:.2f}-{:.2f})'.format(spread['median'], spread['min'], spread['max'])


def _mib(n_bytes):
    return '{:.1f}'.format(n_bytes / 2 ** 20)


def table(rows):
    lines = ['| model | replicas | micro_batch_size | samples per forward | samples/s (min-max) '
             '| speed vs whole (min-max) | peak MiB | peak vs whole (min-max) '
             '| without gradients vs whole |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        s = r['samples_per_s']
        lines.append('| {} | {} | {} | {} | {:.0f} ({:.0f}-{:.0f}) | {} | {} | {} | {} |'.format(
            r['model'], r['n'], 'None (whole)' if r['micro_batch_size'] is None
            else r['micro_batch_size'], r['samples_per_forward'], s['median'], s['min'],
            s['max'], _ratio(r['speed_ratio']), _mib(r['peak_bytes']['median']),
            _ratio(r['peak_ratio']), _ratio(r['activation_ratio'])))
    return '\n'.join(lines)


def markdown(result, out_dir):
    cfg, machine, ver = result['config'], result['machine'], result['versions']
    parts = [
        '# Micro-batch benchmark',
        '',
        '`{}`'.format(cfg['command']),
        '',
        'ParallelAccumulatingUpdater on {} with a global batch of {} ({} loaded per replica '
        'and update), each loaded batch run as chunks of at most `micro_batch_size` samples. '
        '{} pass(es) over the grid, every other one reversed, each case a fresh process: {} '
        'warm-up update(s), {} round(s) of {} update(s), then one update whose peak memory is '
        'measured ({}). Ratios are against the whole-batch case of the same model and replica '
        'count in the same pass; the median over passes is shown with its min-max.'.format(
            cfg['device_kind'].upper(), cfg['global_batch'],
            ', '.join('{} with N={}'.format(cfg['global_batch'] // n, n)
                      for n in cfg['devices']),
            cfg['passes'], cfg['warmup'], cfg['rounds'], cfg['updates_per_round'],
            cfg['measured_with']),
        '',
        '- Models: ' + '; '.join('`{}` = {}'.format(m, _common.model_source(m))
                                 for m in cfg['models']),
        '- Machine: {} ({} usable cores), {}; 1-minute load average {} at the start, {} at '
        'the end'.format(machine['cpu_model'], machine['cores_usable'], machine['platform'],
                         machine.get('loadavg_start'), machine.get('loadavg_end')),
        '- Versions: Python {}, numpy {}, Chainer {}, BLAS {} {}'.format(
            ver['python'], ver['numpy'], ver['chainer'], ver['blas'].get('name'),
            ver['blas'].get('version', '')).rstrip(),
        '',
        table(result['rows']),
        '',
        'Peak: the bytes allocated during one update on top of what was live before it; with '
        '2 replicas, those of the master\'s replica (the worker holds the same share). '
        '"Without gradients" subtracts the parameters\' gradient buffers (the same for every '
        'size), leaving activations and temporaries.',
    ]
    controls = [r for r in result['rows'] if r['micro_batch_size'] is not WHOLE
                and r['chunks_per_replica'] == 1 and r['speed_ratio']]
    if controls:
        many = len(controls) > 1
        parts += ['', 'Noise floor: {} {} the very same work as the whole batch (one chunk '
                  'per loaded batch), so {} speed ratio shows what this run cannot resolve: '
                  '{}.'.format(', '.join('{} N={} micro_batch_size={}'.format(
                      r['model'], r['n'], r['micro_batch_size']) for r in controls),
                      'run' if many else 'runs', 'their' if many else 'its',
                      ', '.join(_ratio(r['speed_ratio']) for r in controls))]
    if (Path(out_dir) / 'micro_batch.png').exists():
        parts += ['', '![speed and memory against the micro-batch size](micro_batch.png)']
    notes = list(result['notes'])
    notes += ['{} N={} micro_batch_size={}: failed, see micro_batch.json'.format(
        e.get('model'), e.get('n'), e.get('micro_batch_size')) for e in result['errors']]
    if notes:
        parts += ['', '## Notes', ''] + ['- ' + n for n in notes]
    return '\n'.join(parts) + '\n'


def plot(result, path):
    """Speed and peak memory (as ratios to the whole batch) against the samples per forward,
    one line per model and replica count. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # a size that splits nothing (micro_batch_size >= the loaded batch) is the whole batch
    # again at the same x: the Markdown gives it as the noise floor
    rows = [r for r in result['rows'] if r['speed_ratio'] is not None
            and (r['micro_batch_size'] is WHOLE or r['chunks_per_replica'] > 1)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (('speed_ratio', 'samples/s vs whole batch'),
              ('peak_ratio', 'peak memory of one update vs whole batch'))
    for ax, (field, title) in zip(axes, panels):
        for model, n in sorted({(r['model'], r['n']) for r in rows}):
            pts = sorted((r for r in rows if (r['model'], r['n']) == (model, n)),
                         key=lambda r: r['samples_per_forward'])
            xs = [r['samples_per_forward'] for r in pts]
            ys = [r[field]['median'] for r in pts]
            err = [[y - r[field]['min'] for y, r in zip(ys, pts)],
                   [r[field]['max'] - y for y, r in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker='o', capsize=3,
                        label='{} N={}'.format(model, n))
        ax.set_xscale('log', base=2)
        ticks = sorted({r['samples_per_forward'] for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel('samples per forward (micro_batch_size or the whole loaded batch)')
        ax.set_title(title, fontsize=10)
        ax.axhline(1.0, color='grey', lw=0.8)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle('global batch {} on {} ({})'.format(
        result['config']['global_batch'], result['config']['device_kind'].upper(),
        result['machine']['cpu_model']), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    args = parse_args(argv)
    cores = _common.cpu_count()
    kind = 'gpu' if _common.gpu_count() else 'cpu'
    common = {'global_batch': args.global_batch, 'device_kind': kind,
              'warmup': args.warmup, 'rounds': args.rounds, 'updates': args.updates,
              'dataset_size': _common.dataset_size(args.global_batch)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = _common.machine_info()
    start = time.perf_counter()
    order = scaling.schedule(build_groups(args, kind, cores), args.passes)
    with tempfile.TemporaryDirectory(prefix='mgpu-bench-') as workdir:
        records, errors = scaling.run_groups(args, order, common, workdir)
    machine['loadavg_end'] = _common.loadavg()
    rows = summarize(records, args.global_batch)
    notes = []
    spreads = [(r['speed_ratio']['max'] - r['speed_ratio']['min']) for r in rows
               if r['speed_ratio'] and r['micro_batch_size'] is not WHOLE]
    if spreads:
        notes.append('Spread of the speed ratio over the passes (max - min): {:.2f} for the '
                     'median row, {:.2f} at worst; speed differences smaller than that are '
                     'not resolved by this run. Peak memory does not depend on the machine\'s '
                     'load: its spread is that of the allocations themselves.'
                     .format(statistics.median(spreads), max(spreads)))
    if (machine['loadavg_start'] or 0) > 0.5 * cores:
        notes.append('The machine was shared (1-minute load average {} at the start, {} at the '
                     'end, on {} cores): other work slows every case and widens the spread.'
                     .format(machine['loadavg_start'], machine['loadavg_end'], cores))
    command = ' '.join(['python', 'bench/micro_batch.py'] + [
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    result = {
        'schema': SCHEMA,
        'config': {
            'command': command, 'profile': args.profile, 'models': args.models,
            'model_sources': {m: _common.model_source(m) for m in args.models},
            'devices': args.devices, 'micro_batch_sizes': args.sizes,
            'global_batch': args.global_batch, 'device_kind': kind, 'warmup': args.warmup,
            'rounds': args.rounds, 'updates_per_round': args.updates, 'passes': args.passes,
            'dataset_size': common['dataset_size'],
            'measured_with': 'tracemalloc' if kind == 'cpu' else 'cupy memory pool',
            'blas_threads_per_replica': {str(n): _common.threads_per_process(n, cores)
                                         for n in args.devices} if kind == 'cpu' else 'default',
        },
        'machine': machine,
        'versions': _common.versions(),
        'rows': rows,
        'errors': errors,
        'notes': notes,
        'wall_s': time.perf_counter() - start,
    }
    _common.write_results(out_dir, 'micro_batch', result,
                          lambda r: markdown(r, out_dir), plot)
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
