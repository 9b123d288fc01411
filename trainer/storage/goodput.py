"""Where a run's wall time went, across its launches (goodput).

Every second of a launch, from train() being called to its files being closed,
is in one phase, timed on process 0's clock:

    step        training steps: dispatching them and waiting on the device (productive)
    compile     compiling the train step (the first, and a batch-size ramp's new sizes)
    data        waiting for the next batch
    checkpoint  the part of a save that blocks training, and the last save's commit at the end
    eval        evaluations and samples, their compiles included
    rollback    restoring a checkpoint after trouble
    startup     checks, restoring or initialising, and closing down

Two kinds of lost work are then moved out of `step`: `lost_rollback`, the step
time of the steps a rollback undid, and `lost_restart`, that of the steps a
launch trained past the checkpoint the next launch resumed from (they are
trained again). `between_launches` is the time from one launch's last account
to the next one's start: a killed launch's last seconds (since its last log
point or save) and the next process's own start-up are in it.

The account lives in `goodput.json` in the workdir, rewritten whole (written
aside, then renamed) at every log point, save and at the end. Beside the
totals it keeps the productive seconds the run had when each kept checkpoint
was saved: what a rollback or a restart to that checkpoint loses is the
productive time since. The totals go into every logged record as
`goodput/<bucket>` (seconds), `goodput/total`, `goodput/own` (all but the time
between launches, which a scheduler spends, not the run) and `goodput/share`
(step / own), and are printed at the end of each launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

PHASES = ("step", "compile", "data", "checkpoint", "eval", "rollback", "startup")
BUCKETS = (*PHASES, "lost_rollback", "lost_restart", "between_launches")
LEDGER = "goodput.json"


class Goodput:
    """The run's time account; the launch's clock starts when this is made."""

    def __init__(self):
        self.seconds = dict.fromkeys(BUCKETS, 0.0)  # the run's, this launch's included
        self.current, self.since = "startup", time.perf_counter()
        self.started = time.time()
        self.at_save: dict[int, float] = {}  # checkpoint step -> the run's productive seconds when it was saved
        self.launches = 1
        self.file: str | None = None
        self.closed = False  # after the last write the clock stops: what is printed is what the file holds

    def open(self, files, step: int) -> float:
        """Carry on the account kept in the workdir (`files` None: a process that keeps none), for a launch
        that starts from `step` (a checkpoint's, or 0); returns what the restart cost: the time since the last
        launch's last account and the training it did past `step`."""
        if files is None:
            return 0.0
        self.file = files.fetch(LEDGER)
        before = None
        if os.path.exists(self.file):
            try:
                with open(self.file) as f:
                    before = json.load(f)
                if not {"seconds", "at", "at_save", "launches"} <= set(before):
                    raise KeyError("a field is missing")
            except (ValueError, KeyError, TypeError):  # an account must never stop a run: set aside, start again
                os.replace(self.file, self.file + ".unreadable")
                print(f"warning: {LEDGER} could not be read; kept as {LEDGER}.unreadable, the time account starts "
                      "again from this launch", flush=True)  # fmt: skip
                before = None
        lost = 0.0
        if before is not None:
            self._tick()
            for name in BUCKETS:
                self.seconds[name] += before["seconds"][name]
            gap = max(self.started - before["at"], 0.0)
            self.seconds["between_launches"] += gap
            self.at_save = {int(s): v for s, v in before["at_save"].items()}
            self.launches = before["launches"] + 1
            lost = self._lose_since(step, "lost_restart") + gap
        self.at_save[step] = self.seconds["step"]
        self.write()
        return lost

    def enter(self, phase: str) -> str:
        """Start timing `phase`; returns the phase that was being timed."""
        self._tick()
        before, self.current = self.current, phase
        return before

    @contextlib.contextmanager
    def phase(self, phase: str):
        before = self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def saved(self, step: int, kept: list[int]) -> None:
        """A checkpoint at `step` was saved; `kept` are the steps of the checkpoints still there."""
        self._tick()
        self.at_save = {s: v for s, v in self.at_save.items() if s in kept}
        self.at_save[step] = self.seconds["step"]
        self.write()

    def rolled_back(self, step: int) -> None:
        """Training went back to the checkpoint at `step`: the step time since it was saved is lost."""
        self._tick()
        self._lose_since(step, "lost_rollback")

    def totals(self) -> dict[str, float]:
        """`goodput/<bucket>` in seconds, `goodput/total` (every bucket), `goodput/own` (the launches' own time:
        all but between_launches, which is the scheduler's, not the run's to spend) and `goodput/share` (step /
        own): the run's account until now."""
        self._tick()
        total = sum(self.seconds.values())
        own = total - self.seconds["between_launches"]
        return {
            **{f"goodput/{name}": v for name, v in self.seconds.items()},
            "goodput/total": total,
            "goodput/own": own,
            "goodput/share": self.seconds["step"] / own if own else 0.0,
        }

    def write(self) -> None:
        if self.file is None:
            return
        self._tick()
        account = {"seconds": self.seconds, "at": time.time(), "launches": self.launches,
                   "at_save": {str(s): v for s, v in self.at_save.items()}}  # fmt: skip
        with open(self.file + ".tmp", "w") as f:
            json.dump(account, f)
        os.replace(self.file + ".tmp", self.file)  # a launch killed mid-write leaves the last whole account

    def close(self) -> None:
        """The launch's last account: written, and the clock stopped."""
        self.write()
        self.closed = True

    def summary(self) -> str:
        """One line: the productive share of the run's time so far and where the rest went."""
        t = self.totals()
        rest = ", ".join(f"{name.replace('_', ' ')} {duration(self.seconds[name])}" for name in BUCKETS[1:-1]
                         if self.seconds[name] >= 0.05)  # fmt: skip
        launches = f"{self.launches} launch{'es' * (self.launches > 1)}"
        between = self.seconds["between_launches"]
        return (f"goodput {100 * t['goodput/share']:.1f}%: {duration(self.seconds['step'])} of training steps in "
                f"{duration(t['goodput/own'])} of the run's own time over {launches} ({rest})"
                + (f"; {duration(between)} between launches, not counted" if between >= 0.05 else ""))  # fmt: skip

    def _tick(self) -> None:
        if self.closed:
            return
        now = time.perf_counter()
        self.seconds[self.current] += now - self.since
        self.since = now

    def _lose_since(self, step: int, bucket: str) -> float:
        """Move the productive seconds after the save at `step` to `bucket` (nothing when that save is not in
        the account: a workdir from before goodput was kept); returns them."""
        if step not in self.at_save:
            return 0.0
        lost = max(self.seconds["step"] - self.at_save[step], 0.0)
        self.seconds["step"] -= lost
        self.seconds[bucket] += lost
        self.at_save = {s: v for s, v in self.at_save.items() if s <= step}
        return lost


def duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
