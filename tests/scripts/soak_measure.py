"""The soak measurement: thousands of updates of a small model on CPU replicas, watching
for leaks.

Every ``every`` updates :func:`soak` samples, for the master and each worker: the resident
set size (``VmRSS``), the open file descriptors, the sockets among them, and the
shared-memory segments mapped (``/dev/shm/mgpu_*``). At the end it checks, between update
``start`` and the last:

- RSS grew by less than 5 % in every process;
- the number of open fds and of mapped segments did not change;
- no process holds a TCP/UDP socket or a listening Unix socket (the control pipes of
  ``multiprocessing`` are connected Unix socket pairs, nothing else);
- segment names carry 128 random bits (``mgpu_`` + 32 hex digits).

tests/test_faults.py runs a short soak (``slow``); ``tools/soak.py`` runs a long one and
prints the figures: the tools depend on the tests' scripts, never the reverse.
"""
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent   # the repository root
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RSS_GROWTH_LIMIT = 0.05
UNIX_LISTENING = 0x10000   # __SO_ACCEPTCON in the Flags column of /proc/net/unix


def rss_kib(pid):
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1])
    raise RuntimeError(f'no VmRSS for pid {pid}')


def fd_links(pid):
    links = {}
    for fd in os.listdir(f'/proc/{pid}/fd'):
        try:
            links[int(fd)] = os.readlink(f'/proc/{pid}/fd/{fd}')
        except FileNotFoundError:   # closed meanwhile
            pass
    return links


def _net_inodes(table):
    """Socket inode -> the row of /proc/net/<table> (empty when the table is missing)."""
    try:
        with open(f'/proc/net/{table}') as f:
            rows = f.read().splitlines()[1:]
    except FileNotFoundError:
        return {}
    column = 6 if table == 'unix' else 9
    out = {}
    for row in rows:
        fields = row.split()
        if len(fields) > column:
            out[fields[column]] = fields
    return out


def sockets(pid):
    """The sockets ``pid`` holds: {'unix': n, 'unix_listening': n, 'inet': [...], ...}."""
    inodes = [re.match(r'socket:\[(\d+)\]', link).group(1)
              for link in fd_links(pid).values() if link.startswith('socket:[')]
    unix = _net_inodes('unix')
    inet = {}
    for table in ('tcp', 'tcp6', 'udp', 'udp6', 'raw', 'raw6'):
        inet.update({inode: table for inode in _net_inodes(table)})
    out = {'total': len(inodes), 'unix': 0, 'unix_listening': 0, 'inet': [], 'other': 0}
    for inode in inodes:
        if inode in inet:
            out['inet'].append(inet[inode])
        elif inode in unix:
            out['unix'] += 1
            if int(unix[inode][3], 16) & UNIX_LISTENING:
                out['unix_listening'] += 1
        else:
            out['other'] += 1
    return out


def mapped_segments(pid):
    names = set()
    with open(f'/proc/{pid}/maps') as f:
        for line in f:
            if '/dev/shm/mgpu_' in line:
                names.add(line.split('/dev/shm/', 1)[1].split()[0])
    return sorted(names)


def sample(pids):
    return {str(pid): {'rss_kib': rss_kib(pid), 'fds': len(fd_links(pid)),
                       'sockets': sockets(pid), 'segments': mapped_segments(pid)}
            for pid in pids}


def build(replicas, batch_size, accumulate_steps):
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators  # shim first
    import chainer
    import chainer.functions as F
    import chainer.links as L
    import numpy
    rng = numpy.random.RandomState(0)
    x = rng.rand(4096, 16).astype(numpy.float32)
    t = (x[:, :4].argmax(axis=1)).astype(numpy.int32)
    model = L.Classifier(chainer.Sequential(L.Linear(16, 32), F.relu, L.Linear(32, 4)))
    optimizer = chainer.optimizers.MomentumSGD(lr=0.05)
    optimizer.setup(model)
    iterators = shard_iterators(chainer.datasets.TupleDataset(x, t), replicas, batch_size)
    return ParallelAccumulatingUpdater(iterators, optimizer, devices=['@numpy'] * replicas,
                                       accumulate_steps=accumulate_steps)


