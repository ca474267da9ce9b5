"""The master of one fault scenario; run by ``harness.py``, never by pytest directly.

    python run_fault.py SCENARIO [--replicas N] [--replica R] [--restarts K]

Worker faults (``raise_forward``, ``raise_backward``, ``raise_iterator``,
``raise_converter``, ``raise_start``, ``kill_worker``, and under ``max_worker_restarts``
``restart_raise`` and ``restart_spent``): train until the planted fault fires in replica
R, catch the error, check what the master can see (the error, the workers reaped, the
shared memory gone, ``finalize()`` twice), print ``RESULT <json>``.

Restarts (``restart_window``, ``restart_reduce``, ``restart_post``, ``restart_between``):
train ``--updates`` updates without a fault (the reference), then again with
``max_worker_restarts`` and replica R SIGKILLed once at the site (``between``: by this
driver, between two updates); print ``RESULT <json>`` with whether the parameters and
every reported loss are bitwise the reference's, the restarts, the warnings, the time
from the kill to the end of the redone update, and what is left.

``serve``: train (slowly) until a signal arrives; prints ``READY <json>`` once the
workers run, so the harness knows whom to watch and when to send the signal.
"""
import argparse
import faulthandler
import json
import multiprocessing
import os
import sys
import tempfile
import signal
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))   # the repository root

# site, action, the call of that site (in the faulty worker) that fires
WORKER_FAULTS = {
    'raise_forward': ('forward', 'raise', 5),        # update 3, first micro-batch
    'raise_backward': ('backward', 'raise', 5),
    'raise_iterator': ('iterator', 'raise', 17),     # 4 samples x 2 steps x 2 updates + 1
    'raise_converter': ('converter', 'raise', 5),
    'raise_start': ('start', 'raise', 1),            # unpickling its dataset at start-up
    'kill_worker': ('forward', 'kill', 5),
    # max_worker_restarts: a Python error is not restarted; a death past the budget raises
    'restart_raise': ('forward', 'raise', 5),
    'restart_spent': ('forward', 'kill', 5),   # fires again in the replacement: 2 deaths
}
# max_worker_restarts, one SIGKILL: the site, and the call of it that fires (update 3; the
# post's at the end of the first epoch, after update 8, found at update 9's Step)
RESTARTS = {
    'restart_window': ('forward', 5),
    'restart_reduce': ('reduce', 3),
    'restart_post': ('post', 8),
    'restart_between': ('between', 3),   # killed by the driver after update 3
}
# the function the worker's traceback must show for each site
TRACEBACK_MARK = {'forward': 'in forward', 'backward': 'in backward',
                  'iterator': 'in __getitem__', 'converter': 'in __call__',
                  'start': 'in __setstate__'}


def emit(tag, payload):
    if tag in ('READY', 'RESULT'):
        payload = dict(payload, folders=sorted(FOLDERS))
    print(tag, json.dumps(payload), flush=True)


FOLDERS = []   # the folders the updater made here (its workers' stack files)


def spy_folders():
    """Record the folder of every :class:`StackFiles` this process makes."""
    from mgpu_updater._local import stall
    base = stall.StackFiles.__init__

    def init(self):
        base(self)
        FOLDERS.append(self.folder)
    stall.StackFiles.__init__ = init


def spy_segments():
    """Record the name of every shared-memory segment this process creates."""
    from multiprocessing import shared_memory
    created = []
    base = shared_memory.SharedMemory

    class Spy(base):
        def __init__(self, name=None, create=False, size=0, **kwargs):
            super().__init__(name=name, create=create, size=size, **kwargs)
            if create:
                created.append(self.name.lstrip('/'))
    shared_memory.SharedMemory = Spy
    return created


