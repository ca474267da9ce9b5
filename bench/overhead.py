"""The updater's own cost where the host decides the speed: a launch-bound model.

    python bench/overhead.py [--rounds 1000] [--block 3] [--batch 16] [--out DIR]

A 64-64-10 MLP on 64 features, batch 16, data in memory: forward plus backward take well
under a millisecond on a CPU, so each update is mostly Python, as on a fast GPU, where the
device finishes each kernel before the host launches the next. There, what the updater
itself does per update shows; on the example's CNN (35-45 ms an update on a 2-core VM)
it is lost in the noise.

Every method runs in this process (ours' two-replica run has its one worker besides),
the methods taking turns ``--block`` updates at a time (the first of
each turn untimed, the others averaged), in an order shuffled anew each round, so that a
slow stretch of the machine weighs on all of them alike and no method always follows the
same other one (up to ``overhead/1`` the order rotated: each method's turn then followed
the same method's nearly every round, and what a turn leaves behind, a worker still
spinning or a busy core, fell on the same baseline each time; ``bench/cold_window.py``
found that such a fixed order misread its gaps). Each round gives the ratio of ours'
time per update to its baseline's in the same round; the table gives each ratio's median
with a 95% bootstrap interval over the rounds:

- ``ours_k1 / standard``: one ``'@numpy'`` replica, ``accumulate_steps=1``, against
  ``StandardUpdater`` on the same batches (goal: <= 1.03);
- ``ours_k4 / hand_k4``: one replica, ``accumulate_steps=4``, against the hand-written
  accumulation loop (``cleargrads``; four forward/backward; one ``optimizer.update()``)
  (goal: <= 1.03);
- ``ours_n2 / standard``: two replicas, each with StandardUpdater's batch (each replica
  does StandardUpdater's work, in parallel: the ideal is 1.0; goal: <= 1.25);
- ``ours_n2 / standard, warm``: the same two, alone, in long turns (``--warm-block``
  updates, the first ``--warm-untimed`` not timed), as in training, where a worker is
  never idle for long between updates. In turns of a few updates a worker starts each
  turn cold: it slept through the other methods' turns (a millisecond or more), and its
  window then takes 0.9-1.1 ms where it takes 0.6 ms in a run of updates (stamped as
  ``bench/timeline.py`` stamps); so does the lockstep floor's (``bench/two_replica_floor.py``).
  Both rows are judged against the goal; the warm one is what training sees;
- ``ours_n2 / standard_busy`` (for scale): against ``StandardUpdater`` while a second
  process runs the same updates on the other core, free-running: what two processes
  computing at once cost each other on this machine (caches, memory, the hypervisor),
  which no protocol removes.

The BLAS libraries run as the environment leaves them, as a user's script runs (no
thread variable: OpenBLAS with a thread per core), and the result records their threads.
So ours' defaults are timed whole: with two replicas, ``blas_threads='auto'`` limits the
worker to its share of the cores for its life and the master during its own window, at
a cost each update. Up to ``overhead/2`` every method ran with one BLAS thread, set
before numpy loaded, which left that limit untimed (it then had nothing to change).

Then a second pass splits each method's update into phases, timed by wrapping the same
functions in every method (``iterator.next`` and the converter: loading; the model's
forward; ``Variable.backward``; the optimizer's step) and, for ours, its own phases (the
group's begin, the reduction, the report): what ours spends beyond its baseline, phase by
phase, so that what remains has a name and a size. (The wrappers cost both methods alike,
about a microsecond a call; the first pass has none.)

Prints a Markdown table; with ``--out`` writes ``overhead.json`` and ``overhead.md``.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy  # noqa: E402

# /2: the order shuffled each round; /3: BLAS as the environment leaves it ('threads')
SCHEMA = 'mgpu_updater.bench.overhead/3'
FEATURES, HIDDEN, CLASSES = 64, 64, 10
GOALS = {'ours_k1/standard': 1.03, 'ours_k4/hand_k4': 1.03, 'ours_n2/standard': 1.25}


class MLP(chainer.Chain):
    """64 - 64 - 10 with ReLU (module level: the worker unpickles it)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(FEATURES, HIDDEN)
            self.l2 = L.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def make_model(seed=0):
    numpy.random.seed(seed)
    return L.Classifier(MLP())


