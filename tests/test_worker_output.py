"""What the workers print and log reaches what the script set up for its own output
(``mgpu_updater/_local/output.py``), as under StandardUpdater, where the model, dataset
and converter print and log in the script's process."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import chainer
import chainer.functions as F
import chainer.links as L
import pytest

from mgpu_updater import ParallelAccumulatingUpdater

from _models import dataset

SCRIPT = Path(__file__).resolve().parent / 'scripts' / 'worker_output.py'
ROOT = Path(__file__).resolve().parent.parent
LOGGER = 'mgpu_worker_output_test'


class Talks(chainer.Chain):
    """Prints to stdout and stderr and logs, with its process id, in every forward."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)

    def forward(self, x, t):
        print(f'out {os.getpid()}')
        print(f'err {os.getpid()}', file=sys.stderr)
        logging.getLogger(LOGGER).info('record %d of %d', os.getpid(), len(x))
        return F.softmax_cross_entropy(self.l(x), t)


def _lines(text, line):
    """How often ``line`` was written, ended by its newline or not: the master's own print
    (two writes: the text, then its end) and the relay's write of a worker's text may
    come one between the other's two, as two threads' prints do."""
    return len(re.findall(re.escape(line) + r'(?!\d)', text))


def _train(updates=2, start_method='spawn', after_first=lambda: None):
    model = Talks()
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(16, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * 2,
                                          start_method=start_method)
    try:
        for update in range(updates):
            updater.update()
            if update == 0:
                after_first()
        return updater.worker_pids()[0]
    finally:
        updater.finalize()


@pytest.mark.parametrize('start_method', ['spawn', 'forkserver'])
def test_a_workers_prints_go_to_the_scripts_stdout_and_stderr_as_it_set_them(start_method):
    """A script's stdout and stderr replaced (``redirect_stdout``, a tee into a file):
    the worker's prints land there with the master's (they went to the terminal)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        worker = _train(start_method=start_method)
    assert _lines(out.getvalue(), f'out {worker}') == 2, out.getvalue()
    assert _lines(err.getvalue(), f'err {worker}') == 2, err.getvalue()
    assert _lines(out.getvalue(), f'out {os.getpid()}') == 2


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_workers_records_go_through_the_masters_handlers_and_levels():
    """Logging configured in the script's main block, which a worker does not run: the
    worker's records reach the master's handler at the master's level, with the worker's
    process in them (they were dropped, below the worker's default WARNING)."""
    logger = logging.getLogger(LOGGER)
    kept = _Kept()
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    try:
        worker = _train()
    finally:
        logger.removeHandler(kept)
        logger.setLevel(logging.NOTSET)
    mine = [r for r in kept.records if r.process == worker]
    assert [r.getMessage() for r in mine] == [f'record {worker} of 4'] * 2
    assert {r.processName for r in mine} == {'mgpu-worker-1'}
    assert len([r for r in kept.records if r.process == os.getpid()]) == 2


def test_a_stdout_without_flush_gets_each_line_once(capfd):
    """A script's stdout an object with only ``write()`` (a logger's adapter): each line
    of the worker once, there (the missing flush sent it to the terminal as well)."""
    class Writes:
        def __init__(self):
            self.text = ''

        def write(self, text):
            self.text += text

    capfd.readouterr()
    saved, sys.stdout = sys.stdout, Writes()
    try:
        worker = _train()
        got = sys.stdout.text
    finally:
        sys.stdout = saved
    assert _lines(got, f'out {worker}') == 2, got
    assert f'out {worker}' not in capfd.readouterr().out


def test_a_record_below_the_masters_level_of_now_is_dropped():
    """The master raises its level after the workers started: their records below it are
    dropped, as the master's own are (they went on reaching its handlers)."""
    logger = logging.getLogger(LOGGER)
    kept = _Kept()
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)

    def raise_level():
        # once the relay handled the worker's record of the first update (its thread
        # hands it on as it comes: on a loaded machine after this point, then dropped)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                r.process != os.getpid() for r in kept.records):
            time.sleep(0.01)
        logger.setLevel(logging.WARNING)
    try:
        worker = _train(updates=3, after_first=raise_level)
    finally:
        logger.removeHandler(kept)
        logger.setLevel(logging.NOTSET)
    assert [r.getMessage() for r in kept.records if r.process == worker] == [
        f'record {worker} of 4']


