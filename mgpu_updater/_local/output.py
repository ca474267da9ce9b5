"""What the workers print and log, written out by the master, where the script's own goes.

Under ``StandardUpdater`` the model, the dataset and the converter print and log in the
script's process: to its ``sys.stdout`` and ``sys.stderr`` as the script set them (a tee
into a file, ``contextlib.redirect_stdout``, a notebook's cell) and through the logging
handlers it configured, often inside ``if __name__ == '__main__':``, which a spawned
worker does not run. A worker's file descriptors 1 and 2 are therefore pipes to the
master (:func:`attach`), and a thread of the master (:class:`Relay`) writes what comes
through them to the master's ``sys.stdout`` and ``sys.stderr`` as they are at that moment,
whatever writes there: Python, C code, the processes the worker forks (a
``MultiprocessIterator``'s). The worker's ``sys.stdout`` is buffered as the master's is (by
line on a terminal, written through under ``python -u``) and flushed whenever the worker
waits for the master and when it stops, so a worker stopped at shutdown, even killed
there, loses nothing it printed (a block buffer lost everything it held).

Logging: where the master has handlers and the worker, after importing the script's
modules, has none (the script configured logging in its main block), the worker takes the
master's logger levels and sends each record (:class:`RecordSender`) to the master, which
hands it to the logger of its name (:func:`_handle_record`): its handlers, formats and
files, with the worker's process name and id in the record. A worker whose modules
configured logging themselves (at import) keeps its own handlers.
"""
from __future__ import annotations

import codecs
import contextlib
import io
import logging
import os
import pickle
import selectors
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, Iterator, NamedTuple, Optional, Tuple

_READ = 65536
_HEADER = struct.Struct('<I')
DRAIN_TIMEOUT = 1.0   # seconds close() waits for output still in the pipes
# A worker's text is written out by whole lines, so that two workers' lines (or a worker's
# line and the master's) do not cut into each other where a print comes through the pipe
# in two reads (its text, then its end: ``python -u``, PYTHONUNBUFFERED); text without a
# line's end (a prompt, progress dots, a ``\r`` line) is held back PARTIAL_WAIT seconds
# at most from its first character, then goes out as it is.
PARTIAL_WAIT = 0.05

# Held around each write the relay makes in the master (a stream's write and flush, a
# record's handlers) and a worker's flush of its streams, and by a fork until it is done:
# a process the master forks (multiprocessing's 'fork', a MultiprocessIterator's pool, a
# snapshot writer's process) while the relay's thread was inside a write got the stream's
# buffer lock held, and its exit's flush of stdout waited for it for good. A fork waits
# at most FORK_WAIT (a write blocked on a stdout nobody reads, a handler that waits), and
# not at all in the thread that holds it (a handler of the master's that forks).
_WRITING = threading.Lock()
FORK_WAIT = 1.0
_holder = threading.local()
_fork_took = [False]


@contextlib.contextmanager
def _writing() -> Iterator[None]:
    with _WRITING:
        _holder.held = True
        try:
            yield
        finally:
            _holder.held = False


def _before_fork() -> None:
    _fork_took[0] = (not getattr(_holder, 'held', False)
                     and _WRITING.acquire(timeout=FORK_WAIT))


def _after_fork() -> None:
    if _fork_took[0]:
        _fork_took[0] = False
        _WRITING.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                    after_in_child=_after_fork)


class WorkerOutput(NamedTuple):
    """The write ends a worker takes as its stdout, its stderr and its records' pipe
    (picklable for ``spawn`` and ``forkserver``), and how it writes."""
    stdout: Connection
    stderr: Connection
    records: Connection
    line_buffering: bool                 # as the master's stdout (a terminal: by line)
    write_through: bool                  # as the master's stdout (python -u)
    levels: Dict[str, Any]               # logger name ('' root) -> (level, disabled)
    disable: int                         # logging.disable's level in the master
    master_logs: bool                    # the master has a logging handler somewhere