def make_dataset(n, seed=0):
    rng = numpy.random.RandomState(seed)
    return chainer.datasets.TupleDataset(
        rng.random_sample((n, FEATURES)).astype(numpy.float32),
        rng.randint(0, CLASSES, n).astype(numpy.int32))


def _iterator(dataset, batch, seed):
    return chainer.iterators.SerialIterator(
        dataset, batch, order_sampler=chainer.iterators.ShuffleOrderSampler(
            numpy.random.RandomState(seed)))


class Phases:
    """Seconds per phase of the update under way, by wrapping functions (second pass)."""

    def __init__(self):
        self.seconds = {}
        self.active = False

    def wrap(self, fn, phase):
        clock, seconds = time.perf_counter, self.seconds

        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[phase] = seconds.get(phase, 0.0) + clock() - start
        return timed


def _observed(updater, model):
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    reporter.add_observers('main', model.namedlinks(skipself=True))

    def step():
        with reporter.scope({}):
            updater.update()
    return step


def _hand(model, iterator, k, converter):
    optimizer = _common.make_optimizer(model)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)

    def step():
        with reporter.scope({}):
            model.cleargrads()
            for _ in range(k):
                x, t = converter(iterator.next(), None)
                loss = model(x, t) / k
                loss.backward()
                del loss
            optimizer.update()
    return step, optimizer


def _busy_loop(running, stop, batch):
    """The other core's work for ``standard_busy``: StandardUpdater's updates on the same
    model and data, as long as ``running`` is set, until ``stop``."""
    model = make_model()
    it = _iterator(make_dataset(max(4096, 64 * batch)), batch, 7)
    step = _observed(chainer.training.updaters.StandardUpdater(
        it, _common.make_optimizer(model)), model)
    while not stop.is_set():
        if running.wait(0.05):
            step()


class Busy:
    """A process doing StandardUpdater's work on the other core during a turn."""

    def __init__(self, batch):
        import multiprocessing
        ctx = multiprocessing.get_context('spawn')
        self.running, self.stop = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_busy_loop, args=(self.running, self.stop, batch),
                                daemon=True)
        self.proc.start()

    def turn(self, on):
        (self.running.set if on else self.running.clear)()

    def close(self):
        self.stop.set()
        self.running.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def build(args, phases):
    """Every method: name -> (step, model, optimizer, iterators, updater or None)."""
    from mgpu_updater import ParallelAccumulatingUpdater
    b = args.batch
    dataset = make_dataset(max(4096, 64 * b))
    methods = {}

    def converter(batch, device=None):
        return chainer.dataset.concat_examples(batch, device)
    timed_convert = phases.wrap(converter, 'loading')

    model = make_model()
    it = _iterator(dataset, b, 1)
    std = chainer.training.updaters.StandardUpdater(it, _common.make_optimizer(model),
                                                     converter=timed_convert)
    methods['standard'] = (_observed(std, model), model, std.get_optimizer('main'), [it],
                           None)
    model = make_model()
    it = _iterator(dataset, b, 1)
    busy = chainer.training.updaters.StandardUpdater(it, _common.make_optimizer(model),
                                                      converter=timed_convert)
    methods['standard_busy'] = (_observed(busy, model), model, busy.get_optimizer('main'),
                                [it], None)
    model = make_model()
    it = _iterator(dataset, b, 1)
    step, optimizer = _hand(model, it, 4, timed_convert)
    methods['hand_k4'] = (step, model, optimizer, [it], None)
    for name, n, k in (('ours_k1', 1, 1), ('ours_k4', 1, 4), ('ours_n2', 2, 1)):
        model = make_model()
        its = [_iterator(dataset, b, 1 + r) for r in range(n)]
        updater = ParallelAccumulatingUpdater(
            its if n > 1 else its[0], _common.make_optimizer(model),
            devices=['@numpy'] * n, accumulate_steps=k, converter=timed_convert)
        methods[name] = (_observed(updater, model), model, updater.get_optimizer('main'),
                         its, updater)
    return methods


