"""The train step's compiled programs: one per batch size (a batch-size ramp uses a few), compiled ahead
of time on first use; with `train.sdc_check_every` on a TPU, a second one per size that libtpu compiled
with its silent-data-corruption checker (trainer/training/sdc.py), run on the chosen steps only."""

from __future__ import annotations

import time

from parallelism.chips import chip_of
from trainer.run import startup
from trainer.storage import compile_cache
from trainer.training import sdc
from trainer.training.step import memory_per_device


class StepPrograms:
    def __init__(self, setup, abstract, micro: int, hang, goodput, say):
        self.setup, self.abstract, self.micro = setup, abstract, micro
        self.hang, self.goodput, self.say = hang, goodput, say
        self.compiled: dict[tuple[int, bool], object] = {}

    def get(self, size: int, checked: bool = False) -> tuple[object, float]:
        """(the program for a batch of `size` sequences, the seconds spent compiling it now: 0 if it was)."""
        if (size, checked) in self.compiled:
            return self.compiled[size, checked], 0.0
        s, batch = self.setup, self.setup.abstract_batch(size)
        device = s.mesh.devices.flat[0]
        options = sdc.compiler_options(chip_of(device.device_kind)) if checked else {}
        cache = compile_cache.in_use()
        hits = cache.hits if cache else 0
        with self.hang.suspended(), self.goodput.phase("compile"):  # no hang: a ramp's new size, the checker's
            start = time.perf_counter()
            lowered = s.train_step(size // self.micro).lower(self.abstract, batch, *s.step_inputs())
            program = self.compiled[size, checked] = lowered.compile(compiler_options=options or None)
            seconds = time.perf_counter() - start
        used = memory_per_device(program, device.platform)["total"]
        kept = " (loaded from the compile cache)" if cache and cache.hits > hits else ""
        if startup.pending("compile"):  # a batch-size ramp's later sizes are not the launch's
            startup.mark("compile", "from the compile cache" if kept else "compiled")
        what = f"the train step under libtpu's checker ({', '.join(options)})" if checked else "the train step"
        self.say(f"compiled {what} for {size} sequences in {seconds:.1f}s{kept}, {used / 2**30:.2f} GiB per device")
        return program, seconds
