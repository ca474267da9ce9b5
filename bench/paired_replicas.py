"""Two replicas, paired: ours, ChainerMN and the limit taking turns of a few updates.

    python bench/paired_replicas.py [--ks 1,4,8] [--rounds N] [--block 4] [--model cnn]
                                    [--out DIR]

``scaling.py`` runs each method in fresh processes, one after another, and on a VM whose
speed drifts by 20-50% from one stretch to the next its rounds spread by 30% and more;
``timeline.py`` alternates blocks of 20 updates and still reads the same forward/backward
from 50 to 90 ms between neighbouring blocks. Here every method's processes start once and
stay alive, and the methods take turns a few updates at a time (``--block``, below), the
order shuffled each round (seeded), so that a slow stretch weighs on all of them alike, as
``paired.py`` does for one replica:

- **ours**: ``ParallelAccumulatingUpdater`` on two ``'@numpy'`` replicas, ``k``
  micro-batches of ``b`` each, with ``--compare``'s arguments (``ours``, the first) and
  with the defaults (``ours_default``): two updaters, each with its own worker process, in
  this process. Without ``--compare`` both have the defaults, and their ratio is what the
  bench reads between two identical updaters (an A/A check).
- **ChainerMN** (``naive`` communicator, ``mpiexec -n 2``): ``StandardUpdater`` over
  ``create_multi_node_optimizer`` at ``k*b`` samples per rank, as ChainerMN's examples run.
- **the limit**: in the same two MPI processes, each rank the hand-written loop (``k``
  micro-batches of ``b``, one optimizer step) on a model of its own, with no communication:
  what two replicas could reach at best. Its time per update is the one that gives the
  two loops' summed samples/s (``scaling.py``'s definition): 2 / (1/t0 + 1/t1). Beside it,
  ``limit_lockstep``, max(t0, t1): what the same two loops take when each update waits for
  the slower one, as synchronous data parallelism must, with no communication at all; ours /
  it is what communication and the protocol cost, it / the limit what the lockstep costs.
- **the limit on ours' weights** (``limit_same``, added in ``paired_replicas/4``): the
  same loops, each on a third model of its rank that, before each of its updates (and
  outside its timing), takes the weights of the rank's ChainerMN model: ours' weights, to
  rounding. Why: what forward/backward takes depends on the weights it computes with. In
  one process, on one batch, two copies of the CNN after 400 updates from the same start,
  one trained as ours is (64 samples an update), one as a limit loop is (32), computed their
  forward/backward 1.036x and 1.056x apart (the weights copied into fresh arrays: the
  same; 1.000 between a model and its copy): the limit's own loops, whose weights part
  from ours', do not compute what ours computes. This limit does, with its own optimizer
  (its own momentum) and its own samples as before; the copy leaves its weights warm in
  the cache, which if anything favours it. Both limits are reported.

The same work: every rank reads the shard ours' replica of that rank reads
(:func:`own_shard`: ``shard_iterators``, seed 0; ChainerMN one batch of ``k*b`` where ours
reads ``k`` micro-batches of ``b``, the same samples in the same order), every model starts
from the same weights, and ChainerMN's first update steps too (its optimizer would spend it
on broadcasting the weights: done before). So ours and ChainerMN step on the same batches
from the same weights. The row records ours' weights against ChainerMN's (relative
differences of their checksums) after every method's first turn, where they must agree to
rounding (``weights_rel_diff_after_first_turn``, since ``paired_replicas/8``), and at the
end. At k=1 the two compute alike and end equal; at k > 1 ours sums ``k`` micro-batches'
gradients where ChainerMN has one batch's, their rounding differs, and on this random data
the difference grows with the updates (the runs of ``paired_replicas/7`` ended 5% apart in
their checksums at k=4, 60% at k=8). The limit's loops read the same samples but step
alone, so their weights part.
Why: what an update computes on can move its time by about the size of the goals here
(``sample_order.py``; ``paired.py``'s docstring). Before ``paired_replicas/2`` ChainerMN
read ``scatter_dataset``'s shards, the limit data of its own, and ChainerMN stepped once
less.

Whoever's turn it is not waits in a blocking read (a socket, or a worker's pipe), so it
takes no CPU. (A process that polled between its updates would take CPU from the next
method's turn, and this bench shows it: a worker that looked for its next Step for 5 ms
before blocking made the method after it 3% slower here.) Every process runs one BLAS
thread and the same malloc thresholds. Each round gives ratios of times (above 1: the first
is slower); each ratio's median comes with a 95% bootstrap interval over the rounds, and
issue 15's goals are judged on the whole interval: ours ahead of ChainerMN where it lies
below 1, at >= 95% of the limit (in samples/s) where limit / ours lies at or above 0.95.

Each round also splits every update into the slower replica's forwards and backwards (ours:
``updater.last_replica_times``, each replica's own window compute; the limit: its loops'
own timing, loading and step left out) and the rest: whether ours loses its time in the
windows or outside them. (Added in ``paired_replicas/3``.)

A turn is ``--block`` updates of one method (default 4, since ``paired_replicas/5``): the
first warms the method and is not timed, the others' times are averaged (:func:`blocked`).
Why: with five methods taking turns, each of ours' processes sits idle for four turns out of
five and each MPI rank for two, and the first update after such a pause computes slower
(its caches and the interpreter's are the other methods' by then), which a trainer, whose
updates follow each other, never sees. With one update a turn (``--block 1``, the bench up
to ``/4``) ours' windows read 1.010-1.018 of the same loops on the same weights at k=1
(``/4``'s three runs, and 1.010 (1.004-1.016) once more on 2026-12-02); with blocks of 4 on
the same day, 0.995, 1.006 and 0.995 (``bench/results/paired-replicas-5`` as of commit
``7b3c228``; superseded runs are kept in git's history) and 1.000 in two runs not kept.

``--compare KEY=VALUE[,KEY=VALUE...]`` builds the first updater with those arguments,
labelled with them: an A/B of two settings in one run, e.g. ``--compare prefetch=2``
reads the old loader against the default (the row "ours (prefetch=2) / ours (defaults)").

Prints a Markdown table; with ``--out`` writes ``paired_replicas.json`` and
``paired_replicas.md`` there.
"""
import argparse
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = 'mgpu_updater.bench.paired_replicas/8'
CHILD = 'MGPU_BENCH_PAIRED_REPLICAS'   # set in the re-run process that does the work
MALLOC = {'MALLOC_MMAP_THRESHOLD_': str(32 << 20), 'MALLOC_TRIM_THRESHOLD_': str(1 << 30)}
TIMEOUT = 600.0     # seconds any one wait for another process may take
LIMIT_EFFICIENCY = 0.95   # issue 15: two replicas at >= 95% of the limit's samples/s