def instrument(methods, phases):
    """The second pass's wrappers: the same functions in every method, and ours' own."""
    backward = chainer.Variable.backward
    chainer.Variable.backward = phases.wrap(backward, 'backward')
    for name, (_, model, optimizer, its, updater) in methods.items():
        model.forward = phases.wrap(model.forward, 'forward')
        optimizer.update = phases.wrap(optimizer.update, 'step')
        for it in its:
            it.next = phases.wrap(it.next, 'loading')
        if updater is not None:
            # one device, one whole micro-batch: _update_direct, which reports through
            # _publish and runs Replica.direct_window; else _report and run_window
            direct = updater._direct
            if direct:
                updater._publish = phases.wrap(updater._publish, 'report')
            else:
                updater._report = phases.wrap(updater._report, 'report')
            # the group and the step policy exist after the first update
            group = updater._group
            group.begin = phases.wrap(group.begin, 'begin')
            policy = updater._step
            policy.reduce = phases.wrap(policy.reduce, 'reduce')
            replica = updater._replica
            if direct:
                replica.direct_window = phases.wrap(replica.direct_window, 'window')
            else:
                replica.run_window = phases.wrap(replica.run_window, 'window')
    return backward


def rounds(methods, order, n_rounds, block, warmup, phases=None, turns=None, untimed=1,
           seed=0):
    """Turns of ``block`` updates, in an order shuffled anew each round (``seed``): per
    method, per round, the mean seconds of its timed updates, all but the first
    ``untimed`` of each turn (and, with ``phases``, of each phase). ``turns``: name -> a
    function told True when that method's turn starts, False when it ends."""
    turns = turns or {}
    times = {name: [] for name in order}
    split = {name: {} for name in order}
    shuffled, shuffle = list(order), random.Random(seed).shuffle
    for i in range(warmup + n_rounds):
        shuffle(shuffled)
        for name in shuffled:
            step = methods[name][0]
            if name in turns:
                turns[name](True)
            for _ in range(untimed):
                step()   # warms the method after the others' turns: not timed
            total, per_phase = 0.0, {}
            for _ in range(block - untimed):
                if phases is not None:
                    phases.seconds.clear()
                    phases.active = True
                start = time.perf_counter()
                step()
                total += time.perf_counter() - start
                if phases is not None:
                    phases.active = False
                    for key, s in phases.seconds.items():
                        per_phase[key] = per_phase.get(key, 0.0) + s
            if name in turns:
                turns[name](False)
            if i >= warmup:
                times[name].append(total / (block - untimed))
                for key, s in per_phase.items():
                    split[name].setdefault(key, []).append(s / (block - untimed))
    return times, split


PAIRS = (('ours_k1/standard', 'ours_k1', 'standard'),
         ('ours_k4/hand_k4', 'ours_k4', 'hand_k4'),
         ('ours_n2/standard', 'ours_n2', 'standard'))
# the same as ours_n2/standard, in long turns of the two alone (warm workers)
WARM = ('ours_n2/standard, warm', 'ours_n2', 'standard')
# (for scale, judged against no goal)
SCALE = (('ours_n2/standard_busy', 'ours_n2', 'standard_busy'),
         ('standard_busy/standard', 'standard_busy', 'standard'))

# The phases of the second pass; ours' window is its loading, forward and backward and
# the replica's own work around them ('window, own').
PHASES = ('loading', 'forward', 'backward', 'step', 'begin', 'reduce', 'report')


