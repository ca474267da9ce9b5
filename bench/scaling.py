"""Scaling benchmark: ParallelAccumulatingUpdater against Chainer's updaters and ChainerMN.

    python bench/scaling.py [--quick | --smoke] [--out DIR] [--model cnn|mlp|tiny]

Grid: devices 1..available (GPU ids when CuPy sees GPUs, else CPU replicas up to the core
count) x accumulate_steps k, with a fixed per-device micro-batch b, so every method runs the
same global batch N*k*b per update. Each group of cases runs in a fresh process whose BLAS
thread count is set before numpy loads: single-process methods get every core's threads, each
of N replicas (or ChainerMN ranks, or the limit's N independent loops) gets cores // N. Writes a Markdown table to stdout and
``scaling.json``, ``scaling.png``, ``scaling.md`` to ``--out``.
"""
import argparse
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common, _report  # noqa: E402  (imports Chainer through the shim)

import chainer  # noqa: E402

HERE = Path(__file__).resolve().parent
SCHEMA = 'mgpu_updater.bench.scaling/1'

PROFILES = {
    #            model   b   ks         warmup rounds updates passes
    'default': ('cnn', 32, (1, 4, 8), 3, 2, 2, 5),
    'quick': ('cnn', 32, (1, 4, 8), 1, 3, 1, 1),
    'smoke': ('tiny', 4, (1, 2), 1, 2, 1, 1),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument('--quick', action='store_true', help='fewer rounds (< 3 min on 2 cores)')
    mode.add_argument('--smoke', action='store_true', help='tiny model, 1-2 rounds (tests)')
    p.add_argument('--out', default=str(HERE / 'results'), help='output folder')
    p.add_argument('--model', choices=_common.MODELS, help='workload (default cnn)')
    p.add_argument('--micro-batch', type=int, help='per-device micro-batch b (default 32)')
    p.add_argument('--ks', help='accumulate_steps values, comma-separated (default 1,4,8)')
    p.add_argument('--devices', help='device counts, comma-separated (default 1..available)')
    p.add_argument('--warmup', type=int, help='warm-up updates per case')
    p.add_argument('--rounds', type=int, help='timed rounds per case')
    p.add_argument('--updates', type=int, help='updates per timed round')
    p.add_argument('--passes', type=int,
                   help='times the whole grid runs (rounds pooled; alternate passes reversed)')
    p.add_argument('--methods', help='comma-separated subset of ' + ','.join(_report.LABELS))
    p.add_argument('--same-malloc', action='store_true',
                   help='give every method the malloc thresholds that ours sets by default '
                        '(reuse_host_memory), through MALLOC_MMAP_THRESHOLD_ and '
                        'MALLOC_TRIM_THRESHOLD_ in every process\'s environment: compares '
                        'the methods with that gain taken out')
    p.add_argument('--settle', type=float, default=0.0,
                   help='seconds to pause before each case, so that the kernel finishes '
                        'reclaiming the previous case\'s memory (default 0)')
    p.add_argument('--case-timeout', type=float, default=900,
                   help='seconds allowed for one group of cases (one process or mpiexec)')
    args = p.parse_args(argv)
    profile = 'smoke' if args.smoke else 'quick' if args.quick else 'default'
    model, b, ks, warmup, rounds, updates, passes = PROFILES[profile]
    args.profile = profile
    args.model = args.model or model
    args.micro_batch = args.micro_batch or b
    args.ks = _int_list(args.ks) if args.ks else list(ks)
    args.warmup = warmup if args.warmup is None else args.warmup
    args.rounds = args.rounds or rounds
    args.updates = args.updates or updates
    args.passes = args.passes or passes
    args.methods = (args.methods.split(',') if args.methods else list(_report.LABELS))
    unknown = set(args.methods) - set(_report.LABELS)
    if unknown:
        p.error('unknown methods: {}'.format(', '.join(sorted(unknown))))
    return args


def _int_list(text):
    return [int(v) for v in text.split(',') if v.strip()]


def default_device_counts(available):
    """1, 2, 4, ... up to ``available``, and ``available`` itself."""
    counts, n = [], 1
    while n < available:
        counts.append(n)
        n *= 2
    return counts + [available]


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, total):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def show(self, text, advance=0):
        self.done += advance
        line = '[{:>2}/{}] {:5.0f}s  {}'.format(self.done, self.total,
                                                time.perf_counter() - self.start, text)
        if self.tty:
            sys.stderr.write('\r\033[K' + line)
        else:
            sys.stderr.write(line + '\n')
        sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write('\n')
            sys.stderr.flush()