# A turn: the coordinator sends one command byte to every rank; each answers with two
# doubles: the seconds its update took, and those of its forwards and backwards (the
# limit's loop; NaN for ChainerMN). 'q' ends the ranks.
CHAINERMN, LIMIT, LIMIT_SAME, QUIT = b'm', b'l', b's', b'q'
WEIGHTS = b'w'   # answered with a checksum of the rank's ChainerMN model (and a NaN)
NAN = float('nan')

# The ratios reported: (key, label, numerator, denominator, verdict): issue 15's goals,
# and (verdict None) the figures that say where a difference comes from.
RATIOS = (
    ('ours/chainermn', 'ours (first) / ChainerMN', 'ours', 'chainermn', 'ahead'),
    ('ours_default/chainermn', 'ours (defaults) / ChainerMN', 'ours_default',
     'chainermn', 'ahead'),
    ('limit/ours', 'the limit / ours (first)', 'limit', 'ours', 'limit'),
    ('limit/ours_default', 'the limit / ours (defaults)', 'limit', 'ours_default',
     'limit'),
    ('ours/ours_default', 'ours (first) / ours (defaults)', 'ours',
     'ours_default', 'ahead'),
    ('limit_same/ours_default', 'the limit on ours\' weights / ours (defaults)',
     'limit_same', 'ours_default', 'limit'),
    ('limit/chainermn', 'the limit / ChainerMN (for scale)', 'limit', 'chainermn', None),
    ('limit_same/limit', 'the limit on ours\' weights / the limit (what the weights do)',
     'limit_same', 'limit', None),
    ('limit_lockstep/limit', 'the limit in lockstep / the limit (what the lockstep costs)',
     'limit_lockstep', 'limit', None),
    ('ours/limit_lockstep', 'ours (first) / the limit in lockstep (what '
     'communication costs)', 'ours', 'limit_lockstep', None),
    ('ours_default/limit_lockstep', 'ours (defaults) / the limit in lockstep',
     'ours_default', 'limit_lockstep', None),
    ('window:ours_default/window:limit', 'ours (defaults): the slower replica\'s '
     'forward/backward / the limit\'s', 'window:ours_default', 'window:limit', None),
    ('outside:ours_default/outside:limit', 'ours (defaults): the update less that '
     '/ the limit in lockstep\'s', 'outside:ours_default', 'outside:limit', None),
    ('window:ours_default/window:limit_same', 'ours (defaults): the slower '
     'replica\'s forward/backward / the limit\'s on ours\' weights',
     'window:ours_default', 'window:limit_same', None),
)


