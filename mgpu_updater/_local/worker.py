"""The worker process: receive a command, run the window, reduce, report.

Runs in a process started with ``spawn`` (or ``forkserver``), so it imports everything
afresh; what it needs arrives pickled: a :class:`ProcessSetup`, then a :class:`WorkerInit`
(two pickles, one payload). Protocol over the pipe
(the messages are :mod:`mgpu_updater._local.protocol`'s):

master -> worker                          worker -> master
                                          Hello() first, once Python's start-up is over
payload bytes (ProcessSetup, WorkerInit)  Joining() once built, then Ready() once its
                                          communicator is joined
Step(loss_scale, scalars, parity)         Done(WindowResult) (or, where packs are
                                          announced, a post and its result in its
                                          mailbox at the board, .board)
StateRequest()                            State(iterator state dict)
Rewind() (max_worker_restarts)            Rewound(), back where its latest window began
Rejoin(handle) (after Rewind, NCCL)       Rejoined(), the rebuilt communicator joined
Stop()                                    (exits)
                                          Failed(traceback) on any exception
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, NamedTuple, Optional

from .protocol import (Abandoned, Decoder, Done, Failed, Hello, Joining, ParamViews, Ready,
                       Rejoin, Rejoined, Rewind, Rewound, State, StateRequest, Step, Stop,
                       advice_for, worker_step)

PARENT_POLL = 0.2   # seconds between checks that the master is alive (when polled)


class WorkerInit(NamedTuple):
    rank: int
    size: int
    device: Any                 # device specifier as given
    model: Any                  # the master's model, on the CPU
    loss_func: Optional[Callable]
    bind_loss_to_model: Any     # _loss_binding.LossBinding: loss_func is a link or its method
    converter: Callable
    iterator: Any
    prefetch: int               # its loader's depth (_loader.plan)
    accumulate_steps: int
    scaling: Any                # _replica.Scaling: this replica's gradient factors
    comm_name: str
    comm_handle: Any
    chunking: Any = None        # _chunks.Chunking: how it splits loaded micro-batches
    process: Any = None         # its numpy error handling, warning filters (_inherit)
    module_globals: Any = None  # what its copies read in the user's modules (_module_globals)
    blas_threads: Optional[int] = None   # its BLAS/OpenMP threads (_threads; None: as they are)
    reuse_host_memory: bool = False      # keep freed memory for reuse (_host_memory)
    cores: Optional[tuple] = None        # the cores it runs on (_threads.core_shares)
    board: Optional[str] = None          # the ranks' board segment (.board), or None
    announce_packs: bool = False         # post at the board that the gradient is packed
    prefetch_gated: bool = False         # its loader loads while it waits (_loader.plan)
    prefetch_trial: bool = False         # ... and tries loading ahead (_load_trial)
    keep_resume: bool = False            # keep and send its resume points (.resume)
    resume: Any = None                   # a replacement's .resume.ResumePoint, or None
    signature: Any = None                # the master's _replica.copy_signature of the model
    nan_grads: tuple = ()                # parameters given NaN gradients (not pickled)


class ProcessSetup(NamedTuple):
    """What a worker applies to its process before it unpickles anything of the user's
    (its :class:`WorkerInit`, pickled after this in the same payload): a ``__setstate__``
    that draws from ``numpy.random`` draws from this worker's seeded stream, so a seeded
    run repeats, and one that reads ``chainer.config`` sees the master's; what is
    unpickled onto the current device goes to the worker's own. The master's warning
    filters and numpy error handling come after (``WorkerInit.process``): unpickling imports
    the user's modules, which the script imported before it set them."""
    device: Any                 # device specifier as given
    config: Any = None          # the master's chainer.config entries (_inherit)
    seed: Optional[int] = None  # this worker's random seed, drawn by the master (_inherit)


