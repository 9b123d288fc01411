"""A command's own sentence last, with nothing of the libraries' winding down before or after it.

When a read of a checkpoint fails because the storage refused it, Orbax, TensorStore and gcsfs go on
writing while they wind down, from Python and C++ threads alike: gcsfs's prefetcher logs each failed
request with its traceback, Orbax's signalling thread logs the error, and TensorStore's reads that finish
after Orbax closed its asyncio loop each print "RuntimeError: Event loop is closed". None of it says more
than the sentence the run stops with (trainer/storage/faults.py), and it came before it.

So a checkpoint read holds back what the process writes to stderr (`held_while_reading`): written out if
the read succeeds, dropped if it fails (the error is then classified and said). And once a run knows it
stops on such trouble, a command lets nothing but its own prints reach stderr from then on
(`from_now_on`, which trainer/run/cli.py sets as `when_stopping`): its one sentence, and the other
processes' watchdogs' in a multi-process run.
A library caller (a test, a notebook) keeps its stderr: `when_stopping` does nothing unless a command
asked for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import TextIO

_kept: TextIO | None = None  # a stream on what was stderr, once from_now_on() has run
_real: int | None = None  # while a read holds stderr back: a descriptor of the stderr it holds back from


def _nothing() -> None:
    pass


when_stopping: Callable[[], None] = _nothing  # called the moment a run knows it stops on storage trouble


def from_now_on() -> None:
    """For the rest of the process, what the libraries write goes nowhere, what we print still shows
    (idempotent): file descriptor 2 (C++'s writes) leads to /dev/null, sys.stderr to the stream that was
    stderr, and Python's own reports of errors nobody waits for (logging, warnings, unraisable exceptions,
    exceptions ending a thread) are dropped."""
    global _kept
    if _kept is not None:
        return
    sys.stderr.flush()
    _kept = os.fdopen(os.dup(2 if _real is None else _real), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    sys.stderr = _kept
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    sys.unraisablehook = threading.excepthook = lambda *_: None


@contextlib.contextmanager
def held_while_reading(stops: Callable[[BaseException], bool]):
    """What this process writes to stderr within is kept aside: written out if the block succeeds, dropped
    if it raises (a failed read, whose error the caller says in its own words). If `stops(error)`, the run
    stops on it: when_stopping() runs before stderr is given back, so nothing that follows reaches it."""
    global _real
    if _kept is not None or _real is not None:  # already quiet, or held by an enclosing read
        yield
        return
    sys.stderr.flush()
    _real = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        except BaseException as e:
            if stops(e):
                when_stopping()
            raise
        finally:
            sys.stderr.flush()
            if _kept is None:  # not quiet from now on: stderr is given back
                os.dup2(_real, 2)
            os.close(_real)
            _real = None
            if not failed:
                held.seek(0)
                os.write(2, held.read())
