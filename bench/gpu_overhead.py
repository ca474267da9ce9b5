"""One replica on one GPU: where ours loses time against StandardUpdater and a hand loop.

    python bench/gpu_overhead.py --out DIR [--ks 1,4] [--batch 256] [--seconds 2.5]
    python bench/gpu_overhead.py --out DIR --dry-run      # the same on '@numpy'
    python bench/gpu_overhead.py --out DIR --configs standard_1,ours_1   # only these

On a GPU the host only enqueues kernels; a loop that never reads a result on the host
runs ahead of the device, and one read per update (``float(loss)``) makes the host wait
for the device every update. This bench measures, in one process, rounds interleaved,
samples/s of the example's MNIST CNN with the global batch ``--batch`` split into k
micro-batches of batch/k:

- ``standard``: Chainer's StandardUpdater (k = 1);
- ``hand_k``: the hand-written accumulation loop (``bench._case``'s, as bench/paired.py);
- ``hand_k_read``: the same plus one host read of the update's loss (what one sync per
  update costs by itself);
- ``ours_k``: ours with defaults (``nonfinite='raise'``, which one GPU checks one step
  late, reading nothing before the step), ``ours_k_prefetch0`` with ``prefetch=0``,
  ``ours_k_ignore`` with ``nonfinite='ignore'`` (no check at all) and, at k = 1,
  ``ours_1_skip`` with ``nonfinite='skip'`` (the loss read before the step, once per
  update).

Every method reads the same kind of iterator, ``SerialIterator(dataset, batch/k,
shuffle=True)``, as a script that changes only its updater line does (up to
``gpu_overhead/1`` ours read ``shard_iterators(dataset, n=1, ...)``, whose shard adds
its own lookup per sample: 5-7% of loading a batch of 256 on a CPU, 11% before
``2644bcd``, charged to the updater here). Every update runs inside a reporter scope, as
under a Trainer. Each config warms up for 10 updates, and ours until ``prefetch='auto'``
has decided (at most 300): the defaults are timed as they train, not during their trial
(``warmup`` in the JSON: the updates and the loading modes). Then it profiles
(cProfile, host time; on Python 3.12 every thread) the configs of ``--profile``, 300
updates each (``--profile-updates``), and writes their top functions.
Writes gpu_overhead.json, gpu_overhead.md and profile_*.txt into ``--out`` (with
``--profile-in-json``, each profile's text goes into the JSON's ``profiles`` instead: fewer
files).
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402  (imports Chainer through the shim)
from bench._case import _hand_step  # noqa: E402

import chainer  # noqa: E402

SCHEMA = 'mgpu_updater.bench.gpu_overhead/2'   # /2: ours reads a SerialIterator too
MAX_WARMUP = 300   # warm-up updates at most, waiting for prefetch='auto' to decide


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', required=True)
    p.add_argument('--ks', default='1,4')
    p.add_argument('--batch', type=int, default=256, help='global batch (default 256)')
    p.add_argument('--seconds', type=float, default=2.5, help='timed seconds per run')
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--budget', type=float, default=240.0, help='stop starting runs after')
    p.add_argument('--profile', default='hand_1_read,ours_1_prefetch0,ours_1',
                   help='configs to profile (comma-separated; empty: none)')
    p.add_argument('--profile-updates', type=int, default=300)
    p.add_argument('--profile-in-json', action='store_true',
                   help="each profile's text in the JSON's 'profiles', not a file of its own")
    p.add_argument('--configs', default='',
                   help='time only these configs, in this order (comma-separated; empty: '
                        'every config of --ks)')
    p.add_argument('--dry-run', action='store_true', help="run on '@numpy'")
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(',') if k]
    args.configs = [c for c in args.configs.split(',') if c]
    known = all_configs(args.ks)
    unknown = [c for c in args.configs + [c for c in args.profile.split(',') if c]
               if c not in known]
    if unknown:
        p.error(f'--configs/--profile: unknown config(s) {", ".join(unknown)} for --ks '
                f'{",".join(map(str, args.ks))}; known: {", ".join(known)}')
    return args


def all_configs(ks):
    """Every config of the k values ``ks``, in the order they are timed."""
    configs = ['standard_1']
    for k in ks:
        configs += [f'hand_{k}', f'hand_{k}_read', f'ours_{k}', f'ours_{k}_prefetch0',
                    f'ours_{k}_ignore'] + ([f'ours_{k}_skip'] if k == 1 else [])
    return configs


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = 'cpu' if args.dry_run else 'gpu'
    device = _common.device_spec(kind, 0)
    dataset = _common.make_dataset(max(args.batch * 16, 4096), seed=0)
    start = time.monotonic()

    def sync():
        _common.synchronize(kind)

    def build(config):
        """(step, finalize, loading modes) for ``config``."""
        modes = list   # not ours: nothing to settle
        name, k = config.split('_')[0], int(config.split('_')[1])
        b = args.batch // k
        model = _common.make_model('cnn')
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        reporter.add_observers('main', model.namedlinks(skipself=True))
        it = chainer.iterators.SerialIterator(dataset, b, shuffle=True)   # every method's
        if name == 'standard':
            model.to_device(device)
            optimizer = _common.make_optimizer(model)
            updater = chainer.training.updaters.StandardUpdater(it, optimizer, device=device)
            run, fin = updater.update, updater.finalize
        elif name == 'hand':
            model.to_device(device)
            optimizer = _common.make_optimizer(model)
            run, fin = _hand_step(model, optimizer, it, k, device), (lambda: None)
            if config.endswith('_read'):
                inner = run

                def run():
                    inner()
                    float(model.loss.array)   # one host read of the last loss
        else:
            from mgpu_updater import ParallelAccumulatingUpdater
            optimizer = _common.make_optimizer(model)
            kwargs = {'prefetch': 0} if config.endswith('_prefetch0') else {}
            if config.endswith('_ignore'):
                kwargs['nonfinite'] = 'ignore'
            elif config.endswith('_skip'):
                kwargs['nonfinite'] = 'skip'
            updater = ParallelAccumulatingUpdater(it, optimizer, devices=[device],
                                                  accumulate_steps=k, **kwargs)
            run, fin = updater.update, updater.finalize
            modes = lambda: updater.loading_modes   # noqa: E731

        def step():
            with reporter.scope({}):
                run()
        return step, fin, modes

    configs = args.configs or all_configs(args.ks)
    runs, errors = [], []
    warmup = {}   # label -> warm-up updates and the loading modes after them

    def warmed(label, config, work):
        """Build ``config``, warm it up, then ``work(step)``; a failure becomes a line in
        ``errors`` under ``label``; the updater is finalized either way."""
        fin = None
        try:
            step, fin, modes = build(config)
            # past prefetch='auto''s trial (about 125 windows): the defaults are timed as
            # they train, not while they try both ways of loading
            warm = 0
            while warm < 10 or ('trial' in modes() and warm < MAX_WARMUP):
                step()
                warm += 1
            sync()
            warmup[label] = {'updates': warm, 'loading_modes': list(modes())}
            work(step)
        except Exception as e:
            errors.append(f'{label}: {type(e).__name__}: {e}')
            traceback.print_exc()
        finally:
            if fin is not None:
                fin()

    for round_ in range(1, args.rounds + 1):
        for config in configs:
            if time.monotonic() - start > args.budget:
                errors.append(f'{config} round {round_}: skipped, out of time')
                continue

            def timed(step, config=config, round_=round_):
                t0, count = time.perf_counter(), 0
                while True:
                    step()
                    count += 1
                    if count % 5 == 0 and time.perf_counter() - t0 >= args.seconds:
                        break
                sync()
                elapsed = time.perf_counter() - t0
                runs.append({'config': config, 'round': round_, 'updates': count,
                             'ms_per_update': 1e3 * elapsed / count,
                             'samples_per_s': count * args.batch / elapsed})
                print(json.dumps(runs[-1]), flush=True)
            warmed(f'{config} round {round_}', config, timed)

    profiles = {}
    for config in [c for c in args.profile.split(',') if c]:
        def profiled(step, config=config):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile_updates):
                step()
            sync()
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text).strip_dirs()
            stats.sort_stats('tottime').print_stats(40)
            stats.sort_stats('cumulative').print_stats(90)
            if args.profile_in_json:
                profiles[config] = text.getvalue()
            else:
                (out / f'profile_{config}.txt').write_text(text.getvalue())
                profiles[config] = f'profile_{config}.txt'
        warmed(f'profile {config}', config, profiled)

    summary = {}
    for config in configs:
        rates = [r['samples_per_s'] for r in runs if r['config'] == config]
        if rates:
            summary[config] = {'median_samples_per_s': statistics.median(rates),
                               'min': min(rates), 'max': max(rates), 'runs': len(rates)}
    base = summary.get('standard_1', {}).get('median_samples_per_s')
    result = {'schema': SCHEMA, 'device': device, 'global_batch': args.batch,
              'ks': args.ks, 'seconds': args.seconds, 'rounds': args.rounds,
              'model': _common.model_source('cnn'), 'chainer': chainer.__version__,
              'runs': runs, 'summary': summary, 'profiles': profiles, 'warmup': warmup,
              'errors': errors}
    (out / 'gpu_overhead.json').write_text(json.dumps(result, indent=1))
    lines = [f'# One replica on {device}: global batch {args.batch}, samples/s (median of '
             f'{args.rounds} interleaved rounds, min-max)', '',
             '| config | samples/s | min-max | / standard | / hand loop, same k |',
             '|---|---|---|---|---|']
    for config, s in summary.items():
        ratio = f"{s['median_samples_per_s'] / base:.3f}" if base else ''
        hand = summary.get('hand_' + config.split('_')[1], {}).get('median_samples_per_s')
        to_hand = (f"{s['median_samples_per_s'] / hand:.3f}"
                   if hand and config.startswith('ours_') else '')
        lines.append(f"| {config} | {s['median_samples_per_s']:.0f} | "
                     f"{s['min']:.0f}-{s['max']:.0f} | {ratio} | {to_hand} |")
    if errors:
        lines += ['', 'Errors:', ''] + [f'- {e}' for e in errors]
    (out / 'gpu_overhead.md').write_text('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
