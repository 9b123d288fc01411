"""Writing benchmark results down: one JSON line on stdout, optionally a row in RESULTS.md.

A row holds the date, the machine, the exact command and the figures, so that a
number is never quoted without where it came from.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def machine() -> str:
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    return f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {len(devices)} x {kind} ({jax.__version__})"


def report(name: str, figures: dict, *, append: bool) -> None:
    print(json.dumps({"benchmark": name, **figures}))
    if not append:
        return
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    shown = ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    row = f"| {datetime.date.today()} | {name} | {machine()} | `{command}` | {shown} |\n"
    if not os.path.exists(RESULTS):
        with open(RESULTS, "w") as f:
            f.write("# Benchmark results\n\nEach row: date, benchmark, machine, command, figures.\n\n")
            f.write("| date | benchmark | machine | command | figures |\n| --- | --- | --- | --- | --- |\n")
    with open(RESULTS, "a") as f:
        f.write(row)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