#: what a worker's stdout and stderr write in, and the relay reads them as
ENCODING = 'utf-8'


class _Pipe:
    """A read end and what it carries: 'stdout', 'stderr' or 'records'."""

    def __init__(self, fd: int, kind: str) -> None:
        self.fd = fd
        self.kind = kind
        self.decoder = codecs.getincrementaldecoder(ENCODING)('replace')
        self.pending = b''   # records: the bytes of a record not whole yet
        self.partial = ''    # stdout, stderr: text after the last line's end, held back
        self.held_since = 0.0   # ... since then (time.monotonic)


class Relay:
    """The master's end: one thread for every worker's pipes (started with the first),
    which closes them, once stopped or at their ends."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._open: Dict[int, _Pipe] = {}
        try:
            self._wake_r, self._wake_w = os.pipe()
        except BaseException:   # (no file descriptor left: ulimit -n)
            self._selector.close()
            raise
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._fds_closed = False   # under _lock: the wake pipe's numbers are no longer ours

    def ends(self) -> WorkerOutput:
        """New pipes for a worker about to start: what it takes (the master closes its
        copies of the write ends once the worker has started: :func:`started`)."""
        writes: list = []
        pipes: list = []
        try:
            for kind in ('stdout', 'stderr', 'records'):
                read, write = os.pipe()
                pipes.append(_Pipe(read, kind))
                writes.append(write)
                _widen(write)
            if self._thread is None:   # (a pids limit: "can't start new thread")
                thread = threading.Thread(target=self._run, name='mgpu-output',
                                          daemon=True)
                thread.start()
                self._thread = thread
        except BaseException:
            for fd in [pipe.fd for pipe in pipes] + writes:
                os.close(fd)
            raise
        with self._lock:
            for pipe in pipes:
                self._open[pipe.fd] = pipe
                self._selector.register(pipe.fd, selectors.EVENT_READ, pipe)
        self._wake()
        levels, disable, master_logs = _logging_setup()
        real = sys.__stdout__
        return WorkerOutput(*(Connection(fd, readable=False) for fd in writes),
                            line_buffering=getattr(real, 'line_buffering', False) is True,
                            write_through=getattr(real, 'write_through', False) is True,
                            levels=levels, disable=disable, master_logs=master_logs)

    def close(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Write out what the pipes still hold, waiting until every writer closed its end
        (the workers are gone by now), at most ``timeout`` in all; then stop. A thread
        still inside a write then (the master's stdout blocked) stops after it, and
        closes the pipes itself."""
        deadline = time.monotonic() + timeout
        thread = self._thread
        while self._open and thread is not None and thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop = True
        self._wake()
        if thread is None:
            self._close_all()
        else:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _wake(self) -> None:
        with self._lock:
            if self._fds_closed:
                return
            try:
                os.write(self._wake_w, b'.')
            except OSError:
                pass

    def _run(self) -> None:
        try:
            while not self._stop:
                held = [p for p in list(self._open.values()) if p.partial]
                wait = None
                if held:   # what is held back goes out at its time, whatever else comes
                    now = time.monotonic()
                    for pipe in held:
                        if now - pipe.held_since >= PARTIAL_WAIT:
                            _write_held(pipe)
                    left = [p.held_since for p in held if p.partial]
                    if left:
                        wait = max(0.0, min(left) + PARTIAL_WAIT - now)
                events = self._selector.select(wait)
                for key, _ in events:
                    if self._stop:
                        break
                    if key.fd == self._wake_r:
                        os.read(self._wake_r, _READ)
                        continue
                    pipe = key.data
                    try:
                        data = os.read(pipe.fd, _READ)
                    except OSError:
                        data = b''
                    _deliver(pipe, data, final=not data)
                    if not data:
                        with self._lock:
                            self._forget(pipe)
        finally:
            for pipe in list(self._open.values()):   # stopped: what is held back goes out
                _write_held(pipe)
            self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            if self._fds_closed:
                return
            self._fds_closed = True
            for pipe in list(self._open.values()):
                self._forget(pipe)
            self._selector.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def _forget(self, pipe: _Pipe) -> None:
        if self._open.pop(pipe.fd, None) is None:
            return
        try:
            self._selector.unregister(pipe.fd)
        except (KeyError, ValueError):
            pass
        os.close(pipe.fd)


