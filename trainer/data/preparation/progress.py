"""What a long preparation says while it runs: documents, bytes, tokens, rate and time left.

A thread of the preparing process reads the units' reports (trainer/data/preparation/work.py) and
prints a line every `every` seconds; when the output is a terminal it also redraws a progress bar in
place every second. The rate is of input read (the files' own bytes, compressed or not), so the time left
is the input left at that rate.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from trainer.data.preparation.work import read_reports
from trainer.storage.goodput import duration

EVERY_SECONDS = 30.0  # between two progress lines


class Progress(threading.Thread):
    def __init__(self, reports: str, name: str, total_bytes: int, say: Callable[[str], None]):
        super().__init__(name="trainer-prepare-progress", daemon=True)
        self._reports, self._name, self._total, self._say = reports, name, max(total_bytes, 1), say
        self._every = EVERY_SECONDS
        self._done, self._began = threading.Event(), time.monotonic()
        self._bar = sys.stdout.isatty()

    def run(self) -> None:
        last_line = time.monotonic()
        while not self._done.wait(1.0 if self._bar else min(self._every, 5.0)):
            if self._bar:
                sys.stdout.write("\r" + self._bar_text())
                sys.stdout.flush()
            if time.monotonic() - last_line >= self._every:
                last_line = time.monotonic()
                if self._bar:
                    sys.stdout.write("\r\033[K")
                self._say(self.line())

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)
        if self._bar:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()

    def totals(self) -> dict[str, float]:
        reports = read_reports(self._reports)
        return {k: sum(r[k] for r in reports) for k in ("documents", "text_bytes", "tokens", "read")}

    def line(self) -> str:
        t = self.totals()
        seconds = time.monotonic() - self._began
        rate = t["read"] / seconds if seconds > 0 else 0.0
        left = duration((self._total - t["read"]) / rate) if rate > 0 else "?"
        tokens = f", {t['tokens']:,.0f} tokens" if t["tokens"] else ""
        return (f"preparing {self._name}: {t['documents']:,.0f} documents, {t['text_bytes'] / 1e6:,.1f} MB of text"
                f"{tokens}; {100 * t['read'] / self._total:.0f}% of {self._total / 1e6:,.1f} MB read at "
                f"{rate / 1e6:.1f} MB/s, {left} left")  # fmt: skip

    def _bar_text(self) -> str:
        done = min(self.totals()["read"] / self._total, 1.0)
        filled = int(30 * done)
        return f"[{'#' * filled}{'.' * (30 - filled)}] {100 * done:3.0f}%  " + self.line().split(": ", 1)[1]
