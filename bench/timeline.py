"""Where an update's time goes on two CPU replicas: ours against ChainerMN, by timestamps.

    python bench/timeline.py [--updates 100] [--k 1] [--model cnn] [--out DIR]

On a VM whose speed drifts, samples/s of separate runs cannot resolve the few percent that
issue 15 is about (``scaling.py``'s rounds spread by 10-40%). The time an update spends
outside forward/backward can be resolved: it is made of short phases, each rarely
preempted in the middle, so their medians over 100 updates are stable. Both methods here
run two processes with one BLAS thread each and ours' malloc thresholds, on the same model
and micro-batch:

- **ours** (``ParallelAccumulatingUpdater``, two ``'@numpy'`` replicas): every process
  stamps the start and end of its phases (``time.perf_counter``, the same monotonic clock
  in every process) by wrapping the package's functions. The worker processes import this
  file as their main module, so they wrap theirs too. Outside forward/backward = the
  master's update minus its window.
- **ChainerMN** (``naive`` communicator, ``mpiexec -n 2``): rank 0 times the update, the
  wait for the other rank (a ``Barrier`` before the allreduce), the allreduce and the
  optimizer step. Outside forward/backward = the update minus forward/backward.

Each window also gets its thread's CPU time, preemptions and page faults
(:data:`COUNTERS`). The same forward/backward moves by 10-20% between repeats of 100
updates on a VM, so comparing the methods' windows or whole updates needs many short
repeats (``--updates 20 --repeats 24``): each repeat gives a ratio of two methods run back
to back, and the table gives their median with a 95% bootstrap interval.

Prints a Markdown table; with ``--out`` writes ``timeline.json`` and ``timeline.md``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = 'mgpu_updater.bench.timeline/4'
STAMPS = 'MGPU_BENCH_TIMELINE_DIR'   # where each process of ours writes its stamps
MALLOC = {'MALLOC_MMAP_THRESHOLD_': str(32 << 20), 'MALLOC_TRIM_THRESHOLD_': str(1 << 30)}

# What each process of ours stamps: (module, attribute, phase). The master runs all but
# the last; a worker runs ``worker_step``, and within it ``window`` and ``pack``. The
# master's 'meet' is its wait at the board for the workers' posts (their gradients packed).
PHASES = (
    ('mgpu_updater.updater', 'ParallelAccumulatingUpdater.update', 'update'),
    ('mgpu_updater._replica', 'Replica.run_window', 'window'),
    ('mgpu_updater._local.group', 'master_begin', 'begin'),
    ('mgpu_updater._local.group', 'master_finish', 'finish'),
    ('mgpu_updater._local.protocol', 'pack_window', 'pack'),
    ('mgpu_updater._local.protocol', 'take_results', 'gather'),
    ('mgpu_updater._local.pool', 'WorkerPool.send', 'send'),
    ('mgpu_updater.comm.shm', 'ShmCommunicator.reduce', 'reduce'),
    ('mgpu_updater.comm.shm', 'ShmCommunicator.reduce_onto', 'reduce'),
    ('mgpu_updater._local.group', 'SummedGrads.targets', 'targets'),
    ('mgpu_updater._local.group', 'SummedGrads.receive', 'receive'),
    ('mgpu_updater.updater', 'ParallelAccumulatingUpdater._apply', 'step'),
    ('mgpu_updater.updater', 'ParallelAccumulatingUpdater._report', 'report'),
    ('mgpu_updater._local.board', 'Board.meet', 'meet'),
    ('mgpu_updater._local.worker', 'worker_step', 'worker_step'),
)


#: What the calling thread has used so far, stamped beside the time: its CPU seconds, the
#: times the kernel took the CPU from it (involuntary context switches) and its minor page
#: faults. A window whose wall time grows with the same CPU time waited for a CPU; one
#: whose CPU time grows did more work or ran slower (faults, caches).
COUNTERS = ('cpu', 'preempted', 'faults')


def counters():
    import resource
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), usage.ru_nivcsw, usage.ru_minflt


def install_stamps(folder):
    """Wrap every function of :data:`PHASES` to append '<phase>> t cpu preempted faults'
    and '<phase>< ...' (:func:`counters`) to this process's file in ``folder``."""
    import importlib
    out = open(os.path.join(folder, '{}.txt'.format(os.getpid())), 'a', buffering=1)

    def stamp(mark):
        out.write('{} {:.7f} {:.7f} {} {}\n'.format(mark, time.perf_counter(), *counters()))

    def wrap(fn, phase):
        def stamped(*args, **kwargs):
            stamp(phase + '>')
            try:
                return fn(*args, **kwargs)
            finally:
                stamp(phase + '<')
        return stamped

    for module, attribute, phase in PHASES:
        owner = importlib.import_module(module)
        *path, name = attribute.split('.')
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, wrap(getattr(owner, name), phase))