#: bytes a pipe holds, where the system allows (Linux: up to /proc/sys/fs/pipe-max-size,
#: 1 MiB by default; else its 64 KiB): a worker's burst of output waits for the relay
#: (which the master's own Python may keep from the GIL for a while) only beyond it
PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


def started(output: WorkerOutput) -> None:
    """In the master, once the worker has its copies of the write ends (or failed to
    start): the master's go, so that the worker's exit ends the pipes."""
    for conn in (output.stdout, output.stderr, output.records):
        conn.close()


def _deliver(pipe: _Pipe, data: bytes, final: bool = False) -> None:
    if pipe.kind == 'records':
        pipe.pending += data
        while len(pipe.pending) >= _HEADER.size:
            size, = _HEADER.unpack_from(pipe.pending)
            if len(pipe.pending) < _HEADER.size + size:
                break
            body = pipe.pending[_HEADER.size:_HEADER.size + size]
            pipe.pending = pipe.pending[_HEADER.size + size:]
            with _writing():
                _handle_record(body)
        return
    held = pipe.partial
    text = held + pipe.decoder.decode(data, final)
    end = len(text) if final else max(text.rfind('\n'), text.rfind('\r')) + 1
    text, pipe.partial = text[:end], text[end:]
    if pipe.partial and (not held or end):   # held from now (a line's end went out)
        pipe.held_since = time.monotonic()
    if text:
        with _writing():
            _write(pipe.kind, text)


def _write_held(pipe: _Pipe) -> None:
    text, pipe.partial = pipe.partial, ''
    if text:
        with _writing():
            _write(pipe.kind, text)