class Chatty(chainer.Chain):
    """Prints 3000 lines in every forward."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)

    def forward(self, x, t):
        for i in range(3000):
            print(f'line {i} of a long forward in process {os.getpid()} ' + 'x' * 40)
        return F.softmax_cross_entropy(self.l(x), t)


def _does_nothing():
    pass


def test_a_process_the_master_forks_while_workers_print_exits(tmp_path):
    """The master forks a process after every update (a fork-context pool, a snapshot
    writer's process) while the workers' output is being written to its stdout, a file:
    every such process exits (one forked while the relay was inside a write had the
    file's buffer lock held, and its exit's flush of stdout waited for good: 14 of 150)."""
    import multiprocessing
    fork = multiprocessing.get_context('fork')
    model = Chatty()
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(16, seed=r), 4) for r in range(2)]
    children = []
    with open(tmp_path / 'out.txt', 'w') as out, contextlib.redirect_stdout(out):
        updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * 2)
        try:
            for _ in range(100):
                updater.update()
                children.append(fork.Process(target=_does_nothing))
                children[-1].start()
        finally:
            updater.finalize()
        stuck = []
        for child in children:
            child.join(5)
            if child.exitcode is None:
                stuck.append(child.pid)
                child.kill()
                child.join()
    assert stuck == []


def _run_script(tmp_path, *args, flags=(), encoding=None):
    out = tmp_path / 'out.txt'
    log = tmp_path / 'train.log'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    env.pop('PYTHONUNBUFFERED', None)
    if encoding is not None:
        env['PYTHONIOENCODING'] = encoding
    with open(out, 'w') as stdout:
        proc = subprocess.run([sys.executable, *flags, str(SCRIPT), str(log), *args],
                              stdout=stdout, stderr=subprocess.PIPE, env=env, text=True,
                              timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text(encoding=encoding)
    worker = int(text.split('WORKERS')[1].split()[0])
    return text, log.read_text(), worker


def test_a_workers_lines_reach_a_file_before_it_is_killed_at_the_end(tmp_path):
    """stdout a file (block-buffered), the workers' loaders inside slow reads when the
    updater stops them, so that they are killed: every line the worker printed is in the
    file (none was: its buffer died with it), and its records are in the script's log."""
    text, log, worker = _run_script(tmp_path, '--slow-read', '5')
    assert text.count(f'forward {worker} write_through=False') == 3, text
    assert log.count(f'mgpu-worker-1 {worker} record {worker}') == 3, log


def test_python_u_reaches_the_workers(tmp_path):
    """``python -u``: the workers' stdout writes through, as the master's (it did not)."""
    text, _, worker = _run_script(tmp_path, flags=('-u',))
    assert text.count(f'forward {worker} write_through=True') == 3, text


def test_a_workers_text_reaches_a_stdout_of_another_encoding(tmp_path):
    """``PYTHONIOENCODING=latin-1``: the worker's lines arrive in it, a letter outside
    ASCII included (every line of the worker was lost)."""
    text, _, worker = _run_script(tmp_path, encoding='latin-1')
    assert _lines(text, f'caf\u00e9 {worker}') == 3, text


class _Forks(logging.Handler):
    """A handler of the master's that forks a process for each record it gets."""

    def __init__(self):
        super().__init__()
        self.exits = []

    def emit(self, record):
        import multiprocessing
        child = multiprocessing.get_context('fork').Process(target=_does_nothing)
        child.start()
        child.join(10)
        self.exits.append(child.exitcode)


def test_a_handler_of_the_master_that_forks_gets_the_workers_records():
    """The master's handler forks as it handles a worker's record, inside the relay's
    write: the fork goes on (it waited for the relay's own lock, held by its own thread,
    for good, and so did the master's own next fork: the test hung)."""
    logger = logging.getLogger(LOGGER)
    forks = _Forks()
    logger.addHandler(forks)
    logger.setLevel(logging.INFO)
    try:
        _train()
    finally:
        logger.removeHandler(forks)
        logger.setLevel(logging.NOTSET)
    assert forks.exits == [0] * 4   # two updates, a record of each replica's window


def test_a_relay_whose_thread_cannot_start_leaves_no_pipe_and_closes(monkeypatch):
    """A limit on threads (a container's pids limit): the relay's thread does not start,
    the error is the thread's, and no pipe is left open; closing it then raises nothing
    (it raised 'cannot join thread before it is started', over the real error)."""
    import threading
    from mgpu_updater._local.output import Relay

    def refuse(self):
        raise RuntimeError("can't start new thread")
    relay = Relay()
    before = sorted(os.listdir('/proc/self/fd'))
    monkeypatch.setattr(threading.Thread, 'start', refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        relay.ends()
    monkeypatch.undo()
    assert sorted(os.listdir('/proc/self/fd')) == before
    relay.close()


def test_the_relay_writes_a_workers_text_by_whole_lines(monkeypatch):
    """A print that comes through the pipe in two pieces (its text, then its end, as under
    ``python -u``): written out as one line, so that another worker's line (or the
    master's) cannot come between them ('out 12out 13' and two empty lines). Text without
    a line's end still goes out, once nothing more comes, and at the relay's close."""
    from mgpu_updater._local import output

    class Writes:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

    got = Writes()
    monkeypatch.setattr(sys, 'stdout', got)
    relay = output.Relay()
    try:
        ends = [relay.ends(), relay.ends()]
        fds = [end.stdout.fileno() for end in ends]
        os.write(fds[0], b'out 12')
        time.sleep(0.01)
        os.write(fds[1], b'out 13\n')
        time.sleep(0.01)
        os.write(fds[0], b'\ncaf\xc3')   # a letter cut between two writes, and held
        time.sleep(0.01)
        os.write(fds[0], b'\xa9 12\n')
        os.write(fds[1], b'3 of 4\r')
        deadline = time.monotonic() + 10
        while len(got.writes) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(got.writes[:2]) == ['out 12\n', 'out 13\n'], got.writes
        assert got.writes[2:4] in (['caf\u00e9 12\n', '3 of 4\r'],
                                   ['3 of 4\r', 'caf\u00e9 12\n']), got.writes
        os.write(fds[0], b'a prompt: ')
        deadline = time.monotonic() + 10
        while len(got.writes) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got.writes[4:] == ['a prompt: '], got.writes
        os.write(fds[1], b'the last, unended')
    finally:
        for end in ends:
            output.started(end)   # the writers' ends closed: the relay reads them to EOF
        for end in ends:
            for conn in (end.stdout, end.stderr, end.records):
                conn.close()
        relay.close()
    assert got.writes[5:] == ['the last, unended'], got.writes


def test_text_without_a_line_end_is_held_back_briefly_whatever_else_comes(monkeypatch):
    """Progress dots a worker prints without a line's end, and nothing else: they went
    out only once no pipe had anything for 50 ms, so a worker printing a dot every 10 ms
    (or another worker printing lines) held them back until the end."""
    from mgpu_updater._local import output

    class Writes:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append((time.monotonic(), text))

    got = Writes()
    monkeypatch.setattr(sys, 'stdout', got)
    relay = output.Relay()
    end = relay.ends()
    try:
        start = time.monotonic()
        sent = 0
        while time.monotonic() - start < 1.5:
            os.write(end.stdout.fileno(), b'.')
            sent += 1
            time.sleep(0.01)
        first = next((t for t, text in got.writes if '.' in text), None)
    finally:
        output.started(end)
        relay.close()
    assert first is not None and first - start < 1.0, (first, start)
    assert ''.join(text for _, text in got.writes) == '.' * sent   # each once, at the end too