if os.environ.get(STAMPS):      # the ours part and its workers (which import this file)
    install_stamps(os.environ[STAMPS])


# ------------------------------------------------------------------------------ the parts
def run_ours(args):
    from bench import _case, _common
    dataset = _common.make_dataset(_common.dataset_size(2 * args.k * args.micro_batch))
    model = _common.make_model(args.model)
    updater = _case._our_updater(model, dataset, 'cpu', 2, args.micro_batch,
                                 accumulate_steps=args.k, prefetch=args.prefetch)
    step = _case._observed_step(updater, model)
    try:
        for _ in range(args.warmup + args.updates):
            step()
    finally:
        updater.finalize()


def run_chainermn(args):
    from bench import _common
    import chainer
    import chainermn
    comm = chainermn.create_communicator('naive')
    b, k = args.micro_batch, args.k
    dataset = _common.make_dataset(_common.dataset_size(2 * k * b)) if comm.rank == 0 else None
    dataset = chainermn.scatter_dataset(dataset, comm, shuffle=True, seed=0)
    model = _common.make_model(args.model)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.01), comm)
    optimizer.setup(model)
    names = ('wait', 'allreduce', 'step', 'optimizer')
    times = {'update': [], **{name: [] for name in names},
             **{name + ' ' + c: [] for name in names for c in COUNTERS}}

    def timed(name, fn):
        def run(*a, **kw):
            start, before = time.perf_counter(), counters()
            try:
                return fn(*a, **kw)
            finally:
                times[name].append(time.perf_counter() - start)
                for c, end, begin in zip(COUNTERS, counters(), before):
                    times[name + ' ' + c].append(end - begin)
        return run

    mean_grad = comm.multi_node_mean_grad

    def allreduce(*a, **kw):
        timed('wait', comm.mpi_comm.Barrier)()
        return timed('allreduce', mean_grad)(*a, **kw)
    comm.multi_node_mean_grad = allreduce
    inner = optimizer.actual_optimizer
    inner.update = timed('step', inner.update)
    # forward/backward and the above (past the wrapper's __setattr__, which would set the
    # inner optimizer's)
    optimizer.__dict__['update'] = timed('optimizer', optimizer.update)
    # StandardUpdater, as ChainerMN's examples use it, at k*b samples per rank
    iterator = chainer.iterators.SerialIterator(dataset, k * b, shuffle=True)
    updater = chainer.training.updaters.StandardUpdater(iterator, optimizer)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    for i in range(args.warmup + args.updates):
        if i == args.warmup:
            for values in times.values():
                values.clear()
        start = time.perf_counter()
        with reporter.scope({}):
            updater.update()
        times['update'].append(time.perf_counter() - start)
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps(times))


# ------------------------------------------------------------------------------ analysis
def _spans(events, phase, column=0):
    """(start, end) of every call of ``phase``: times, or with ``column`` 1, 2, 3 the
    :data:`COUNTERS`."""
    starts = [e[column] for p, *e in events if p == phase + '>']
    ends = [e[column] for p, *e in events if p == phase + '<']
    return list(zip(starts, ends))


def _ms(values):
    return round(1e3 * statistics.median(values), 3) if values else None