def _kill_group(proc):
    """Stop a process group we started: SIGTERM, then SIGKILL after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_group(cmd, env, timeout, on_line, log_path):
    """Run ``cmd`` in its own session, handing each stdout line to ``on_line``; bounded.

    Returns (exit status, whether it was stopped for running past ``timeout``).
    """
    expired = threading.Event()
    with open(log_path, 'ab') as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log,
                                cwd=str(_common.ROOT), start_new_session=True, text=True)

        def stop():
            expired.set()
            _kill_group(proc)
        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                on_line(line)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
            proc.stdout.close()
    return rc, expired.is_set()


def _mpiexec():
    candidate = Path(sys.executable).parent / 'mpiexec'
    if candidate.exists():
        return str(candidate)
    import shutil
    return shutil.which('mpiexec')


def _chainermn_status():
    """(mpiexec path or None, reason when ChainerMN cannot run)."""
    if importlib.util.find_spec('mpi4py') is None:
        return None, 'mpi4py is not installed'
    mpiexec = _mpiexec()
    if mpiexec is None:
        return None, 'no mpiexec next to the interpreter or on PATH'
    return mpiexec, None


def _mpiexec_cmd(mpiexec, n, thread_vars, plan):
    cmd = [mpiexec, '-n', str(n)]
    version = _common._mpiexec_version(mpiexec) or ''
    if 'Open MPI' in version or 'OpenRTE' in version or 'prte' in version.lower():
        cmd += ['--oversubscribe', '--bind-to', 'none']
        for var in thread_vars:
            cmd += ['-x', var]
    return cmd + [sys.executable, str(HERE / '_mn_worker.py'), json.dumps(plan)]


def _multiprocess_status(kind, n_gpus):
    if kind != 'gpu' or n_gpus < 2:
        return 'needs NCCL and 2+ GPUs; {} GPU(s) visible'.format(n_gpus)
    if not chainer.training.updaters.MultiprocessParallelUpdater.available():
        return 'NCCL (cupy.cuda.nccl) is not available'
    return None


def build_groups(args, kind, ns, cores):
    """One group per case: each runs in a fresh process (or one mpiexec) with its thread
    setting. Fresh processes matter on CPU: glibc malloc adapts its mmap and trim thresholds
    to the sizes a process has freed, so one process's earlier cases would change the speed
    of its later ones (by up to 60% here for 32-sample micro-batches)."""
    groups, skipped = [], []
    all_threads = _common.thread_env(cores) if kind == 'cpu' else {}
    malloc = same_malloc_env() if args.same_malloc else {}

    def add(method, n, env, processes, **extra):
        env = dict(env, **malloc)
        for k in args.ks:
            groups.append(dict(label='{} N={}'.format(_report.LABELS[method], n), env=env,
                               processes=processes, n=n,
                               cases=[{'method': method, 'n': n, 'k': k}], **extra))

    def per_replica(n):
        return _common.thread_env(_common.threads_per_process(n, cores)) if kind == 'cpu' else {}

    for method in ('standard', 'hand', 'parallel'):
        if method in args.methods:
            for n in ns:
                add(method, n, all_threads, 1)
    if 'standard_1t' in args.methods:
        if kind == 'cpu' and cores > 1:
            for n in ns:
                add('standard_1t', n, _common.thread_env(1), 1)
        else:
            skipped.append({'method': _report.LABELS['standard_1t'],
                            'reason': 'only on CPU with 2+ cores'})
    if 'multiprocess' in args.methods:
        reason = _multiprocess_status(kind, _common.gpu_count())
        if reason:
            skipped.append({'method': _report.LABELS['multiprocess'], 'reason': reason})
        else:
            for n in ns:
                if n >= 2:
                    add('multiprocess', n, {}, n)
    if 'limit' in args.methods:
        for n in ns:
            add('limit', n, per_replica(n), n)
    if 'ours' in args.methods:
        if importlib.util.find_spec('mgpu_updater') is None:
            skipped.append({'method': _report.LABELS['ours'],
                            'reason': 'mgpu_updater is not importable'})
        else:
            for n in ns:
                add('ours', n, per_replica(n), n)
    if 'chainermn' in args.methods:
        mpiexec, reason = _chainermn_status()
        if reason:
            skipped.append({'method': _report.LABELS['chainermn'], 'reason': reason})
        elif kind == 'gpu':
            skipped.append({'method': _report.LABELS['chainermn'],
                            'reason': 'the naive communicator baseline runs on CPU only'})
        else:
            for n in ns:
                add('chainermn', n, per_replica(n), n, mpiexec=mpiexec)
    # Memory: k micro-batches vs one batch of k*b (tracemalloc counts bytes, not speed, so
    # one process for every k is fine).
    groups.append({'label': 'memory', 'env': all_threads, 'processes': 1, 'n': 1,
                   'cases': [{'method': 'memory', 'n': 1, 'k': k} for k in args.ks]})
    return groups, skipped


def same_malloc_env():
    """glibc's variables for the thresholds ``reuse_host_memory`` sets (``_host_memory``);
    under them ours leaves malloc alone ('auto'), so every method runs with the same."""
    from mgpu_updater import _host_memory
    return {'MALLOC_MMAP_THRESHOLD_': str(_host_memory.MMAP_THRESHOLD),
            'MALLOC_TRIM_THRESHOLD_': str(_host_memory.TRIM_THRESHOLD)}


def _child_env(extra):
    env = dict(os.environ)
    env.update(extra)
    env['PYTHONPATH'] = os.pathsep.join(
        [str(_common.ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    if hasattr(os, 'geteuid') and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault('OMPI_ALLOW_RUN_AS_ROOT', '1')
        env.setdefault('OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', '1')
    return env


def schedule(groups, passes):
    """Run order: every group once per pass, every other pass reversed, so that a machine
    whose speed drifts during the run weighs on every method alike; memory only once."""
    order = []
    for p in range(passes):
        run = [g for g in groups if p == 0 or g['label'] != 'memory']
        order += [(p, g) for g in (run if p % 2 == 0 else run[::-1])]
    return order


def run_groups(args, order, common, workdir):
    """Run the scheduled groups; returns (records of finished cases, error records)."""
    records, errors = [], []
    progress = Progress(sum(len(g['cases']) for _, g in order))

    def on_record(record, group, p, seen):
        if record.get('event') not in ('case', 'error'):
            return
        record.update({'pass': p, 'processes': group['processes'], 'thread_env': group['env']})
        seen.add((record['method'], record['n'], record.get('k')))
        if 'error' in record:
            errors.append(record)
            progress.show('{} k={}: FAILED'.format(group['label'], record.get('k')), 1)
        else:
            records.append(record)
            rate = record.get('samples_per_s')
            text = ('{:.1f} samples/s'.format(_common.summarize(rate)['median'])
                    if rate else 'done')
            progress.show('{} k={}: {}'.format(group['label'], record['k'], text), 1)

    for i, (p, group) in enumerate(order):
        ks = ','.join(str(c['k']) for c in group['cases'])
        progress.show('{} k={} ...'.format(group['label'], ks))
        log_path = os.path.join(workdir, 'group{}.log'.format(i))
        env = _child_env(group['env'])
        seen = set()
        if 'mpiexec' in group:
            out = os.path.join(workdir, 'chainermn{}.jsonl'.format(i))
            plan = {'common': common, 'ks': [c['k'] for c in group['cases']], 'out': out}
            cmd = _mpiexec_cmd(group['mpiexec'], group['n'], list(group['env']), plan)
            rc, timed_out = run_group(cmd, env, args.case_timeout, lambda line: None, log_path)
            if os.path.exists(out):
                with open(out) as f:
                    for line in f:
                        on_record(json.loads(line), group, p, seen)
        else:
            plan = {'common': common, 'cases': group['cases']}
            cmd = [sys.executable, str(HERE / '_case.py'), json.dumps(plan)]

            def on_line(line, group=group, p=p, seen=seen):
                line = line.strip()
                if line.startswith('{'):
                    on_record(json.loads(line), group, p, seen)
            rc, timed_out = run_group(cmd, env, args.case_timeout, on_line, log_path)
        missing = [c for c in group['cases'] if (c['method'], c['n'], c['k']) not in seen]
        if missing:
            with open(log_path, errors='replace') as f:
                tail = f.read()[-3000:]
            why = 'timed out after {:.0f}s'.format(args.case_timeout) if timed_out else \
                'exited with status {}'.format(rc)
            for case in missing:
                errors.append(dict(case, error='{}; log tail:\n{}'.format(why, tail),
                                   processes=group['processes'], thread_env=group['env']))
                progress.show('{} k={}: {}'.format(group['label'], case['k'], why), 1)
    progress.close()
    return records, errors


def merge_passes(records):
    """One record per (method, n, k): rounds and reported per-update times of every pass
    pooled."""
    merged = {}
    for record in sorted(records, key=lambda r: r['pass']):
        key = (record['method'], record['n'], record['k'])
        if key not in merged:
            merged[key] = dict(record, passes=1,
                               times_per_update=dict(record.get('times_per_update', {})))
            continue
        m = merged[key]
        m['passes'] += 1
        m['samples_per_s'] = m['samples_per_s'] + record['samples_per_s']
        m['wall_s'] += record['wall_s']
        for key, values in record.get('times_per_update', {}).items():
            pooled = m.setdefault('times_per_update', {})
            pooled[key] = pooled.get(key, []) + values
    return list(merged.values())


def _row(record, micro_batch):
    summary = _common.summarize(record['samples_per_s'])
    row = {
        'method': record['method'], 'n': record['n'], 'k': record['k'],
        'micro_batch': micro_batch, 'global_batch': record['n'] * record['k'] * micro_batch,
        'samples_per_s': summary['median'], 'samples_per_s_min': summary['min'],
        'samples_per_s_max': summary['max'], 'rounds': record['samples_per_s'],
        'processes': record['processes'], 'thread_env': record['thread_env'],
        'wall_s': record['wall_s'],
    }
    times = record.get('times_per_update')
    if times:
        # Medians: the typical update; means: stragglers and hiccups included. On the master,
        # time/comm covers the reduce and the wait for the slowest replica, so its median is
        # close to the transfer itself and its mean adds the waits.
        row['times'] = {key: statistics.median(v) for key, v in times.items()}
        row['times_mean'] = {key: statistics.fmean(v) for key, v in times.items()}
        row['step_time'] = row['global_batch'] / summary['median']  # seconds per update
        if 'comm' in times:
            row['comm_share'] = row['times']['comm'] / row['step_time']
            row['comm_share_mean'] = row['times_mean']['comm'] / row['step_time']
    row['passes'] = record['passes']
    return row


def main(argv=None):
    args = parse_args(argv)
    cores = _common.cpu_count()
    n_gpus = _common.gpu_count()
    kind = 'gpu' if n_gpus else 'cpu'
    available = n_gpus or cores
    ns = _int_list(args.devices) if args.devices else default_device_counts(available)
    max_global = max(ns) * max(args.ks) * args.micro_batch
    common = {'model': args.model, 'micro_batch': args.micro_batch, 'device_kind': kind,
              'warmup': args.warmup, 'rounds': args.rounds, 'updates': args.updates,
              'dataset_size': _common.dataset_size(max_global)}
    groups, skipped = build_groups(args, kind, ns, cores)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = _common.machine_info()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='mgpu-bench-') as workdir:
        records, errors = run_groups(args, schedule(groups, args.passes), common, workdir)
    records = merge_passes(records)
    rows = _report.derive([_row(r, args.micro_batch) for r in records
                           if r['method'] != 'memory'])
    memory = sorted((r for r in records if r['method'] == 'memory'), key=lambda r: r['k'])
    drop = ('event', 'processes', 'thread_env', 'method', 'n', 'pass', 'passes')
    memory = [{key: value for key, value in r.items() if key not in drop} for r in memory]
    for m in memory:
        m['micro_batch'] = args.micro_batch
    machine['loadavg_end'] = _common.loadavg()
    mpiexec = _mpiexec()
    notes = []
    spreads = [(r['samples_per_s_max'] - r['samples_per_s_min']) / r['samples_per_s']
               for r in rows]
    if spreads:
        notes.append('Spread of the rounds, (max - min) / median: {:.0%} for the median row, '
                     '{:.0%} at worst. Differences smaller than that (such as the 2% of the '
                     'one-replica goals) are not resolved by this run; more --passes help.'
                     .format(statistics.median(spreads), max(spreads)))
    if (machine['loadavg_start'] or 0) > 0.5:
        notes.append('The machine was not idle (1-minute load average {} on {} cores before '
                     'the benchmark started): other work skews these figures.'
                     .format(machine['loadavg_start'], cores))
    if args.same_malloc:
        notes.append('--same-malloc: every method ran with `{}` in its environment, the '
                      'thresholds that ours sets by default, so none of them gives freed '
                      'memory back to the kernel each micro-batch.'.format(' '.join(
                          '{}={}'.format(k, v) for k, v in same_malloc_env().items())))
    elif 'ours' in args.methods:
        notes.append('Ours ran with its default `reuse_host_memory=\'auto\'` (its processes '
                     'keep the memory they free); the other methods with glibc\'s defaults. '
                     '`--same-malloc` gives them all the same thresholds.')
    if 'parallel' in args.methods:
        notes.append('ParallelUpdater in Chainer {} runs its replicas one after another in one '
                     'process (no threads), then sums their gradients on the main replica.'
                     .format(chainer.__version__))
    if 'chainermn' in args.methods and mpiexec:
        notes.append('ChainerMN: `{}` with the naive communicator, {} threads per rank.'.format(
            ' '.join(shlex.quote(p) for p in _mpiexec_cmd(mpiexec, 'N', [], {})[:-2]),
            'cores // N'))
    result = {
        'schema': SCHEMA,
        'config': {
            'command': 'python bench/scaling.py ' + ' '.join(
                shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
            'profile': args.profile, 'model': args.model,
            'model_source': _common.model_source(args.model),
            'micro_batch': args.micro_batch, 'accumulate_steps': args.ks, 'devices': ns,
            'device_kind': kind, 'warmup': args.warmup, 'rounds': args.rounds,
            'updates_per_round': args.updates, 'passes': args.passes,
            'dataset_size': common['dataset_size'], 'methods': args.methods,
            'same_malloc': args.same_malloc,
        },
        'machine': machine,
        'versions': _common.versions(mpiexec),
        'threads': {
            'variables': list(_common.THREAD_VARS),
            'single_process': cores if kind == 'cpu' else 'default',
            'per_replica': {str(n): (_common.threads_per_process(n, cores) if kind == 'cpu'
                                     else 'default') for n in ns},
        },
        'rows': rows,
        'memory': memory,
        'goals': _report.goals(rows, args.ks),
        'skipped': skipped,
        'errors': errors,
        'notes': notes,
        'out_dir': str(out_dir),
        'wall_s': time.perf_counter() - start,
    }
    _common.write_results(out_dir, 'scaling', result, _report.markdown, _report.plot)
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