def breakdown(split, times, name):
    """Median ms per phase of ``name``, with 'own': the update less every named phase
    (for ours, less the window too; its window's own work is 'window, own')."""
    med = {key: 1e3 * statistics.median(v) for key, v in split[name].items()}
    out = {p: med.get(p, 0.0) for p in PHASES}
    total = 1e3 * statistics.median(times[name])
    inner = out['loading'] + out['forward'] + out['backward']
    if 'window' in med:
        out['window, own'] = med['window'] - inner
        # the step runs inside the reduction (the step policy hands it over): not twice;
        # alone (one device, stepping now) the updater steps without the policy's reduce
        out['reduce'] = out['reduce'] - out['step'] if 'reduce' in med else 0.0
        out['own'] = total - med['window'] - out['begin'] - out['reduce'] - out['step'] \
            - out['report']
    else:
        out['window, own'] = 0.0
        # StandardUpdater's step wraps its forward and backward (optimizer.update(lossfun))
        if out['step'] > inner - out['loading']:
            out['step'] -= out['forward'] + out['backward']
        out['own'] = total - inner - out['step']
    out['total'] = total
    return out


def markdown(result):
    lines = ['# The updater\'s own cost on a launch-bound model', '',
             '`{}`'.format(result['command']), '',
             'A {}-{}-{} MLP, batch {}, data in memory, BLAS as it comes: {}; turns of {} '
             'updates (the first untimed), the order shuffled each round; {} rounds. Ratio = '
             'ours\' time per update / its baseline\'s in the same round: median (95% '
             'interval). Machine: {} ({} cores), Python {}, numpy {}, Chainer {}; load '
             'average {} at start, {} at the end.'.format(
                 FEATURES, HIDDEN, CLASSES, result['batch'],
                 _common.describe_threads(result['threads']), result['block'],
                 result['rounds'], result['machine']['cpu'], result['machine']['cores'],
                 result['versions']['python'], result['versions']['numpy'],
                 result['versions']['chainer'], result['machine']['loadavg_start'],
                 result['machine']['loadavg_end']), '',
             '| ratio | ours ms | baseline ms | median (95% interval) | goal | verdict |',
             '|---|---:|---:|---:|---:|---|']
    for key, a, b in PAIRS:
        r = result['ratios'][key]
        lines.append('| {} | {:.3f} | {:.3f} | {} | <= {} | {} |'.format(
            key, result['ms'][a], result['ms'][b], _common.ratio_cell(r), GOALS[key],
            r['verdict']))
    if 'warm' in result:
        key, a, b = WARM
        w = result['warm']
        r = w['ratio']
        lines.append('| {} (turns of {}, {} untimed; {} rounds) | {:.3f} | {:.3f} | {} '
                     '| <= {} | {} |'.format(key, w['block'], w['untimed'], w['rounds'],
                                             w['ms'][a], w['ms'][b], _common.ratio_cell(r),
                                             GOALS['ours_n2/standard'], r['verdict']))
    for key, a, b in SCALE:
        lines.append('| {} | {:.3f} | {:.3f} | {} | - | (for scale) |'.format(
            key, result['ms'][a], result['ms'][b], _common.ratio_cell(result['ratios'][key])))
    lines += ['', 'Where ours spends beyond its baseline (second pass, wrapped; median ms '
              'per update; "own": the update less every phase named):', '',
              '| phase | ' + ' | '.join(
                  '{} | {} | +'.format(a, b) for _, a, b in PAIRS) + ' |',
              '|---|' + '---:|---:|---:|' * len(PAIRS)]
    for phase in PHASES + ('window, own', 'own', 'total'):
        cells = []
        for _, a, b in PAIRS:
            x, y = result['phases'][a][phase], result['phases'][b][phase]
            cells.append('{:.3f} | {:.3f} | {:+.3f}'.format(x, y, x - y))
        lines.append('| {} | {} |'.format(phase, ' | '.join(cells)))
    lines += ['', 'Ours\' choices: {}.'.format('; '.join(
        '{}: loading {}'.format(name, modes) for name, modes in result['loading'].items()))]
    return '\n'.join(lines) + '\n'