def analyse_ours(folder, warmup):
    """Seconds of each of ours' phases, one value per timed update (per call for the
    master's ``pack`` and ``reduce``), from the stamp files in ``folder``."""
    events = {}
    for path in Path(folder).glob('*.txt'):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        events[path.stem] = [(p, *map(float, values)) for p, *values in rows]
    masters = [e for e in events.values() if _spans(e, 'update')]
    workers = [e for e in events.values() if _spans(e, 'worker_step')]
    if len(masters) != 1 or len(workers) != 1:
        raise RuntimeError('expected the stamps of one master and one worker, found {} '
                           'and {}'.format(len(masters), len(workers)))
    master, worker = masters[0], workers[0]
    updates = _spans(master, 'update')[warmup:]
    windows = _spans(master, 'window')[warmup:]
    out = {'update': [e - s for s, e in updates],
           'window': [e - s for s, e in windows],
           'outside': [(ue - us) - (we - ws) for (us, ue), (ws, we) in zip(updates, windows)]}
    for column, c in enumerate(COUNTERS, 1):
        out['window ' + c] = [e - s for s, e in _spans(master, 'window', column)[warmup:]]
    first = updates[0][0]
    for phase in ('begin', 'finish', 'targets', 'pack', 'gather', 'reduce', 'receive', 'step',
                  'report'):
        out['master ' + phase] = [e - s for s, e in _spans(master, phase) if s > first]
    # its wait at the board (the workers' gradients packed)
    out['master meet'] = [e - s for s, e in _spans(master, 'meet') if s > first]
    # the master's own work outside forward/backward: less its waits for the worker
    parts = [out['master gather']] + ([out['master meet']] if out['master meet'] else [])
    waits = [sum(w) for w in zip(*parts)]
    out['own'] = [o - w for o, w in zip(out['outside'], waits)]
    steps = _spans(worker, 'worker_step')[warmup:]
    worker_windows = _spans(worker, 'window')[warmup:]
    begins = _spans(master, 'begin')[warmup:]
    # from the start of the write that sends Step (the last send of each begin): the
    # worker may well have it before the master's begin returns (the master preempted by
    # the worker it woke, on a 2-core VM)
    sends = _spans(master, 'send')
    step_sent = [max(s for s, _ in sends if b0 <= s <= b1) for b0, b1 in begins]
    out['step latency'] = [w[0] - sent for sent, w in zip(step_sent, steps)]
    out['worker start'] = [w[0] - s[0] for s, w in zip(steps, worker_windows)]
    out['worker window'] = [e - s for s, e in worker_windows]
    out['worker idle'] = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
    return out


def analyse_chainermn(times):
    """Seconds of each of ChainerMN's phases on rank 0, one value per timed update."""
    n = min(len(v) for v in times.values())

    def fwd_bwd(suffix=''):   # the optimizer's update less what it wraps
        return [times['optimizer' + suffix][i] - times['wait' + suffix][i]
                - times['allreduce' + suffix][i] - times['step' + suffix][i]
                for i in range(n)]
    window = fwd_bwd()
    outside = [times['update'][i] - window[i] for i in range(n)]
    out = {'update': times['update'][:n], 'window': window, 'outside': outside,
           'own': [outside[i] - times['wait'][i] for i in range(n)],
           'wait': times['wait'][:n], 'allreduce': times['allreduce'][:n],
           'step': times['step'][:n]}
    if 'optimizer cpu' in times:
        for c in COUNTERS:
            out['window ' + c] = fwd_bwd(' ' + c)
    return out


def medians(values):
    """{phase: median in ms} of pooled per-update seconds (counts: their median as it
    is), plus the count of updates."""
    out = {key: (statistics.median(v) if v else None)
           if key.endswith((' preempted', ' faults')) else _ms(v)
           for key, v in values.items()}
    out['updates'] = len(values['update'])
    return out


def pooled(parts):
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


ROWS = (   # (label, key of ours, key of ChainerMN)
    ('update', 'update', 'update'),
    ('rank 0 forward/backward (ours: the master\'s window)', 'window', 'window'),
    ('  its thread\'s CPU time', 'window cpu', 'window cpu'),
    ('  times its thread was preempted (count)', 'window preempted', 'window preempted'),
    ('  its thread\'s minor page faults (count)', 'window faults', 'window faults'),
    ('**outside forward/backward (rank 0)**', 'outside', 'outside'),
    ('outside forward/backward, less rank 0\'s waits for the other', 'own', 'own'),
    ('wait for the other replica (ours: at the board; ChainerMN: a barrier)', 'master meet',
     'wait'),
    ('ours: the master takes the workers\' results (mailboxes at the board)',
     'master gather', None),
    ('gradient sum (ours: the master sums the worker\'s slot onto its gradient arrays; '
     'ChainerMN: allreduce)', None, 'allreduce'),
    ('  master finds its gradient arrays (SummedGrads.targets)', 'master targets', None),
    ('  master packs its gradient (only where they cannot take the sum)', 'master pack',
     None),
    ('  master sums (shm reduce_onto, or reduce)', 'master reduce', None),
    ('  master takes the sum (param.grad = views, only where packed)', 'master receive',
     None),
    ('optimizer step', 'master step', 'step'),
    ('report', 'master report', None),
    ('parameters out, Step sent (begin)', 'master begin', None),
    ('Step sent (its write starts) -> the worker has it', 'step latency', None),
    ('the worker has Step -> its window starts', 'worker start', None),
    ('worker window', 'worker window', None),
    ('worker idle between its updates', 'worker idle', None),
)


