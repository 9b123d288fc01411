"""libtpu's silent-data-corruption checker on chosen steps (`train.sdc_check_every`).

Every `train.sdc_check_every`-th step runs as a second program of the same
step, compiled with libtpu's checker: the chip computes the program again and
compares (on the other core of a megacore chip, v4 and v5p; by a replicated
instruction stream on one-core chips, v5e and v6e), `xla_tpu_sdc_check_repeat_count`
times, and halts the program on a difference, so a corrupted update is never
applied. The other steps run the program without it, at full speed. The
flags are compile options of that one program, not the process's LIBTPU_INIT_ARGS,
which would check every step. Only a TPU has the checker: elsewhere the key is
refused in one sentence (`stability.rerun_bad_steps` computes a bad step again
on any platform). `plan.py --target` compiles the checked program beside the
step and names the flags.
"""

from __future__ import annotations

from trainer.config.errors import ConfigError

_EVERY_CHIP = {"xla_tpu_enable_sdc_checker": True, "xla_tpu_sdc_check_repeat_count": 1,
               "xla_tpu_sdc_check_halt_on_detection": True}  # fmt: skip
_MEGACORE = ("tpu-v4", "tpu-v5p")  # two TensorCores a chip: each checks the other's work


def compiler_options(chip: str | None) -> dict:
    """The compile options of the checked program on `chip` (parallelism/chips.py's name)."""
    if chip in _MEGACORE:
        return {**_EVERY_CHIP, "xla_tpu_sdc_checker_alternate_megacore_cores": True}
    return {**_EVERY_CHIP, "xla_tpu_sdc_replicate_llo": True}


def check(cfg, platform: str) -> None:
    if cfg.train.sdc_check_every and platform != "tpu":
        raise ConfigError(
            f"train.sdc_check_every={cfg.train.sdc_check_every} runs libtpu's silent-data-corruption checker, "
            f"which only a TPU has, and this run is on {platform}; set it to 0 "
            "(stability.rerun_bad_steps=true tells transient faults from persistent ones on any platform)."
        )


def checked(cfg, step: int) -> bool:
    """Whether step `step` (counted from 1) runs the checked program."""
    every = cfg.train.sdc_check_every
    return bool(every) and step % every == 0
