"""Running a command-line entry point so that a reader closing stdout early
(``python -m jaxtrain.knobs | head``) ends the command quietly: no traceback, no "Exception
ignored" message at exit, status 0 (the reader asked for no more). Every ``python -m`` entry
point of jaxtrain and of the benchmarks runs through :func:`run`.

Only a broken *stdout* is taken this way: a BrokenPipeError while stdout is still open (a
socket, a worker's pipe) is a real error and propagates.
"""
from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable


def stdout_closed() -> bool:
    """Whether stdout's reader has gone (a pipe whose read end is closed). Where that cannot
    be asked (no poll, stdout not a file), a BrokenPipeError counts as a closed stdout."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def run(main: Callable[..., int | None], *args) -> int:
    """``main(*args)``'s exit status, flushing stdout before returning; 0 when stdout's reader
    closed it (stdout is then pointed at /dev/null, so the interpreter's own flush at exit
    finds nothing to write)."""
    try:
        code = main(*args)
        sys.stdout.flush()
        return 0 if code is None else code
    except BrokenPipeError:
        if not stdout_closed():
            raise
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
    return 0