def verdict(kind, low, high):
    """Issue 15's reading of a ratio's 95% interval: 'ahead' (a time ratio below 1) or
    'limit' (limit time / ours' time, which is ours' share of the limit's samples/s, at or
    above 0.95); None: a figure that judges no goal."""
    if kind is None:
        return '-'
    if kind == 'ahead':
        return 'ahead' if high < 1 else 'behind' if low > 1 else 'not resolved'
    if low >= LIMIT_EFFICIENCY:
        return 'at >= 95%'
    return 'below 95%' if high < LIMIT_EFFICIENCY else 'not resolved'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--ks', default='1,4,8', help='accumulate_steps values (default 1,4,8)')
    p.add_argument('--rounds', type=int, default=None,
                   help='timed rounds per k (default ceil(400 / k))')
    p.add_argument('--warmup', type=int, default=5, help='untimed rounds first (default 5)')
    p.add_argument('--model', default='cnn', choices=('cnn', 'mlp', 'tiny'))
    p.add_argument('--micro-batch', type=int, default=32)
    p.add_argument('--block', type=int, default=4,
                   help='updates per turn of a method: the first warms it and is not timed, '
                        'the others are averaged (default 4; 1: one timed update a turn)')
    p.add_argument('--out', help='folder for paired_replicas.json and paired_replicas.md')
    p.add_argument('--compare', metavar='KEY=VALUE,...', default='',
                   help='build the first updater with these arguments instead of the '
                        'defaults (e.g. prefetch=2)')
    p.add_argument('--rank-of', help=argparse.SUPPRESS)   # an MPI rank: the socket's path
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(',') if k]
    try:
        args.first_kwargs = first_kwargs(args.compare)
    except ValueError as exc:
        p.error('--compare: {}'.format(exc))
    if ((args.rounds is not None and args.rounds < 2) or args.warmup < 1 or not args.ks
            or min(args.ks) < 1 or args.micro_batch < 1 or args.block < 1):
        p.error('--rounds must be >= 2, --warmup, --micro-batch, --block and every k >= 1')
    return args


def first_kwargs(compare):
    """The first updater's arguments: ``--compare``'s ``KEY=VALUE`` pairs (values as
    Python literals, else strings); none: the defaults."""
    import ast
    kwargs = {}
    if not compare:
        return kwargs
    for pair in compare.split(','):
        key, sep, value = pair.partition('=')
        if not sep or not key.strip().isidentifier():
            raise ValueError('{!r} is not KEY=VALUE (e.g. prefetch=2)'.format(pair))
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    return kwargs