def verdict(goal, low, high):
    return 'met' if high <= goal else 'not met' if low > goal else 'not resolved'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=1000)
    p.add_argument('--phase-rounds', type=int, default=None,
                   help='rounds of the second pass (default: a third of --rounds)')
    p.add_argument('--warmup', type=int, default=10, help='untimed rounds first (default 10)')
    p.add_argument('--block', type=int, default=3)
    p.add_argument('--trial-updates', type=int, default=150,
                   help="ours' first updates, run alone before the rounds (default 150: "
                        "prefetch='auto' decides within them)")
    p.add_argument('--warm-rounds', type=int, default=200,
                   help='rounds of ours_n2 and standard alone in long turns (default 200; '
                        '0: none)')
    p.add_argument('--warm-block', type=int, default=60,
                   help='updates per turn there (default 60)')
    p.add_argument('--warm-untimed', type=int, default=10,
                   help='the first updates of each such turn, not timed (default 10)')
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--out')
    args = p.parse_args(argv)
    if args.rounds < 2 or args.block < 2 or args.batch < 1 or args.warmup < 0:
        p.error('--rounds and --block must be >= 2, --batch >= 1, --warmup >= 0')
    if args.warm_rounds and not 0 <= args.warm_untimed < args.warm_block:
        p.error(f'--warm-untimed ({args.warm_untimed}) must be >= 0 and below --warm-block '
                f'({args.warm_block})')
    phases = Phases()
    result = {'schema': SCHEMA,
              'command': 'python bench/overhead.py ' + ' '.join(
                  sys.argv[1:] if argv is None else argv),
              'batch': args.batch, 'block': args.block, 'rounds': args.rounds,
              'machine': {'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
                          'loadavg_start': _common.loadavg()},
              'versions': _common.versions(), 'threads': _common.thread_setting()}
    methods = build(args, phases)
    order = list(methods)
    busy = Busy(args.batch)
    turns = {'standard_busy': busy.turn}
    try:
        # ours' first updates, one after another as in training: prefetch='auto' tries
        # both ways of loading there (about a hundred windows) and keeps the faster
        for name, (step, _, _, _, updater) in methods.items():
            if updater is not None:
                for _ in range(args.trial_updates):
                    step()
        times, _ = rounds(methods, order, args.rounds, args.block, args.warmup, turns=turns)
        if args.warm_rounds:
            warm, _ = rounds(methods, [WARM[2], WARM[1]], args.warm_rounds, args.warm_block,
                             2, untimed=args.warm_untimed)
        backward = instrument(methods, phases)
        try:
            n2 = args.phase_rounds or max(2, args.rounds // 3)
            ptimes, split = rounds(methods, order, n2, args.block, 2, phases, turns=turns)
        finally:
            chainer.Variable.backward = backward
        result['loading'] = {name: list(getattr(m[4], 'loading_modes', [])) or '-'
                             for name, m in methods.items() if m[4] is not None}
    finally:
        busy.close()
        for _, _, _, _, updater in methods.values():
            if updater is not None:
                updater.finalize()
    result['ms'] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    result['ratios'] = {}
    for key, a, b in PAIRS:
        s = _common.ratio_summary([x / y for x, y in zip(times[a], times[b])])
        s['verdict'] = verdict(GOALS[key], *s['ci95'])
        result['ratios'][key] = s
    if args.warm_rounds:
        key, a, b = WARM
        r = _common.ratio_summary([x / y for x, y in zip(warm[a], warm[b])])
        r['verdict'] = verdict(GOALS['ours_n2/standard'], *r['ci95'])
        result['warm'] = {'block': args.warm_block, 'untimed': args.warm_untimed,
                          'rounds': args.warm_rounds, 'ratio': r,
                          'ms': {n: 1e3 * statistics.median(t) for n, t in warm.items()}}
    for key, a, b in SCALE:
        result['ratios'][key] = _common.ratio_summary([x / y for x, y in zip(times[a],
                                                                             times[b])])
    result['phases'] = {name: breakdown(split, ptimes, name) for name in order}
    result['machine']['loadavg_end'] = _common.loadavg()
    _common.save_results(args.out, 'overhead', result, markdown(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