PAIRS = (   # (label, numerator, denominator): compared repeat by repeat
    ('ours / ChainerMN', 'ours', 'chainermn'),
)


def paired_ratios(repeats, median_interval):
    """Per pair of :data:`PAIRS` that ran, and for 'update' and 'window': the ratio of the
    two methods' medians in each repeat (run back to back, so the VM's drift, which moves
    the same forward/backward by 10-20% from one repeat to the next, weighs on both), with
    the median over the repeats and its 95% interval."""
    out = {}
    for label, a, b in PAIRS:
        for key in ('update', 'window'):
            ratios = [rep[a][key] / rep[b][key] for rep in repeats if a in rep and b in rep]
            if ratios:
                low, high = median_interval(ratios)
                out['{}: {}'.format(label, key)] = {
                    'ratios': ratios, 'median': statistics.median(ratios),
                    'ci95': [low, high]}
    return out


def markdown(result):
    ours, mn = result['ours'], result.get('chainermn')
    names = ['ours', 'chainermn']
    heads = ['ours', 'ChainerMN (naive)']
    lines = ['# Where an update\'s time goes: 2 CPU replicas, ours and ChainerMN', '',
             '`{}`'.format(result.get('command', 'python bench/timeline.py')), '',
             'Model `{model}`, micro-batch {micro_batch} per replica, k = {k}, ours with '
             'prefetch={prefetch}; {repeats} repeats, '
             'alternating the methods, each '
             '{updates} timed updates after {warmup} warm-up; 1 BLAS thread per process, '
             'ours\' malloc thresholds for all. Milliseconds, medians over every timed '
             'update of the repeats.'.format(
                 **result['config']), '',
             '- Machine: {cpu} ({cores} usable cores); load average {load_start} at start, '
             '{load_end} at the end'.format(**result['machine']), '',
             '| per update (ms) | ' + ' | '.join(heads) + ' |',
             '|---|' + '---:|' * len(heads)]
    for label, ours_key, mn_key in ROWS:
        cells = [ours.get(ours_key) if ours_key else None]
        cells.append(mn.get(mn_key) if (mn and mn_key) else None)
        lines.append('| {} | {} |'.format(label, ' | '.join(
            '-' if c is None else str(c) for c in cells)))
    lines.append('')
    lines += ['Each repeat, in the order run (medians, ms): update / forward-backward / '
              'outside.', '', '| repeat | ' + ' | '.join(heads) + ' |',
              '|---:|' + '---|' * len(heads)]
    for i, rep in enumerate(result['repeats']):
        cells = []
        for name in names:
            r = rep.get(name)
            cells.append('-' if r is None else '{update} / {window} / {outside}'.format(**r))
        lines.append('| {} | {} |'.format(i + 1, ' | '.join(cells)))
    lines.append('')
    if result.get('paired'):
        lines += ['Repeat by repeat: the ratio of two methods\' medians in each repeat, its '
                  'median over the {} repeats and a 95% bootstrap interval (above 1: the '
                  'first is slower).'.format(len(result['repeats'])), '',
                  '| ratio | median | 95% interval |', '|---|---:|---:|']
        for label, r in result['paired'].items():
            lines.append('| {} | {:.3f} | {:.3f}-{:.3f} |'.format(label, r['median'],
                                                                 *r['ci95']))
        lines.append('')
    if mn:
        lines.append('Outside forward/backward, ours / ChainerMN: **{:.2f}x** '
                     '({} ms against {} ms); less the waits: **{:.2f}x** ({} ms against '
                     '{} ms).'.format(ours['outside'] / mn['outside'], ours['outside'],
                                      mn['outside'], ours['own'] / mn['own'], ours['own'],
                                      mn['own']))
    else:
        lines.append('ChainerMN did not run: {}.'.format(result.get('chainermn_skipped')))
    return '\n'.join(lines) + '\n'