def first_label(result):
    """What the first updater is called in the tables."""
    compare = result.get('compare')
    return 'ours ({})'.format(compare) if compare else 'ours (first, defaults)'


# ------------------------------------------------------------------------- the MPI ranks
def serve_rank(args):
    """One MPI rank: ChainerMN's update and one of the limit's loops, each built per k, run
    one update at a time when the coordinator says so (a blocking read between updates)."""
    import chainer
    import chainermn
    from bench import _case, _common
    comm = chainermn.create_communicator('naive')
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.rank_of)
    sock.sendall(struct.pack('i', comm.rank))
    b = args.micro_batch
    for k in args.ks:
        dataset = _common.make_dataset(_common.dataset_size(2 * k * b))
        model = _common.make_model(args.model)
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.01), comm)
        optimizer.setup(model)
        # ChainerMN's first update broadcasts rank 0's weights instead of stepping
        # (chainermn/optimizers.py, _MultiNodeOptimizer.update: is_changed): done here,
        # so that its every update steps, as ours' does, and the two stay on the same work
        comm.bcast_data(model)
        optimizer.is_changed(model)
        mn_step = _case._observed_step(chainer.training.updaters.StandardUpdater(
            own_shard(dataset, comm, k * b), optimizer), model)
        own = _common.make_model(args.model)
        fwd_bwd = []
        own_step = _case._observed_step(
            _Loop(own, own_shard(dataset, comm, b), k, fwd_bwd), own)
        same = _common.make_model(args.model)
        same_step = _case._observed_step(
            _Loop(same, own_shard(dataset, comm, b), k, fwd_bwd), same)
        pairs = [(mine.array, theirs.array) for (_, mine), (_, theirs) in zip(
            sorted(same.namedparams()), sorted(model.namedparams()))]
        steps = {CHAINERMN: mn_step, LIMIT: own_step, LIMIT_SAME: same_step}
        while True:
            command = _recv_exactly(sock, 1)
            if command == QUIT:
                break
            if command == WEIGHTS:
                sock.sendall(struct.pack('dd', weights_checksum(model), NAN))
                continue
            if command == LIMIT_SAME:   # ours' weights (ChainerMN's), before the clock
                for mine, theirs in pairs:
                    mine[...] = theirs
            start = time.perf_counter()
            steps[command]()
            seconds = time.perf_counter() - start
            sock.sendall(struct.pack('dd', seconds, NAN if command == CHAINERMN
                                     else fwd_bwd[-1]))
    sock.close()


def own_shard(dataset, comm, batch):
    """This rank's shard of ``dataset`` as ours' replica of the same rank reads it
    (``shard_iterators``, seed 0), in batches of ``batch``: k micro-batches of b of ours are
    one batch of k*b here, the same samples in the same order."""
    import chainer
    from mgpu_updater import shard_iterators
    return shard_iterators(dataset, n=comm.size, batch_size=batch,
                           iterator_class=chainer.iterators.SerialIterator, seed=0,
                           shuffle=True)[comm.rank]


def weights_checksum(model):
    """The sum of every weight, in float64: equal (to rounding) for equal weights."""
    return float(sum(p.array.astype('float64').sum() for p in model.params()))


def _rel_diffs(ours, mn_weights):
    """Each of ours' models' checksum against the first ChainerMN rank's, relative."""
    return {name: abs(weights_checksum(model) - mn_weights[0]) / abs(mn_weights[0])
            for name, (_, _, model) in ours.items()}


class _Loop:
    """The hand-written accumulation loop (``bench._case``'s) as an object with
    ``update()``, for ``_observed_step``."""

    def __init__(self, model, iterator, k, fwd_bwd=None):
        from bench import _case, _common
        self.update = _case._hand_step(model, _common.make_optimizer(model), iterator, k,
                                       '@numpy', fwd_bwd)


