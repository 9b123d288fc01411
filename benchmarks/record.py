"""Writing benchmark results down: one JSON line on stdout, optionally a row in RESULTS.md.

A row holds the date, the commit the code was at, the machine, the exact command
and the figures, so that a number is never quoted without where it came from,
and a row measured on old code shows it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def machine() -> str:
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    return f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {len(devices)} x {kind} ({jax.__version__})"


def commit() -> str:
    """The commit the measured code is at, with "+" when files other than RESULTS.md differ from it."""
    repo = os.path.dirname(os.path.dirname(RESULTS))

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)

    head = git("rev-parse", "--short=7", "HEAD")
    if head.returncode:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/RESULTS.md").stdout
    return head.stdout.strip() + ("+" if changed.strip() else "")


def report(name: str, figures: dict, *, append: bool) -> None:
    at = commit()
    print(json.dumps({"benchmark": name, "commit": at, **figures}))
    if not append:
        return
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    shown = ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    row = f"| {datetime.date.today()} | {name} | {at} | {machine()} | `{command}` | {shown} |\n"
    with open(RESULTS, "a") as f:
        f.write(row)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