def soak(updates=5000, start=500, every=500, replicas=2, batch_size=8, accumulate_steps=2,
         log=print):
    """Run the soak; returns a dict with the samples, the figures and ``problems``."""
    import chainer
    updater = build(replicas, batch_size, accumulate_steps)
    samples = {}
    reporter = chainer.Reporter()
    t0 = time.perf_counter()
    try:
        for i in range(1, updates + 1):
            with reporter.scope({}):
                updater.update()
            if i == 1:
                pids = [os.getpid()] + updater.worker_pids()
            if i % every == 0 or i == start or i == updates:
                samples[i] = sample(pids)
                s = samples[i]
                log(f'update {i:6d}  ' + '  '.join(
                    f'pid {p}: rss {v["rss_kib"] / 1024:.1f} MiB, fds {v["fds"]}, '
                    f'shm {len(v["segments"])}' for p, v in s.items()))
        seconds = time.perf_counter() - t0
    finally:
        updater.finalize()
    first, last = samples[start], samples[updates]
    problems = []
    figures = {'updates': updates, 'from': start, 'replicas': replicas, 'seconds': seconds,
               'updates_per_s': updates / seconds, 'processes': {}}
    for pid in first:
        a, b = first[pid], last[pid]
        growth = (b['rss_kib'] - a['rss_kib']) / a['rss_kib']
        role = 'master' if pid == str(pids[0]) else f'worker {pids.index(int(pid))}'
        figures['processes'][pid] = {
            'role': role, 'rss_mib_from': a['rss_kib'] / 1024, 'rss_mib_end': b['rss_kib'] / 1024,
            'rss_growth': growth, 'fds_from': a['fds'], 'fds_end': b['fds'],
            'fds_seen': sorted({samples[i][pid]['fds'] for i in samples if i >= start}),
            'segments': len(b['segments']), 'sockets': b['sockets']}
        if growth >= RSS_GROWTH_LIMIT:
            problems.append(f'{role}: RSS grew {growth:.1%} from update {start} to {updates}')
        seen = {samples[i][pid]['fds'] for i in samples if i >= start}
        if len(seen) != 1:
            problems.append(f'{role}: open fds changed: {sorted(seen)}')
        segs = {tuple(samples[i][pid]['segments']) for i in samples if i >= start}
        if len(segs) != 1:
            problems.append(f'{role}: mapped segments changed')
        for i in samples:
            sock = samples[i][pid]['sockets']
            if sock['inet'] or sock['unix_listening'] or sock['other']:
                problems.append(f'{role} at update {i}: sockets {sock}')
                break
        for name in b['segments']:
            if not re.fullmatch(r'mgpu_[0-9a-f]{32}', name):
                problems.append(f'segment name {name!r} is not mgpu_ + 128 random bits')
    segments = sorted({n for v in last.values() for n in v['segments']})
    figures['segments'] = segments
    left = [n for n in segments if os.path.exists('/dev/shm/' + n)]
    if left:
        problems.append(f'segments left after finalize: {left}')
    figures['segments_left_after_finalize'] = left
    import multiprocessing
    if multiprocessing.active_children():
        problems.append(f'children left: {multiprocessing.active_children()}')
    return {'figures': figures, 'samples': samples, 'problems': problems}


def format_figures(figures):
    lines = [f'{figures["updates"]} updates on {figures["replicas"]} replicas in '
             f'{figures["seconds"]:.1f} s ({figures["updates_per_s"]:.0f} updates/s); '
             f'figures from update {figures["from"]} to the end:']
    for pid, p in figures['processes'].items():
        s = p['sockets']
        lines.append(
            f'  {p["role"]:<9} pid {pid}: RSS {p["rss_mib_from"]:.1f} -> {p["rss_mib_end"]:.1f} '
            f'MiB ({p["rss_growth"]:+.2%}), fds {p["fds_from"]} -> {p["fds_end"]}, '
            f'shm segments mapped {p["segments"]}, sockets {s["total"]} (unix {s["unix"]}, '
            f'listening {s["unix_listening"]}, inet {len(s["inet"])})')
    lines.append(f'  segments: {", ".join(figures["segments"])}; left after finalize: '
                 f'{len(figures["segments_left_after_finalize"])}')
    return '\n'.join(lines)