def unpickle_payload(payload: bytes,
                     setup: Callable[[ProcessSetup], Any]) -> Optional[tuple]:
    """``(setup(ProcessSetup), WorkerInit)`` from a payload, the setup applied (by
    ``setup``) before the WorkerInit is unpickled; None where the master stopped the worker
    before its payload came (it sent something else)."""
    stream = io.BytesIO(payload)
    first = pickle.load(stream)
    if not isinstance(first, ProcessSetup):
        return None
    applied = setup(first)
    return applied, pickle.load(stream)


def _set_up(setup: ProcessSetup) -> Any:
    """Apply ``setup`` to this process; the worker's device, in use, and the master's
    configuration entries (applied again once the payload's unpickling has imported the
    script's modules)."""
    import chainer
    from .. import _inherit
    _inherit.apply_config(setup.config or {})
    if setup.seed is not None:
        _inherit.seed_process(setup.seed)
    device = chainer.get_device(setup.device)
    device.use()
    if setup.seed is not None:
        _inherit.seed_device(setup.seed, device)
    return device, setup.config or {}


def _parent_handles(parent_pid: int) -> List[Any]:
    """Handles that become ready when the master is gone.

    The parent's sentinel, when multiprocessing gives one: with both ``spawn`` and
    ``forkserver`` it is the read end of the start-up pipe whose write end the master keeps
    open for the child's lifetime. (Under ``forkserver`` the parent process is the fork
    server, not the master, so ``os.getppid()`` says nothing.) But the processes the master
    forks (its own ``MultiprocessIterator`` pool) hold that write end too, so a pidfd of
    the master (Linux 5.3+) is watched as well: it is ready the moment the master exits.
    """
    import multiprocessing
    handles: List[Any] = []
    parent = multiprocessing.parent_process()
    if parent is not None:
        handles.append(parent.sentinel)
    try:
        handles.append(os.pidfd_open(parent_pid))
    except ProcessLookupError:
        handles.append(_ALREADY_GONE)
    except (AttributeError, OSError):   # not Linux or an old kernel: the sentinel alone
        pass
    return handles


_ALREADY_GONE = -1


def _parent_gone(handles: List[Any], first_ppid: int, timeout: float = 0.0) -> bool:
    if _ALREADY_GONE in handles:
        return True
    if handles:
        import multiprocessing.connection
        try:
            return bool(multiprocessing.connection.wait(handles, timeout))
        except OSError:
            return True
    if timeout:
        time.sleep(timeout)
    return os.getppid() != first_ppid


def _watch_parent(parent_pid: int, on_orphan: Callable[[], None]) -> Callable[[], bool]:
    """Exit at once when the master disappears (SIGKILL, OOM), cleaning up first.

    ``parent_pid`` is the master's pid; the watch waits on it and on the parent's
    sentinel, or polls ``os.getppid()`` when there is neither. After ``on_orphan`` the
    worker kills its own process group: itself and every process its iterator started.
    Returns a function that says, without blocking, whether the master is gone.
    """
    handles = _parent_handles(parent_pid)
    first_ppid = os.getppid()

    def loop() -> None:
        while not _parent_gone(handles, first_ppid, PARENT_POLL):
            pass
        try:
            on_orphan()
        finally:
            _kill_own_group()
            os._exit(3)
    threading.Thread(target=loop, name=f'mgpu-watch-{parent_pid}', daemon=True).start()
    return lambda: _parent_gone(handles, first_ppid)


def _lead_process_group() -> None:
    """Lead a process group of our own, which our iterator's processes join, so that the
    master can kill them all even after we were SIGKILLed (``.pool``). Ctrl-C no
    longer reaches the workers: the master, in the terminal's group, decides."""
    try:
        os.setpgid(0, 0)
    except OSError:   # e.g. already a session leader: the group kill is skipped
        pass