# ------------------------------------------------------------------------------ driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--updates', type=int, default=100, help='timed updates (default 100)')
    p.add_argument('--warmup', type=int, default=5, help='untimed updates first (default 5)')
    p.add_argument('--k', type=int, default=1, help='accumulate_steps (default 1)')
    p.add_argument('--repeats', type=int, default=3,
                   help='ours and ChainerMN alternate this many times (default 3)')
    p.add_argument('--prefetch', type=_prefetch, default='auto',
                   help="ours' prefetch: 'auto' (default, the updater's) or an int >= 0")
    p.add_argument('--model', default='cnn', choices=('cnn', 'mlp', 'tiny'))
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--out', help='folder for timeline.json and timeline.md')
    p.add_argument('--part', choices=('ours', 'chainermn'), help=argparse.SUPPRESS)
    p.add_argument('--json', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if (args.updates < 2 or min(args.warmup, args.k, args.micro_batch, args.repeats) < 1
            or (args.prefetch != 'auto' and args.prefetch < 0)):
        p.error('--updates must be >= 2, --warmup, --k, --micro-batch and --repeats >= 1, '
                '--prefetch >= 0')
    return args


def _prefetch(text):
    return text if text == 'auto' else int(text)


def _child(args, part, env, prefix=(), timeout=600, **extra):
    cmd = list(prefix) + [sys.executable, str(Path(__file__).resolve()), '--part', part,
                          '--updates', str(args.updates), '--warmup', str(args.warmup),
                          '--k', str(args.k), '--model', args.model,
                          '--prefetch', str(args.prefetch),
                          '--micro-batch', str(args.micro_batch)]
    for key, value in extra.items():
        cmd += ['--' + key, value]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError('{} part failed ({}):\n{}'.format(part, proc.returncode,
                                                             proc.stderr[-5000:]))


def main(argv=None):
    args = parse_args(argv)
    if args.part == 'ours':
        return run_ours(args)
    if args.part == 'chainermn':
        return run_chainermn(args)
    from bench import _common
    env = dict(os.environ, **_common.thread_env(1), **MALLOC)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(_common.ROOT),
                                                      os.environ.get('PYTHONPATH')]))
    env.setdefault('OMPI_ALLOW_RUN_AS_ROOT', '1')
    env.setdefault('OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', '1')
    load_start = _common.loadavg()
    result = {'schema': SCHEMA,
              'command': ' '.join(['python bench/timeline.py']
                                  + list(sys.argv[1:] if argv is None else argv)),
              'config': {
        'model': args.model, 'micro_batch': args.micro_batch, 'k': args.k,
        'updates': args.updates, 'warmup': args.warmup, 'repeats': args.repeats,
        'prefetch': args.prefetch}}
    import importlib.util
    import shutil
    candidate = Path(sys.executable).parent / 'mpiexec'
    mpiexec = str(candidate) if candidate.exists() else shutil.which('mpiexec')
    if importlib.util.find_spec('mpi4py') is None or mpiexec is None:
        result['chainermn_skipped'] = 'mpi4py or mpiexec is not installed'
        mpiexec = None
    ours, mn, result['repeats'] = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            stamps = os.path.join(tmp, 'stamps{}'.format(r))
            os.mkdir(stamps)
            _child(args, 'ours', dict(env, **{STAMPS: stamps}))
            ours.append(analyse_ours(stamps, args.warmup))
            rep = {'ours': medians(ours[-1])}
            if mpiexec is not None:
                out = os.path.join(tmp, 'chainermn{}.json'.format(r))
                _child(args, 'chainermn', env, json=out, prefix=(
                    mpiexec, '-n', '2', '--oversubscribe', '--bind-to', 'none'))
                mn.append(analyse_chainermn(json.loads(Path(out).read_text())))
                rep['chainermn'] = medians(mn[-1])
            result['repeats'].append(rep)
    result['ours'] = medians(pooled(ours))
    result['paired'] = paired_ratios(result['repeats'], _common.median_interval)
    if mn:
        result['chainermn'] = medians(pooled(mn))
    result['machine'] = {'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
                         'load_start': load_start, 'load_end': _common.loadavg()}
    md = _common.without_local_paths(markdown(result))
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / 'timeline.md').write_text(md)
        (out / 'timeline.json').write_text(json.dumps(result, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
