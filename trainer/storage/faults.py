"""Telling a checkpoint whose own bytes are bad from trouble around it.

A restore can fail because a file of the checkpoint is missing, truncated or
undecodable (DAMAGED: the checkpoint is set aside and an older one tried), or
because of its surroundings: the device or host ran out of memory, the storage
refused the credentials, answered 429 or 5xx, timed out or could not be
reached. Setting a checkpoint aside for the second kind would lose it for
nothing (every older one fails the same way), so those move nothing: TRANSIENT
ones are retried for a while, the rest STOP the run with a sentence. An error
that is neither is taken as trouble too: never lose a checkpoint on a guess.

Orbax, TensorStore and gcsfs report all of these as many exception types,
often a bare Exception whose cause holds the real one, so the whole chain is
read: types first, then the status words TensorStore (absl codes) and the
HTTP clients put in their messages.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from trainer.config import last_words
from trainer.config.errors import StorageError

OK, DAMAGED, TRANSIENT, STOP = 0, 1, 2, 3  # ordered: the worst verdict of any process decides for all

# absl status codes TensorStore puts first in its messages.
_TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")
_REFUSED_CODES = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED")
# FAILED_PRECONDITION: a file shorter than its index says, read from a bucket ("Unexpected Content-Range").
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")
_HTTP_TRANSIENT = {408, 429, 500, 502, 503, 504}
_HTTP_REFUSED = {401, 403}
# An HTTP status as TensorStore writes it ('HTTP response code: 503'); gcsfs's errors carry it as `.code`.
# Nothing looser: a damaged array's message is full of numbers ('slice(0, 500, 1)').
_HTTP_STATUS = re.compile(r"(?:HTTP[^0-9]{0,20}|status[ =:]{1,3}|code[ =:]{1,3})([1-5]\d\d)\b", re.IGNORECASE)


def chain(error: BaseException) -> list[BaseException]:
    """The error and everything that caused it (explicitly or while handling), each once."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return seen


def _http_status(e: BaseException) -> int | None:
    for attribute in ("code", "status", "status_code"):
        value = getattr(e, attribute, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    match = _HTTP_STATUS.search(str(e))
    return int(match.group(1)) if match else None


def _verdict_of(e: BaseException) -> int | None:
    import requests

    text = str(e)
    status = _http_status(e)
    if isinstance(e, MemoryError | PermissionError) or status in _HTTP_REFUSED or text.startswith("Forbidden"):
        return STOP
    if any(re.search(rf"\b{code}\b", text) for code in _REFUSED_CODES) or "Out of memory" in text:
        return STOP
    if isinstance(e, TimeoutError | ConnectionError | requests.exceptions.RequestException):
        return TRANSIENT
    if status in _HTTP_TRANSIENT:
        return TRANSIENT
    if any(re.search(rf"\b{code}\b", text) for code in _TRANSIENT_CODES):
        return TRANSIENT
    if isinstance(e, FileNotFoundError | json.JSONDecodeError | UnicodeDecodeError | EOFError | Damaged):
        return DAMAGED
    if any(re.search(rf"\b{code}\b", text) for code in _DAMAGE_CODES):
        return DAMAGED
    return None


class Damaged(OSError):
    """A checkpoint found incomplete by our own reading (an item missing)."""


def verdict(error: BaseException | None) -> int:
    """OK, DAMAGED, TRANSIENT or STOP for what a restore raised (None: it did not)."""
    if error is None:
        return OK
    found = {_verdict_of(e) for e in chain(error)} - {None}
    if STOP in found or TRANSIENT in found:
        return max(found)
    return DAMAGED if DAMAGED in found else STOP


def storage_trouble(error: BaseException) -> int | None:
    """STOP or TRANSIENT where something in the error's chain is the storage's own answer (a refusal, 429 or
    5xx by HTTP status or TensorStore's status words); None where nothing is (a bug is not the storage's)."""
    found = set()
    for e in chain(error):
        text, status = str(e), _http_status(e)
        refused = any(re.search(rf"\b{code}\b", text) for code in ("PERMISSION_DENIED", "UNAUTHENTICATED"))
        if status in _HTTP_REFUSED or text.startswith("Forbidden") or refused:
            found.add(STOP)
        elif status in _HTTP_TRANSIENT or any(re.search(rf"\b{code}\b", text) for code in _TRANSIENT_CODES):
            found.add(TRANSIENT)
    return max(found) if found else None


def summary(error: BaseException) -> str:
    """The most telling line of an error chain: its root cause, on one line, not too long."""
    e = chain(error)[-1] if _verdict_of(error) is None else error
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:240]


def retrying(what: str, read: Callable[[], object], seconds: float, say: Callable[[str], None]):
    """`read()`, retried with backoff while the storage fails transiently, for up to `seconds`.

    Trouble that is not transient, or transient trouble that outlasts `seconds`, ends in a StorageError
    naming `what`, the error and what to do; any other error is raised as it is."""
    deadline, wait = time.monotonic() + seconds, 1.0
    while True:
        try:
            return read()
        except Exception as e:
            kind = verdict(e)
            if kind == TRANSIENT and time.monotonic() < deadline:
                say(f"{what} failed ({summary(e)}); retrying in {wait:.0f}s")
                time.sleep(wait)
                wait = min(2 * wait, 60.0)
                continue
            if kind in (TRANSIENT, STOP):
                raise StorageError(stopped(what, e, kind, seconds)) from e
            raise


def stopped(what: str, error: BaseException | None, kind: int, seconds: float) -> str:
    """The sentence a run stops with when its storage or memory, not its files, failed (`error` None: on
    another process, whose log names it). From here on a command's stderr holds nothing but that sentence
    (trainer/config/last_words.py)."""
    last_words.when_stopping()
    if error is None:
        return f"{what} failed on another process (its log names the error); nothing was moved or deleted."
    if kind == TRANSIENT:
        fix = f"the storage kept failing for {seconds:g} s (checkpoint.retry_seconds); rerun once it answers"
    elif "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error) or isinstance(error, MemoryError):
        fix = "out of memory: restore onto more devices or a mesh that shards the state further, then rerun"
    else:
        fix = "check the path, the credentials and their permissions, then rerun"
    return f"{what} failed ({summary(error)}); nothing was moved or deleted; {fix}."