def _defer_sigterm(master_gone: Callable[[], bool]) -> None:
    """A SIGTERM that reaches this worker while its master lives is the master's to act
    on, as Ctrl-C is: a job's SIGTERM (a scheduler's cancel or time limit) reaches every
    process of it, and a master whose handler saves a snapshot before it exits needs its
    workers for the update in progress. The master stops this worker (asked, then killed),
    and a worker whose master is gone exits by itself (:func:`_watch_parent`). The
    processes forked from this one do the same (a ``MultiprocessIterator``'s pool, which
    lost the batch a process killed was loading, and waited for it for good), as the
    master's own do where the script handles SIGTERM (they inherit its handler); the
    master kills them with this worker's process group. Once the master is gone, the
    signal takes its default action."""
    def on_sigterm(signum: int, frame: Any) -> None:
        if not master_gone():
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_sigterm)


def _kill_own_group() -> None:
    if os.getpgrp() == os.getpid():   # never the master's group
        os.killpg(0, signal.SIGKILL)


def main(conn: Any, parent_pid: int, shm_names: List[str],
         default_start_method: Optional[str] = None, stack_file: Optional[str] = None,
         output: Any = None) -> None:
    """A worker's life: hello, receive the payload, build, say ready, serve, clean up.

    The payload (:class:`WorkerInit`, pickled by ``_payload``) arrives over ``conn`` after
    the ``Hello()``, never as a process argument (see ``.pool``).
    ``default_start_method`` is the master's default (None: the platform's), for the
    processes the user's iterator starts here. ``stack_file``: where this process dumps
    its threads' stacks when the master asks (a stalled update, :mod:`.stall`).
    ``output``: the pipes its stdout, stderr and log records go to the master by, the
    fields of a :class:`.output.WorkerOutput`.
    """
    import multiprocessing
    from . import output as relay
    if output is not None:
        output = relay.WorkerOutput(*output)
    relay.attach(output)
    _lead_process_group()
    multiprocessing.set_start_method(default_start_method, force=True)
    # Should a SIGINT reach us anyway (sent to our group): the master decides, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Spawned with SIGINT blocked (.pool._sigint_held): one pending since is dropped now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from .stall import register_stack_dump
    register_stack_dump(stack_file)

    def orphaned() -> None:
        from ..comm.shm import unlink_quietly
        from .stall import remove_stack_file
        for name in shm_names:
            unlink_quietly(name)
        remove_stack_file(stack_file)

    master_gone = _watch_parent(parent_pid, orphaned)
    _defer_sigterm(master_gone)
    # Spawned with SIGTERM blocked too: one pending since is the master's to act on now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    replica = comm = init = None
    try:
        conn.send(Hello())
        payload = conn.recv_bytes()
        from .. import _compat, _inherit
        _compat.apply()
        unpickled = unpickle_payload(payload, _set_up)
        del payload
        if unpickled is None:   # stopped before its payload came: no error
            return
        (device, config), init = unpickled
        # what the script's modules set at their import, just now, gives way to the master's
        _inherit.apply_config(config)
        relay.relay_records(output)   # the script's modules imported: their logging set
        replica, comm, layouts, in_place = _build(init, device, lambda: conn.send(Joining()))
        from .._module_globals import differences
        conn.send(Ready(differences(init.module_globals or {})))
    except BaseException:  # noqa: BLE001 - reported to the master
        relay.flush()   # what it printed, before its traceback
        _send_error(conn)
        _wait_stop(conn)
        _finalize_iterator(init)
        if master_gone():
            orphaned()
        return
    try:
        _serve(conn, init, replica, comm, layouts, in_place)
    finally:
        relay.flush()   # before the waits below, which the master may cut short
        if replica is not None:
            replica.loader.close()
        _finalize_iterator(init)
        if comm is not None:
            comm.finalize()
        if master_gone():   # the pipe closed because the master died: clean up for it
            orphaned()


def _finalize_iterator(init: Optional['WorkerInit']) -> None:
    """Stop the iterator's own processes and threads (``MultiprocessIterator``)."""
    if init is None:
        return
    try:
        init.iterator.finalize()
    except Exception:  # noqa: BLE001 - exiting anyway; the master kills our group
        pass


