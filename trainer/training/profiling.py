"""`train.profile_steps=(a, b)`: a jax.profiler trace of steps a..b in <workdir>/profile.

The trace starts before step a is dispatched and stops once step b's outputs
are ready, so it holds whole steps, device work included. Open it with
TensorBoard (`tensorboard --logdir <workdir>/profile`, Profile tab, needs the
tensorboard-plugin-profile package) or load the .xplane.pb / .trace.json.gz
in Perfetto (ui.perfetto.dev). Only the first process traces.
"""

from __future__ import annotations

import os

import jax


class StepProfiler:
    def __init__(self, window: tuple[int, int] | tuple[()], workdir: str, enabled: bool):
        self.window = tuple(window) if enabled and window else None
        self.dir = os.path.join(workdir, "profile")
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
        return f"profile of steps {self.window[0]}-{self.window[1]} written to {self.dir}"

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