def blocked(turn, block):
    """A method's turn of ``block`` updates: the first warms the method's processes (in
    turn with four other methods, each process of ours' sits idle for four turns, a rank of
    the MPI job for two) and is not timed; the others' times are averaged, key by key
    (a turn gives seconds, or a dict of them). ``block`` 1: one update, timed."""
    if block == 1:
        return turn

    def run():
        turn()
        values = [turn() for _ in range(block - 1)]
        if isinstance(values[0], dict):
            return {key: statistics.fmean(v[key] for v in values) for key in values[0]}
        return statistics.fmean(values)
    return run


def _recv_exactly(sock, n):
    data = b''
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError('the other side closed the connection')
        data += chunk
    return data


# --------------------------------------------------------------------------- coordinator
class Ranks:
    """``mpiexec -n 2`` running :func:`serve_rank`, connected over a Unix socket."""

    def __init__(self, args, folder, env):
        from bench import _common
        from bench.scaling import _mpiexec_cmd, _mpiexec
        mpiexec = _mpiexec()
        path = os.path.join(folder, 'ranks.sock')
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(2)
        self.listener.settimeout(1.0)
        cmd = _mpiexec_cmd(mpiexec, 2, list(_common.THREAD_VARS) + list(MALLOC), {})[:-3]
        cmd += [sys.executable, str(Path(__file__).resolve()), '--rank-of', path,
                '--ks', ','.join(map(str, args.ks)), '--model', args.model,
                '--micro-batch', str(args.micro_batch)]
        self.log = open(os.path.join(folder, 'ranks.log'), 'w+')
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.socks = [None, None]
        try:
            deadline = time.monotonic() + TIMEOUT
            while None in self.socks:
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError('the MPI ranks did not start ({}); their '
                                           'output:\n{}'.format(
                                               'exit status {}'.format(self.proc.returncode)
                                               if self.proc.poll() is not None
                                               else 'timed out', self.output())) from None
                    continue
                conn.settimeout(TIMEOUT)
                rank, = struct.unpack('i', _recv_exactly(conn, 4))
                self.socks[rank] = conn
        except Exception:
            self.close()
            raise

    def turn(self, command):
        """Both ranks run one update of ``command``; returns the seconds each took (their
        forwards' and backwards': :attr:`windows`)."""
        try:
            for sock in self.socks:
                sock.sendall(command)
            answers = [struct.unpack('dd', _recv_exactly(sock, 16)) for sock in self.socks]
            self.windows = [window for _, window in answers]
            return [seconds for seconds, _ in answers]
        except Exception as e:
            raise RuntimeError('the MPI ranks failed ({}); their output:\n{}'.format(
                e, self.output())) from e

    def next_k(self):
        for sock in self.socks:
            sock.sendall(QUIT)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def close(self):
        for sock in self.socks:
            if sock is not None:
                sock.close()
        self.listener.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def measure(k, args, ranks):
    """Timed rounds at ``k``: every method's seconds per update, and the ratios."""
    from bench import _case, _common
    b = args.micro_batch
    rounds = args.rounds or -(-400 // k)
    dataset = _common.make_dataset(_common.dataset_size(2 * k * b))
    ours = {}
    for name, kwargs in (('ours', args.first_kwargs),
                         ('ours_default', {})):
        model = _common.make_model(args.model)
        updater = _case._our_updater(model, dataset, 'cpu', 2, b, accumulate_steps=k,
                                     **kwargs)
        ours[name] = (updater, _case._observed_step(updater, model), model)

    def ours_turn(name, updater, step):
        def run():
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            # the slower replica's forwards and backwards, as each replica timed its own
            window = max(t['compute'] for t in updater.last_replica_times)
            return {name: seconds, 'window:' + name: window,
                    'outside:' + name: seconds - window}
        return run

    def limit_turn(name, command):
        def run():
            t0, t1 = ranks.turn(command)
            window = max(ranks.windows)
            return {name: 2 / (1 / t0 + 1 / t1), name + '_lockstep': max(t0, t1),
                    'window:' + name: window, 'outside:' + name: max(t0, t1) - window}
        return run

    methods = [(name, ours_turn(name, updater, step))
               for name, (updater, step, _) in ours.items()]
    methods += [('chainermn', lambda: ranks.turn(CHAINERMN)[0]),
                ('limit', limit_turn('limit', LIMIT)),
                ('limit_same', limit_turn('limit_same', LIMIT_SAME))]
    methods = [(name, blocked(turn, args.block)) for name, turn in methods]
    times = {name: [] for name in list(ours) + ['chainermn', 'limit', 'limit_lockstep',
                                                'limit_same', 'limit_same_lockstep']}
    for name in list(ours) + ['limit', 'limit_same']:
        times['window:' + name], times['outside:' + name] = [], []
    try:
        order, shuffle = list(methods), random.Random(0).shuffle
        for i in range(args.warmup + rounds):
            shuffle(order)   # (rotated until paired_replicas/7: each after the same other)
            for name, turn in order:
                seconds = turn()
                if i >= args.warmup:
                    for key, value in (seconds.items() if isinstance(seconds, dict)
                                       else [(name, seconds)]):
                        times[key].append(value)
            if i == 0:   # every method's first turn: the same updates on the same samples
                first_turn = _rel_diffs(ours, ranks.turn(WEIGHTS))
        mn_weights = ranks.turn(WEIGHTS)
        ranks.next_k()
    finally:
        for updater, _, _ in ours.values():
            updater.finalize()
    # the same work: ours and ChainerMN stepped on the same samples from the same weights
    ours_weights = {name: weights_checksum(model) for name, (_, _, model) in ours.items()}
    medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    row = {'k': k, 'rounds': rounds,
           'ms': {name: ms for name, ms in medians.items() if ':' not in name},
           # per round: the slower replica's forwards and backwards (ours: as each
           # replica timed its own window's compute; the limit: its loops), and the
           # update less that (the limit: in lockstep)
           'window_ms': {name.split(':')[1]: ms for name, ms in medians.items()
                         if name.startswith('window:')},
           'outside_ms': {name.split(':')[1]: ms for name, ms in medians.items()
                          if name.startswith('outside:')},
           'weights_checksum': {'chainermn_ranks': mn_weights, **ours_weights},
           'weights_rel_diff_after_first_turn': first_turn,
           'weights_rel_diff_to_chainermn': _rel_diffs(ours, mn_weights),
           'ratios': {}}
    for key, _, a, b_, kind in RATIOS:
        summary = _common.ratio_summary([x / y for x, y in zip(times[a], times[b_])])
        summary['verdict'] = verdict(kind, *summary['ci95'])
        row['ratios'][key] = summary
    return row


def markdown(result):
    lines = ['# Two replicas, paired: ours, ChainerMN and the limit taking turns', '',
             '`{}`'.format(result['command']), '',
             'Model `{}`, micro-batch {} per replica, two CPU replicas (one BLAS thread each, '
             'the same malloc thresholds); every process alive throughout, the methods '
             'taking turns {} update(s) at a time ({}), the order shuffled each '
             'round. Ratio = the '
             'first\'s time / the second\'s in the same round (above 1: the first is '
             'slower), its median with a 95% bootstrap interval over the rounds; the limit '
             '/ ours is ours\' share of the limit\'s samples/s. Machine: {} ({} cores); '
             'load average {} at start, {} at the end.'.format(
                 result['model'], result['micro_batch'], result['block'],
                 'each timed' if result['block'] == 1 else
                 'the first of each turn not timed, the others averaged',
                 result['machine']['cpu'],
                 result['machine']['cores'], result['machine']['loadavg_start'],
                 result['machine']['loadavg_end']), '',
             '| k | rounds | ours (first) ms | ours (defaults) ms | ChainerMN ms | '
             'limit ms | limit in lockstep ms | limit on ours\' weights ms |',
             '|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in result['rows']:
        ms = r['ms']
        lines.append('| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |'.format(
            r['k'], r['rounds'], ms['ours'], ms['ours_default'], ms['chainermn'],
            ms['limit'], ms['limit_lockstep'], ms['limit_same']))
    lines += ['', 'Where the time goes (medians over the rounds, ms): the slower replica\'s '
              'forwards and backwards (ours: each replica\'s own window compute; the limit: '
              'its loops\'), and the update less that (the limit: in lockstep).', '',
              '| k | window: ours (first) | ours (defaults) | the limit | the limit on '
              'ours\' weights | outside: ours (first) | ours (defaults) | the limit | '
              'the limit on ours\' weights |',
              '|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in result['rows']:
        w, o = r['window_ms'], r['outside_ms']
        lines.append('| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} '
                     '| {:.2f} |'.format(
                         r['k'], w['ours'], w['ours_default'], w['limit'],
                         w['limit_same'], o['ours'], o['ours_default'], o['limit'],
                         o['limit_same']))
    lines += ['', 'The same work: ours\' weights against ChainerMN\'s, the relative difference '
              'of their checksums after the first turn (to rounding) and at the end (at k > 1 '
              'rounding grows with the updates; 0: equal checksums): ' + '; '.join(
                  'k={}: {} {:.1g} then {:.1g}, defaults {:.1g} then {:.1g}'.format(
                      r['k'], result.get('compare') or 'first',
                      r['weights_rel_diff_after_first_turn']['ours'],
                      r['weights_rel_diff_to_chainermn']['ours'],
                      r['weights_rel_diff_after_first_turn']['ours_default'],
                      r['weights_rel_diff_to_chainermn']['ours_default'])
                  for r in result['rows']) + '.']
    lines += ['', '| k | ratio | median | 95% interval | quartiles | issue 15 |',
              '|---:|---|---:|---:|---:|---|']
    for r in result['rows']:
        for key, label, *_ in RATIOS:
            s = r['ratios'][key]
            lines.append('| {} | {} | {:.3f} | {:.3f}-{:.3f} | {:.3f}-{:.3f} | {} |'.format(
                r['k'], label, s['median'], s['ci95'][0], s['ci95'][1], s['q1'], s['q3'],
                s['verdict']))
    text = '\n'.join(lines) + '\n'
    text = text.replace('ours (first)', first_label(result))
    return text


def coordinate(args, argv):
    from bench import _common
    result = {
        'schema': SCHEMA,
        'command': 'python bench/paired_replicas.py ' + ' '.join(
            sys.argv[1:] if argv is None else argv),
        'model': args.model, 'micro_batch': args.micro_batch,
        # updates per turn of a method: the first not timed, the others averaged
        'block': args.block,
        # the first updater ('ours' in the rows): --compare's arguments (none: the defaults)
        'compare': args.compare, 'first_kwargs': args.first_kwargs,
        'machine': {'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
                    'loadavg_start': _common.loadavg()},
        'versions': _common.versions(),
        'rows': [],
    }
    with tempfile.TemporaryDirectory(prefix='mgpu-paired-') as folder:
        ranks = Ranks(args, folder, dict(os.environ))
        try:
            for k in args.ks:
                result['rows'].append(measure(k, args, ranks))
        finally:
            ranks.close()
    result['machine']['loadavg_end'] = _common.loadavg()
    _common.save_results(args.out, 'paired_replicas', result, markdown(result))
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.rank_of:
        serve_rank(args)
        return 0
    if os.environ.get(CHILD):
        return coordinate(args, argv)
    # Run again with one BLAS thread and the malloc thresholds set before numpy loads, in
    # this process's children too (ours' workers, mpiexec's ranks).
    from bench import _common
    from bench.scaling import _child_env, _chainermn_status
    _, reason = _chainermn_status()
    if reason:
        sys.exit('paired_replicas.py needs ChainerMN under mpiexec: ' + reason)
    env = _child_env(dict(_common.thread_env(1), **MALLOC, **{CHILD: '1'}))
    cmd = [sys.executable, str(Path(__file__).resolve())] + list(
        sys.argv[1:] if argv is None else argv)
    return subprocess.run(cmd, env=env).returncode


if __name__ == '__main__':
    sys.exit(main())