def _nan_grads(model: Any, names: tuple) -> None:
    """Give the parameters ``names`` (those with a gradient in the master's model) the
    NaN gradient Chainer initialises a parameter with: the payload carries none, and a
    forward may read one before the window's first backward clears it."""
    if not names:
        return
    params = dict(model.namedparams())
    for name in names:
        param = params.get(name)
        array = None if param is None else param.array
        if array is not None and array.dtype.kind == 'f':
            param.grad = param.xp.full_like(array, float('nan'))


def _build(init: 'WorkerInit', device: Any, joining: Callable[[], None] = lambda: None) -> Any:
    """The replica, communicator, layouts and in-place helpers of ``init``, on ``device``
    (set up by :func:`_set_up`)."""
    from .. import _inherit, _loss_binding, comm as comm_module
    from .._flat_buffers import ModelLayouts
    from .._replica import Replica
    from .._threads import ThreadBinding, limit_process
    from .._host_memory import reuse_freed_memory

    reuse_freed_memory(init.reuse_host_memory)   # before its first window
    ThreadBinding(init.cores)   # before its loader's thread starts: for its whole life
    if init.process is not None:
        _inherit.apply_process_settings(init.process)
    model = init.model
    if init.signature is not None:   # what unpickling built: as the master's model?
        from .._replica import copy_difference, copy_signature
        differs = copy_difference(init.signature, copy_signature(model))
        if differs is not None:
            raise RuntimeError(differs)
    model.to_device(device)
    _nan_grads(model, init.nan_grads)
    loss_func = init.loss_func   # a closure over the model holds init.model (one pickle)
    if init.bind_loss_to_model is not None:
        loss_func = _loss_binding.resolve(init.bind_loss_to_model, model)
    if init.resume is not None:   # a replacement: where the lost worker's update started
        from .resume import restore
        restore(init.resume, init.iterator)
    # Before any BLAS call: the first read may fork the iterator's pool (_loader.Prefetcher).
    loader = _make_loader(init, device)
    # After that read, before the first BLAS call: for the rest of this process.
    limit_process(init.blas_threads)
    replica = Replica(model, loss_func, loader, init.accumulate_steps, init.scaling,
                      name=f'replica {init.rank} ({init.device})',
                      chunking=init.chunking, one_of_many=True)
    comm = comm_module.attach(init.comm_name, init.comm_handle, init.rank, device)
    joining()     # the master joins once every worker says so
    comm.init()   # NCCL: every rank joins while the master waits for Ready
    layouts = ModelLayouts(model)
    board = None
    if init.board is not None:
        from .board import Board
        board = Board.attach(init.board, init.size, init.rank)
    keeper = None
    if init.keep_resume:
        from .resume import Keeper
        keeper = Keeper(loader)
    return replica, comm, layouts, (ParamViews(comm, layouts, model), board, keeper)


def _make_loader(init: 'WorkerInit', device: Any) -> Any:
    """The replica's loader over ``init.iterator``, as its payload says."""
    import functools
    from .._chunks import splits
    from .._loader import make_loader
    from .._replica import observers
    return make_loader(init.iterator, init.converter, device, init.prefetch,
                       init.prefetch_gated, trial=init.prefetch_trial,
                       keep_examples=splits(init.chunking),
                       observe=functools.partial(observers, model=init.model))


def _serve(conn: Any, init: 'WorkerInit', replica: Any, comm: Any, layouts: Any,
           in_place: Any) -> None:
    """Answer the master's messages (see :mod:`mgpu_updater._local.protocol`) until Stop."""
    views, board, keeper = in_place
    if keeper is not None and comm.rejoins:
        _give_up_on_message(conn, replica, comm)
    try:
        _answer(conn, init, replica, comm, layouts, views, board, keeper)
    finally:
        if board is not None:
            board.close()


