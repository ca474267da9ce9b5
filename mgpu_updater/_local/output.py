"""What the workers print and log, written out by the master, where the script's own goes.

Under ``StandardUpdater`` the model, the dataset and the converter print and log in the
script's process: to its ``sys.stdout`` and ``sys.stderr`` as the script set them (a tee
into a file, ``contextlib.redirect_stdout``, a notebook's cell) and through the logging
handlers it configured, often inside ``if __name__ == '__main__':``, which a spawned
worker does not run. A worker's file descriptors 1 and 2 are therefore pipes to the
master (:func:`attach`), and a thread of the master (:class:`Relay`) writes what comes
through them to the master's ``sys.stdout`` and ``sys.stderr`` as they are at that moment,
whatever writes there: Python, C code, the processes the worker forks (a
``MultiprocessIterator``'s). The worker's ``sys.stdout`` is line-buffered (and writes
through where the master's does, ``python -u``), so a worker killed at shutdown loses no
whole line, where a block buffer lost everything it held.

Logging: where the master has handlers and the worker, after importing the script's
modules, has none (the script configured logging in its main block), the worker takes the
master's logger levels and sends each record (:class:`RecordSender`) to the master, which
hands it to the logger of its name (:func:`_handle_record`): its handlers, formats and
files, with the worker's process name and id in the record. A worker whose modules
configured logging themselves (at import) keeps its own handlers.
"""
from __future__ import annotations

import codecs
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
from typing import Any, Dict, NamedTuple, Optional, Tuple

_READ = 65536
_HEADER = struct.Struct('<I')
DRAIN_TIMEOUT = 1.0   # seconds close() waits for output still in the pipes


class WorkerOutput(NamedTuple):
    """The write ends a worker takes as its stdout, its stderr and its records' pipe
    (picklable for ``spawn`` and ``forkserver``), and how the master writes."""
    stdout: Connection
    stderr: Connection
    records: Connection
    write_through: bool                  # the master's stdout writes through (python -u)
    levels: Dict[str, Any]               # logger name ('' root) -> (level, disabled)
    disable: int                         # logging.disable's level in the master
    master_logs: bool                    # the master has a logging handler somewhere


class _Pipe:
    """A read end and what it carries: 'stdout', 'stderr' or 'records'."""

    def __init__(self, fd: int, kind: str) -> None:
        self.fd = fd
        self.kind = kind
        self.decoder = codecs.getincrementaldecoder('utf-8')('replace')
        self.pending = b''   # records: the bytes of a record not whole yet


class Relay:
    """The master's end: one thread for every worker's pipes (started with the first)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._open: Dict[int, _Pipe] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread: Optional[threading.Thread] = None
        self._stop = False

    def ends(self) -> WorkerOutput:
        """New pipes for a worker about to start: what it takes (the master closes its
        copies of the write ends once the worker has started: :func:`started`)."""
        writes = []
        pipes = []
        for kind in ('stdout', 'stderr', 'records'):
            read, write = os.pipe()
            pipes.append(_Pipe(read, kind))
            writes.append(write)
        with self._lock:
            for pipe in pipes:
                self._open[pipe.fd] = pipe
                self._selector.register(pipe.fd, selectors.EVENT_READ, pipe)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name='mgpu-output', daemon=True)
            self._thread.start()
        self._wake()
        levels, disable, master_logs = _logging_setup()
        out = getattr(sys.stdout, 'write_through', False) is True
        return WorkerOutput(*(Connection(fd, readable=False) for fd in writes),
                            write_through=out, levels=levels, disable=disable,
                            master_logs=master_logs)

    def close(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Write out what the pipes still hold, waiting until every writer closed its end
        (the workers are gone by now) or ``timeout``; then stop."""
        deadline = time.monotonic() + timeout
        while self._open and self._thread is not None and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for pipe in list(self._open.values()):
                self._forget(pipe)
            self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b'.')
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop:
            try:
                events = self._selector.select()
            except (OSError, ValueError):   # closed under it
                return
            for key, _ in events:
                if key.fd == self._wake_r:
                    try:
                        os.read(self._wake_r, _READ)
                    except OSError:
                        pass
                    continue
                pipe = key.data
                try:
                    data = os.read(pipe.fd, _READ)
                except OSError:
                    data = b''
                if data:
                    _deliver(pipe, data)
                else:
                    _deliver(pipe, b'', final=True)
                    with self._lock:
                        self._forget(pipe)

    def _forget(self, pipe: _Pipe) -> None:
        if self._open.pop(pipe.fd, None) is None:
            return
        try:
            self._selector.unregister(pipe.fd)
        except (KeyError, ValueError):
            pass
        os.close(pipe.fd)


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
            _handle_record(body)
        return
    text = pipe.decoder.decode(data, final)
    if text:
        _write(pipe.kind, text)


def _write(kind: str, text: str) -> None:
    """``text`` to the master's ``sys.stdout`` or ``sys.stderr`` as it is now (the
    interpreter's own where the script set it to None)."""
    for stream in (getattr(sys, kind), getattr(sys, f'__{kind}__')):
        if stream is None:
            continue
        try:
            stream.write(text)
            stream.flush()
            return
        except Exception:  # noqa: BLE001 - a closed or failing stream: the next, or none
            continue


def _handle_record(body: bytes) -> None:
    try:
        record = logging.makeLogRecord(pickle.loads(body))
        logging.getLogger(record.name or None).handle(record)
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
        if isinstance(stream, io.TextIOWrapper):
            try:
                stream.reconfigure(line_buffering=True,
                                   write_through=output.write_through or name == 'stderr')
            except Exception:  # noqa: BLE001 - as it was
                pass


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


def flush() -> None:
    """In a worker that stops: what its streams still hold, out (a partial line)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
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