def _write(kind: str, text: str) -> None:
    """``text`` to the master's ``sys.stdout`` or ``sys.stderr`` as it is now (the
    interpreter's own where the script set it to None, or its write fails), once;
    what its encoding cannot write, replaced."""
    for stream in (getattr(sys, kind), getattr(sys, f'__{kind}__')):
        if stream is None:
            continue
        try:
            try:
                stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(stream, 'encoding', None) or 'ascii'
                stream.write(text.encode(encoding, 'replace').decode(encoding))
        except Exception:  # noqa: BLE001 - a closed or failing stream: the next, or none
            continue
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream without flush() (a logger's adapter)
            pass
        return


def _handle_record(body: bytes) -> None:
    """A worker's record, handled by the master's logger of its name, where that logger
    takes its level now (the master may have changed levels, or ``logging.disable``d,
    since the worker took them)."""
    try:
        record = logging.makeLogRecord(pickle.loads(body))
        logger = logging.getLogger(record.name or None)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    except Exception:  # noqa: BLE001 - one bad record must not end the relay
        pass


def _logging_setup() -> Tuple[Dict[str, Any], int, bool]:
    """The master's logger levels (root as ''), ``logging.disable``'s level, and whether
    any logger has a handler."""
    root = logging.getLogger()
    levels = {'': (root.level, root.disabled)}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (logger.level != logging.NOTSET
                                                   or logger.disabled):
            levels[name] = (logger.level, logger.disabled)
    return levels, logging.root.manager.disable, _has_handlers()


# ---------------------------------------------------------------------- the worker's end
def attach(output: Optional[WorkerOutput]) -> None:
    """In a worker, first thing: its stdout and stderr go to the master's relay."""
    if output is None:
        return
    for name, conn, fd in (('stdout', output.stdout, 1), ('stderr', output.stderr, 2)):
        stream = getattr(sys, name)
        if stream is not None:
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing to keep
                pass
        os.dup2(conn.fileno(), fd)
        conn.close()
        if stream is not None:
            _FLUSHED.append(stream)   # held from import time too (a module's handler)
        if isinstance(stream, io.TextIOWrapper):
            # A stream of its own on the pipe (one made for a file at start-up cannot
            # change its encoding on a pipe: reconfigure() seeks): in the ENCODING the
            # relay reads; buffered as the master's stdout (stderr by line, as Python's
            # always is), and flushed whenever the worker waits for the master (flush),
            # so that a worker stopped or killed between updates has lost nothing
            through = output.write_through
            new = io.TextIOWrapper(
                io.open(fd, 'wb', buffering=0 if through else -1, closefd=False),
                encoding=ENCODING, errors=stream.errors, newline='\n',
                line_buffering=output.line_buffering or name == 'stderr',
                write_through=through)
            setattr(sys, name, new)
            if getattr(sys, f'__{name}__') is stream:
                setattr(sys, f'__{name}__', new)


def relay_records(output: Optional[WorkerOutput]) -> None:
    """In a worker, once the script's modules are imported: where the master logs through
    handlers and this process has none, take the master's levels and send every record
    to the master. Else leave logging as the modules set it."""
    if output is None:
        return
    if not output.master_logs or _has_handlers():
        output.records.close()
        return
    for name, (level, disabled) in output.levels.items():
        logger = logging.getLogger(name or None)
        logger.setLevel(level)
        logger.disabled = disabled
    logging.disable(output.disable)
    logging.getLogger().addHandler(RecordSender(output.records))


_FLUSHED: list = []   # in a worker: the streams it started with, which code may hold


def flush() -> None:
    """In a worker that waits for the master, or stops: what its streams hold, out (a
    fork meanwhile waits: _WRITING)."""
    for stream in (sys.stdout, sys.stderr, *_FLUSHED):
        if stream is not None:
            try:
                with _writing():
                    stream.flush()
            except Exception:  # noqa: BLE001 - the master is gone
                pass


def _has_handlers() -> bool:
    """Whether any logger has a handler that writes (a library's ``NullHandler`` does
    not)."""
    loggers = [logging.getLogger()] + [
        logger for logger in list(logging.root.manager.loggerDict.values())
        if isinstance(logger, logging.Logger)]
    return any(not isinstance(handler, logging.NullHandler)
               for logger in loggers for handler in logger.handlers)


class RecordSender(logging.Handler):
    """Sends each record to the master's relay: its message formatted with its arguments,
    an exception as text, as ``logging.handlers.QueueHandler`` prepares one. A process
    this one forks (an iterator's) writes its records to stderr instead, as logging's
    last resort does: two writers of one pipe would tear each other's records."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self._fd = conn.fileno()
        os.set_inheritable(self._fd, False)   # a child it execs would hold the pipe open
        self._conn = conn   # keeps the descriptor open
        self._pid = os.getpid()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if os.getpid() != self._pid:
                sys.stderr.write(f'{record.levelname}:{record.name}:{record.getMessage()}\n')
                return
            body = _prepared(record)
            data = _HEADER.pack(len(body)) + body
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except Exception:  # noqa: BLE001 - as a handler does
            self.handleError(record)


def _prepared(record: logging.LogRecord) -> bytes:
    """The record, pickled: its message formatted, an exception as text."""
    values = dict(record.__dict__)
    values['msg'] = record.getMessage()
    values['args'] = None
    if record.exc_info:
        values['exc_text'] = (record.exc_text
                              or logging.Formatter().formatException(record.exc_info))
    values['exc_info'] = None
    values.pop('message', None)
    try:
        return pickle.dumps(values)
    except Exception:  # noqa: BLE001 - extra= values that do not pickle: as text
        return pickle.dumps({key: value if isinstance(value, (str, int, float, bool,
                                                             type(None))) else repr(value)
                             for key, value in values.items()})