def _give_up_on_message(conn: Any, replica: Any, comm: Any) -> None:
    """Under ``max_worker_restarts``, on a communicator whose collectives a dead rank
    leaves unfinished (NCCL): the replica's read of its window's values on the host
    (which would wait for good behind such a collective) first waits for the
    collectives, bounded and watching, and gives the window up (:class:`Abandoned`,
    the communicator abandoned) as soon as the master sends a message, which in an
    update means that it abandoned the update (a :class:`Rewind`, or a Stop), or when
    the backend says that a peer failed; the worker then reads that message."""
    from ..comm.base import PeerFailure
    master_alive = comm.check_peer_alive

    def check() -> None:
        if master_alive is not None:
            master_alive()
        if conn.poll(0):
            raise Abandoned('the master sent a message during the update')
    comm.watch_peers(check)

    def settle() -> None:
        try:
            comm.wait()
        except PeerFailure as failure:   # comm.wait() abandoned the communicator
            raise Abandoned(str(failure)) from failure
    replica.before_read = settle


def _answer(conn: Any, init: 'WorkerInit', replica: Any, comm: Any, layouts: Any,
            views: Any, board: Any, keeper: Any = None) -> None:
    decoder = Decoder()   # the master's bytes (its Encoder): a Step like the last is not unpickled
    # where each rank of the host has a core of its own, the board's spin (.board.spin_for)
    spin = board.spin if board is not None else 0.0
    from .output import flush
    while True:
        try:
            flush()   # what the window printed, out before the wait (.output)
            replica.loader.release()   # a gated loader loads while this one waits
            if spin:
                _spin_for_message(conn, spin)
            data = conn.recv_bytes()
            replica.loader.hold()
            msg = decoder.decode(data)
        except (EOFError, OSError):
            return                       # the master is gone
        kind = msg[0]
        if kind == Stop.KIND:
            return
        try:
            if kind == Step.KIND:
                worker_step(msg, replica, comm, layouts, init.size, views, board,
                            done=lambda result: conn.send(Done(result)),
                            announce_packs=init.announce_packs, keeper=keeper)
            elif kind == StateRequest.KIND:
                conn.send(State(replica.loader.state()))
            elif kind == Rewind.KIND and keeper is not None:
                comm.abandon()   # NCCL: first of all, the collectives stuck on a dead rank end
                device = replica.loader.device
                keeper.rewind(replica, lambda: _make_loader(init, device))
                replica.look_again()   # the abandoned window's look counts for nothing
                if board is not None:
                    board.start_over()
                conn.send(Rewound())
            elif kind == Rejoin.KIND and keeper is not None:
                comm.rejoin(msg.handle)
                conn.send(Rejoined())
            else:
                raise ValueError(f'unknown command {kind!r}')
        except Abandoned:   # the update given up (_give_up_on_message): read the message
            continue
        except BaseException:  # noqa: BLE001 - reported to the master
            flush()   # what it printed, before its traceback
            _send_error(conn)
            _wait_stop(conn)
            return


def _spin_for_message(conn: Any, seconds: float) -> None:
    """Look for the master's next message for up to ``seconds``, yielding the CPU (and
    the GIL, to the loader) between looks, before the caller blocks on the pipe: woken by
    the kernel, a worker on a 2-core VM started its window 0.1 ms after the master sent
    Step (``bench/timeline.py``), on the critical path of every update; a look sees it
    within microseconds. Only where every rank has a core to itself (the board's spin,
    :func:`.board.spin_for`), so that no rank that computes loses its core to it."""
    deadline = time.perf_counter() + seconds
    poll, clock, yield_cpu = conn.poll, time.perf_counter, os.sched_yield
    while not poll(0):
        if clock() > deadline:
            return
        yield_cpu()


def _send_error(conn: Any) -> None:
    try:
        conn.send(Failed(traceback.format_exc() + advice_for(sys.exc_info()[1])))
    except Exception:  # noqa: BLE001 - the master is gone; nothing left to tell
        pass


def _wait_stop(conn: Any, timeout: float = 30.0) -> None:
    """After an error, wait (bounded) for the master to stop us, then exit."""
    try:
        if conn.poll(timeout):
            conn.recv()
    except (EOFError, OSError):
        pass
