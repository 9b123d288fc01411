"""`train.profile_steps=(a, b)`: a jax.profiler trace of steps a..b in <workdir>/profile.

The trace starts before step a is dispatched and stops once step b's outputs
are ready, so it holds whole steps, device work included. Open it with
TensorBoard (`tensorboard --logdir <workdir>/profile`, Profile tab, needs the
tensorboard-plugin-profile package) or load the .xplane.pb / .trace.json.gz
in Perfetto (ui.perfetto.dev). Only the first process traces; into a bucket,
the trace is written locally and copied with the run's other growing files.
"""

from __future__ import annotations

import os

import jax

from trainer.storage.workdir import GrowingFiles


class StepProfiler:
    def __init__(self, window: tuple[int, int] | tuple[()], files: GrowingFiles | None, workdir: str):
        """`files` None: a process that does not trace."""
        self.window = tuple(window) if files is not None and window else None
        self.files = files
        self.dir = os.path.join(files.dir, "profile") if files is not None else None
        self.shown = os.path.join(workdir, "profile")
        self.active = False

    def before(self, step: int) -> None:
        """Call with the number of the step about to be dispatched."""
        if self.window and not self.active and self.window[0] <= step <= self.window[1]:
            jax.profiler.start_trace(self.dir)
            self.active = True

    def after(self, step: int, outputs) -> str | None:
        """Call with the step just dispatched and its outputs; returns a line to log when the trace is written."""
        if not (self.active and step >= self.window[1]):
            return None
        jax.block_until_ready(outputs)
        self.stop()
        self.files.sync()
        return f"profile of steps {self.window[0]}-{self.window[1]} written to {self.shown}"

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
