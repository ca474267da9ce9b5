"""This package against an earlier checkout of it, in one process: what a change costs.

    python bench/ab_overhead.py --baseline DIR [--ks 1,4] [--rounds 1500] [--out DIR]
    python bench/ab_overhead.py --baseline DIR --replicas 2 [--ks 1] [--rounds 100]

``DIR`` is a checkout of this repository, for instance one made with ``git worktree add
/tmp/before <commit>``. Its ``mgpu_updater`` is imported under another name, beside this
checkout's. Run-to-run drift on a VM is as large as most changes to the updater's own
code (``bench/overhead.py`` reads the same package 1-2% apart from one run to the next),
so a change is measured here against the code before it, both in one process, taking
turns.

The model and turns are ``bench/overhead.py``'s: a 64-64-10 MLP, batch 16, data in memory,
BLAS as the environment leaves it, where the host decides the speed. For each ``k`` (``accumulate_steps``)
there are three methods: the reference (``StandardUpdater`` at k=1, the hand-written loop
otherwise), the baseline's updater and this checkout's, one ``'@numpy'`` replica each.
They take turns of 3 updates (the first untimed), in an order shuffled each round. Per
round come this / the baseline and each / the reference; the table gives each ratio's
median with its 95% bootstrap interval.

With ``--replicas 2`` each updater has two ``'@numpy'`` replicas, each with the
reference's batch, so that a change to the protocol between the master and its worker is
measured too (the workers import the baseline under its other name: this script, which
spawn imports again in each worker, imports it there first). Two replicas take turns of
``--block`` 60 updates, the first 10 untimed, as ``bench/overhead.py``'s warm row: a worker
in training is never idle for long. The two updaters' workers share a core, so a change to
how an idle worker waits is not measured fairly here: a worker that looked for its next
Step every millisecond for 0.1 s before blocking read 0.934 of the time in turns of 60,
and ``bench/overhead.py``, where no second worker computes beside it, read it the same
as blocking (1.42-1.45 against 1.32-1.50 in turns of 3, 1.231-1.234 against
1.243-1.258 warm): its looks slowed the baseline's worker during the baseline's turns.

Both updaters read the same batches; ``same_weights`` says whether they ended with
the same weights, bitwise. A change meant to keep the numbers must keep it True; where
it is False the two did different work, and the times compare that work too.

Writes ``ab_overhead.json`` and ``ab_overhead.md`` into ``--out`` (with two replicas,
``ab_overhead_2_replicas.json`` and ``.md``, so that one folder keeps both).
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chainer  # noqa: E402
import numpy  # noqa: E402

from bench import _common, overhead  # noqa: E402

SCHEMA = 'mgpu_updater.bench.ab_overhead/3'   # /3: BLAS as it comes ('threads')
BASELINE_MODULE = 'mgpu_updater_baseline'
#: the baseline's checkout, for the workers: spawn imports this script in each as
#: ``__mp_main__`` before it unpickles anything of the baseline's
BASELINE_ENV = 'MGPU_UPDATER_AB_BASELINE'


def load_baseline(root):
    """The ``mgpu_updater`` of the checkout at ``root``, as :data:`BASELINE_MODULE`."""
    package = Path(root).resolve() / 'mgpu_updater'
    if not (package / '__init__.py').is_file():
        raise SystemExit(f'--baseline {root!r}: no mgpu_updater/__init__.py there; give a '
                         'checkout of this repository (git worktree add DIR COMMIT)')
    # Which cores this process's threads run on is one state per process: two copies of
    # it would each share out the cores, and the second updater's workers would inherit
    # the master's share of the first (two replicas on one core). Both use this
    # checkout's where the module is the same.
    threads = importlib.import_module('mgpu_updater._threads')
    if (package / '_threads.py').read_bytes() == Path(threads.__file__).read_bytes():
        sys.modules[BASELINE_MODULE + '._threads'] = threads
    spec = importlib.util.spec_from_file_location(
        BASELINE_MODULE, str(package / '__init__.py'),
        submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_MODULE] = module
    spec.loader.exec_module(module)
    return module


if __name__ == '__mp_main__' and os.environ.get(BASELINE_ENV):   # a worker of the baseline's
    load_baseline(os.environ[BASELINE_ENV])


def describe(root):
    """The checkout's commit, and whether its tree has changes."""
    def git(*args):
        try:
            return subprocess.run(['git', '-C', str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ''
    return {'commit': git('rev-parse', '--short', 'HEAD') or None,
            'changed': bool(git('status', '--porcelain', '--', 'mgpu_updater'))}


def build(k, batch, baseline, replicas=1):
    """name -> (step, model, optimizer, iterators, updater) for one ``k``."""
    import mgpu_updater
    dataset = overhead.make_dataset(max(4096, 64 * batch * replicas))

    def converter(b, device=None):
        return chainer.dataset.concat_examples(b, device)
    methods = {}
    model = overhead.make_model()
    it = overhead._iterator(dataset, batch, 1)
    if k == 1:
        std = chainer.training.updaters.StandardUpdater(it, _common.make_optimizer(model))
        methods['reference'] = (overhead._observed(std, model), model, None, [it], None)
    else:
        step, optimizer = overhead._hand(model, it, k, converter)
        methods['reference'] = (step, model, optimizer, [it], None)
    for name, package in (('baseline', baseline), ('this', mgpu_updater)):
        model = overhead.make_model()
        its = [overhead._iterator(dataset, batch, 1 + r) for r in range(replicas)]
        updater = package.ParallelAccumulatingUpdater(
            its if replicas > 1 else its[0], _common.make_optimizer(model),
            devices=['@numpy'] * replicas, accumulate_steps=k)
        methods[name] = (overhead._observed(updater, model), model, None, its, updater)
    return methods


def same_weights(a, b):
    pa, pb = dict(a.namedparams()), dict(b.namedparams())
    return pa.keys() == pb.keys() and all(
        numpy.array_equal(pa[n].array, pb[n].array) for n in pa)


def run_k(k, args, baseline):
    methods = build(k, args.batch, baseline, args.replicas)
    try:
        # warm up, then past prefetch='auto''s trial (about 125 windows) in both updaters
        for _ in range(args.warmup):
            for step, *_ in methods.values():
                step()
        # (the two updaters step alike throughout: they end on the same batches)
        pair = [methods[name] for name in ('baseline', 'this')]
        for _ in range(300):
            if all('trial' not in m[4].loading_modes for m in pair):
                break
            for m in pair:
                m[0]()
        times, _ = overhead.rounds(methods, list(methods), args.rounds, args.block, 0,
                                   untimed=args.untimed)
        ratios = {
            'this/baseline': [a / b for a, b in zip(times['this'], times['baseline'])],
            'baseline/reference': [a / b for a, b in
                                   zip(times['baseline'], times['reference'])],
            'this/reference': [a / b for a, b in zip(times['this'], times['reference'])],
        }
        return {
            'k': k,
            'reference': 'StandardUpdater' if k == 1 else 'hand-written loop',
            'ms': {name: 1e3 * statistics.median(t) for name, t in times.items()},
            'ratios': {name: _common.ratio_summary(r) for name, r in ratios.items()},
            'same_weights': same_weights(methods['baseline'][1], methods['this'][1]),
            'loading': {name: list(methods[name][4].loading_modes)
                        for name in ('baseline', 'this')},
        }
    finally:
        for name in ('baseline', 'this'):
            methods[name][4].finalize()


def markdown(result):
    lines = [f"`python bench/ab_overhead.py --baseline <checkout of "
             f"{result['baseline']['commit']}> --replicas {result['replicas']} "
             f"--ks {','.join(map(str, result['ks']))} --rounds {result['rounds']} "
             f"--block {result['block']} --untimed {result['untimed']}`", '',
             f"This checkout ({result['this']['commit']}"
             f"{', with changes' if result['this']['changed'] else ''}) against "
             f"{result['baseline']['commit']}"
             f"{' with changes' if result['baseline']['changed'] else ''}, "
             f"{result['replicas']} `'@numpy'` replica(s) each, beside the reference, on "
             f"bench/overhead.py's MLP (batch {result['batch']} per replica); turns of "
             f"{result['block']} updates (the first {result['untimed']} untimed), the order "
             f"shuffled each round, {result['rounds']} rounds. Ratio: median (95% "
             f"interval) of the rounds' ratios of time per update. Machine: "
             f"{result['machine']['cpu']} ({result['machine']['cores']} cores), Python "
             f"{result['versions']['python']}, numpy {result['versions']['numpy']}, "
             f"Chainer {result['versions']['chainer']}; BLAS "
             f"{_common.describe_threads(result['threads'])}.", '',
             '| k | reference | reference ms | baseline ms | this ms | this / baseline '
             '| baseline / reference | this / reference | same weights |',
             '|---:|---|---:|---:|---:|---|---|---|---|']
    for row in result['results']:
        ms, r = row['ms'], row['ratios']
        lines.append(
            f"| {row['k']} | {row['reference']} | {ms['reference']:.3f} | "
            f"{ms['baseline']:.3f} | {ms['this']:.3f} | "
            f"{_common.ratio_cell(r['this/baseline'])} | "
            f"{_common.ratio_cell(r['baseline/reference'])} | "
            f"{_common.ratio_cell(r['this/reference'])} | "
            f"{'yes' if row['same_weights'] else 'no'} |")
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--baseline', required=True,
                        help='a checkout of this repository to compare against')
    parser.add_argument('--replicas', type=int, choices=(1, 2), default=1,
                        help="'@numpy' replicas of each updater (default 1)")
    parser.add_argument('--ks', default=None, help='default 1,4 (one replica), 1 (two)')
    parser.add_argument('--rounds', type=int, default=None,
                        help='default 1500 (one replica), 100 (two)')
    parser.add_argument('--block', type=int, default=None,
                        help='updates per turn (default 3 (one replica), 60 (two))')
    parser.add_argument('--untimed', type=int, default=None,
                        help='the first updates of a turn, not timed (default 1 (one '
                             'replica), 10 (two))')
    parser.add_argument('--warmup', type=int, default=50)
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    one = args.replicas == 1
    for name, alone, several in (('ks', '1,4', '1'), ('rounds', 1500, 100),
                                 ('block', 3, 60), ('untimed', 1, 10)):
        if getattr(args, name) is None:
            setattr(args, name, alone if one else several)
    if not 0 <= args.untimed < args.block:
        parser.error(f'--untimed must be >= 0 and below --block; got --block {args.block} '
                     f'--untimed {args.untimed}')
    try:
        ks = [int(k) for k in args.ks.split(',')]
    except ValueError:
        parser.error(f'--ks must be integers separated by commas, like 1,4; got {args.ks!r}')
    if any(k < 1 for k in ks) or args.rounds < 2:
        parser.error(f'--ks must be >= 1 and --rounds >= 2; got --ks {args.ks} '
                     f'--rounds {args.rounds}')
    baseline = load_baseline(args.baseline)
    shared = sys.modules.get(BASELINE_MODULE + '._threads')
    if args.replicas > 1 and shared is not importlib.import_module('mgpu_updater._threads'):
        parser.error(f'--replicas {args.replicas}: the baseline {args.baseline!r} has '
                     'another mgpu_updater/_threads.py, and two copies of it would bind '
                     'both updaters\' workers wrongly; compare one replica')
    os.environ[BASELINE_ENV] = str(Path(args.baseline).resolve())   # for the workers
    result = {
        'schema': SCHEMA, 'rounds': args.rounds, 'batch': args.batch, 'ks': ks,
        'replicas': args.replicas, 'block': args.block, 'untimed': args.untimed,
        'this': describe(ROOT), 'baseline': describe(args.baseline),
        'machine': {'cpu': _common.cpu_model(), 'cores': len(os.sched_getaffinity(0))},
        'versions': {'python': '.'.join(map(str, sys.version_info[:3])),
                     'numpy': numpy.__version__, 'chainer': chainer.__version__},
        'threads': _common.thread_setting(),
        'results': [run_k(k, args, baseline) for k in ks],
    }
    table = markdown(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = 'ab_overhead' if args.replicas == 1 else f'ab_overhead_{args.replicas}_replicas'
        (out / f'{stem}.json').write_text(json.dumps(result, indent=1))
        (out / f'{stem}.md').write_text(table)


if __name__ == '__main__':
    main()