def proc_state(pid):
    """'gone', or the one-letter state in /proc/<pid>/stat ('Z' for a zombie)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return 'gone'


def worker_fault(args, created):
    with tempfile.TemporaryDirectory(prefix='mgpu-fault-') as tmp:
        _worker_fault(args, created, os.path.join(tmp, 'stamp'))


def _worker_fault(args, created, stamp):
    import faulty
    from mgpu_updater import WorkerError
    site, action, at = WORKER_FAULTS[args.scenario]
    fault = faulty.Fault(site, action, replica=args.replica, at=at, stamp=stamp)
    updater = faulty.build(args.replicas, fault, prefetch=args.prefetch,
                           start_method=args.start_method, iterator=args.iterator,
                           max_worker_restarts=args.restarts)
    out = {'scenario': args.scenario, 'replica_expected': args.replica}
    pids, segments_seen = [], []
    error = None
    try:
        for i in range(20):
            updater.update()
            pids = sorted(set(pids) | set(updater.worker_pids()))   # replacements too
            if i == 0:
                segments_seen = faulty.own_segments()
                emit('READY', {'master': os.getpid(), 'workers': pids,
                               'segments': sorted(created)})
    except BaseException as exc:  # noqa: BLE001 - what we came for
        t_error = time.time()
        error = exc
        out['updates_done'] = updater.iteration
    else:
        out['updates_done'] = updater.iteration
    if error is None:
        out['error_type'] = None
    else:
        if os.path.exists(stamp):      # else the fault never fired: a wrong error
            with open(stamp) as f:
                out['time_to_error'] = t_error - float(f.read())
        out['error_type'] = type(error).__name__
        out['message'] = str(error)
        out['replica'] = getattr(error, 'replica', None)
        out['device'] = getattr(error, 'device', None)
        out['exitcode'] = getattr(error, 'exitcode', None)
        tb = getattr(error, 'remote_traceback', None) or ''
        out['remote_traceback'] = tb
        out['traceback_has_fault'] = 'FaultInjected' in tb and TRACEBACK_MARK[site] in tb
        out['is_worker_error'] = isinstance(error, WorkerError)
    # after the error, before finalize: the failed update already stopped every worker
    # (the master's own MultiprocessIterator pool stops in finalize, as with Chainer's)
    out['active_children_after_error'] = [p.pid for p in multiprocessing.active_children()
                                          if p.name.startswith('mgpu-worker-')]
    finalize_times = []
    for _ in range(2):
        t0 = time.perf_counter()
        try:
            updater.finalize()
            finalize_times.append(time.perf_counter() - t0)
        except BaseException:  # noqa: BLE001 - reported
            out.setdefault('finalize_errors', []).append(traceback.format_exc())
    out['finalize_times'] = finalize_times
    out['workers'] = pids
    out['worker_states'] = {str(p): proc_state(p) for p in pids}
    out['not_reaped'] = [p for p in pids if not _is_reaped(p)]
    out['active_children'] = [p.pid for p in multiprocessing.active_children()]
    out['segments_created'] = sorted(created)
    out['segments_mapped_at_update_1'] = segments_seen
    out['segments_left'] = [n for n in created if os.path.exists('/dev/shm/' + n)]
    emit('RESULT', out)


def restart(args, created):
    with tempfile.TemporaryDirectory(prefix='mgpu-fault-') as tmp:
        _restart(args, created, os.path.join(tmp, 'stamp'))


def _train(args, fault=None, restarts=0, kill_after=None, stamp=None):
    """``args.updates`` updates; the parameters, every update's observation, the end time
    of each update, the updater's iteration, epoch and restarts, and every worker pid."""
    import warnings
    import chainer
    import numpy
    import faulty
    from mgpu_updater import WorkerRestartWarning
    numpy.random.seed(0)
    updater = faulty.build(args.replicas, fault, prefetch=args.prefetch,
                           start_method=args.start_method, iterator=args.iterator,
                           dropout=args.dropout, max_worker_restarts=restarts)
    out = {'observations': [], 'done_at': [], 'pids': set(), 'warnings': []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', WorkerRestartWarning)
        try:
            for i in range(args.updates):
                if kill_after is not None and i == kill_after:
                    victim = updater.worker_pids()[args.replica - 1]
                    with open(stamp, 'w') as f:
                        f.write(repr(time.time()))
                    os.kill(victim, signal.SIGKILL)
                observation = {}
                with chainer.Reporter().scope(observation):
                    updater.update()
                out['done_at'].append(time.time())
                out['observations'].append({k: float(v) for k, v in observation.items()
                                            if k.startswith('main/') and 'time' not in k})
                out['pids'].update(updater.worker_pids())
            model = updater.get_optimizer('main').target
            out['params'] = {name: p.array.copy() for name, p in model.namedparams()}
            out['iteration'] = updater.iteration
            out['epoch_detail'] = updater.epoch_detail
            out['restarts'] = updater.worker_restarts
            log = updater._restart_log
            out['restart_log'] = [r._asdict() for r in log.restarts] if log else []
        finally:
            updater.finalize()
    out['warnings'] = [str(w.message) for w in caught
                       if issubclass(w.category, WorkerRestartWarning)]
    return out


def _restart(args, created, stamp):
    import faulty
    site, at = RESTARTS[args.scenario]
    out = {'scenario': args.scenario, 'replica_expected': args.replica}
    reference = _train(args)
    emit('READY', {'master': os.getpid(), 'workers': sorted(reference['pids']),
                   'segments': sorted(created)})
    fault = None if site == 'between' else faulty.Fault(site, 'kill', replica=args.replica,
                                                        at=at, stamp=stamp, once=True)
    try:
        run = _train(args, fault, restarts=args.restarts,
                     kill_after=at if site == 'between' else None, stamp=stamp)
    except BaseException as exc:  # noqa: BLE001 - reported
        out['error'] = f'{type(exc).__name__}: {exc}'[-3000:]
        run = None
    if run is not None:
        ref_params, params = reference['params'], run['params']
        out['bitwise_equal'] = (sorted(ref_params) == sorted(params) and all(
            ref_params[k].dtype == params[k].dtype and ref_params[k].shape == params[k].shape
            and ref_params[k].tobytes() == params[k].tobytes() for k in ref_params))
        strip = [{k: v for k, v in o.items() if k != 'main/worker_restarts'}
                 for o in run['observations']]
        out['reports_equal'] = strip == reference['observations']
        out['reported_restarts'] = [o.get('main/worker_restarts') for o in run['observations']]
        for key in ('iteration', 'epoch_detail', 'restarts', 'warnings', 'restart_log'):
            out[key] = run[key]
        out['reference_iteration'] = reference['iteration']
        out['reference_epoch_detail'] = reference['epoch_detail']
        if os.path.exists(stamp):
            with open(stamp) as f:
                killed = float(f.read())
            # the update the restart happened in: the first whose report counts it
            counted = [i for i, n in enumerate(out['reported_restarts']) if n]
            if counted:
                out['recovery_s'] = run['done_at'][counted[0]] - killed
        if run['restart_log']:
            out['start_s'] = run['restart_log'][0]['start_seconds']
        pids = sorted(reference['pids'] | run['pids'])
    else:
        pids = sorted(reference['pids'])
    out['workers'] = pids
    out['not_reaped'] = [p for p in pids if not _is_reaped(p)]
    out['active_children'] = [p.pid for p in multiprocessing.active_children()]
    out['segments_created'] = sorted(created)
    out['segments_left'] = [n for n in created if os.path.exists('/dev/shm/' + n)]
    emit('RESULT', out)


def _is_reaped(pid):
    """No zombie, no running process: ``waitpid`` knows no such child."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def serve(args, created):
    import faulty
    updater = faulty.build(args.replicas, delay=args.delay, prefetch=args.prefetch,
                           start_method=args.start_method, iterator=args.iterator)
    out = {'scenario': 'serve'}
    pids = []
    try:
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline:
            updater.update()
            if updater.iteration == 2:
                pids = updater.worker_pids()
                emit('READY', {'master': os.getpid(), 'workers': pids,
                               'segments': sorted(created)})
        out['error_type'] = None
    except BaseException as exc:  # noqa: BLE001 - SIGINT ends up here
        out['error_type'] = type(exc).__name__
        out['t_caught'] = time.time()
    finally:
        try:
            updater.finalize()
            updater.finalize()
        except BaseException:  # noqa: BLE001 - reported
            out['finalize_errors'] = traceback.format_exc()
        out['t_finalized'] = time.time()
        out['workers'] = pids
        out['not_reaped'] = [p for p in pids if not _is_reaped(p)]
        out['active_children'] = [p.pid for p in multiprocessing.active_children()]
        out['segments_left'] = [n for n in created if os.path.exists('/dev/shm/' + n)]
        emit('RESULT', out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('scenario', choices=sorted(WORKER_FAULTS) + sorted(RESTARTS)
                        + ['serve'])
    parser.add_argument('--replicas', type=int, default=2)
    parser.add_argument('--replica', type=int, default=1, help='the faulty one')
    parser.add_argument('--delay', type=float, default=0.01, help='serve: s per forward')
    parser.add_argument('--max-seconds', type=float, default=60.0)
    parser.add_argument('--start-method', default='spawn')
    parser.add_argument('--prefetch', type=lambda text: text if text == 'auto' else int(text),
                        default='auto', help="the updater's prefetch (default 'auto', its own)")
    parser.add_argument('--iterator', choices=['serial', 'multiprocess'], default='serial')
    parser.add_argument('--restarts', type=int, default=0,
                        help='max_worker_restarts (restart_*: 1 unless given)')
    parser.add_argument('--dropout', type=float, default=0.0, help="the model's dropout ratio")
    parser.add_argument('--updates', type=int, default=12, help='restart_*: updates per run')
    args = parser.parse_args()
    if args.scenario in RESTARTS and not args.restarts:
        args.restarts = 1
    # the harness sends SIGUSR1 to a driver that hangs, before it kills it: every
    # thread's stack goes to stderr, which the harness reports
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C as in a terminal: a driver started from a background job of a shell without
    # job control (``cmd &`` in a script, ``nohup``) inherits SIGINT ignored, and Python
    # then leaves it so; the master_sigint scenarios would test the launcher, not us.
    # Likewise a blocked SIGINT, which fork and exec keep and Python does not undo: a
    # driver once trained on for 45 s after the harness's SIGINT, in the test suite only
    # (where a thread of the suite starts it), and never where it was looked for since
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    created = spy_segments()
    spy_folders()
    if args.scenario == 'serve':
        serve(args, created)
    elif args.scenario in RESTARTS:
        restart(args, created)
    else:
        worker_fault(args, created)


if __name__ == '__main__':
    main()
