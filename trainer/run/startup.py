"""Where a launch's seconds to its first step went, part by part.

On a pod every host pays its start-up at every preemption, so a launch says
where that went, once its first step has run: a `start-up:` line in its log, which
benchmarks/restart.py reads (`parse`). Each part runs from the end of the one
before:

    imports      the interpreter's start to the script's flags being read (Python, JAX, Flax, Orbax, ...)
    config       the config file and the flags parsed
    distributed  joining a multi-process run and starting JAX's backends
    checks       validation, the mesh, the model's definition, the workdir and data checked, the tokenizer stored
    open         held-out batches and the checkpoint manager opened
    state        the train state restored from a checkpoint, or initialised (the data stream's position with it)
    loop         the data reader, metrics files and watchers opened, the model described
    compile      the train step compiled, or loaded from the compile cache
    first batch  the first batch read
    first step   the first step dispatched and run

Where the process's start time cannot be read (no /proc), `imports` is left
out and the total starts at the first mark. A process that trains several
runs (the scaling sweep) times each later run from its own start.
"""

from __future__ import annotations

import os
import re
import time

PARTS = ("imports", "config", "distributed", "checks", "open", "state", "loop", "compile", "first batch",
         "first step")  # fmt: skip

SCRIPT = PARTS[:3]  # marked by the script (trainer/run/cli.py) before any run begins

_marks: list[tuple[str, float]] = []  # (part, perf_counter at its end), in order
_origin: list[float] = []  # perf_counter at the process's start, once known
_notes: dict[str, str] = {}  # what a part did: "restored step 20", "from the compile cache"


def _process_age() -> float | None:
    """Seconds since this process started, from the kernel's accounts (Linux), or None."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and brackets
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, in ticks after boot
    except (OSError, ValueError, IndexError):
        return None


def mark(part: str, note: str = "") -> None:
    """`part` (one of PARTS) has just ended; `note` says how it went."""
    now = time.perf_counter()
    if not _marks and not _origin:
        age = _process_age()
        _origin.append(now - age if age is not None and part == "imports" else now)
    _marks.append((part, now))
    if note:
        _notes[part] = note


def pending(part: str) -> bool:
    """Whether `part` is still to come in this launch."""
    return all(p != part for p, _ in _marks)


def launch_begins() -> None:
    """A run starts in this process: a process that already trained one times the next from here."""
    if any(part not in SCRIPT for part, _ in _marks) or not _origin:  # an earlier run's marks, or none at all
        _marks.clear()
        _notes.clear()
        _origin[:] = [time.perf_counter()]


def seconds() -> dict[str, float]:
    """Each part marked so far, in seconds."""
    out, before = {}, _origin[0] if _origin else None
    for part, at in _marks:
        if before is not None:
            out[part] = out.get(part, 0.0) + at - before
        before = at
    return out


def line() -> str:
    """The console line: the total, then each part with its note (`restored step 20`, `from the compile cache`)."""
    parts = seconds()
    said = ", ".join(f"{p} {s:.2f}s" + (f" ({_notes[p]})" if p in _notes else "") for p, s in parts.items())
    return f"start-up: {sum(parts.values()):.1f}s to the end of the first step: {said}"


def parse(text: str) -> dict[str, float]:
    """The parts of a `start-up:` line, in seconds."""
    said = text.split(": ", 2)[2]
    return {p: float(s) for p, s in re.findall(rf"({'|'.join(PARTS)}) ([\d.]+)s", said)}
