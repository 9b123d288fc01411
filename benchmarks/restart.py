"""Seconds from launch to the first training step, part by part: a cold fresh launch, a warm one, a resume.

    python benchmarks/restart.py --config configs/llm_1b.py --simulate_devices 8 [overrides] [--append]

Three launches of scripts/train.py, sharing one fresh `train.compile_cache`:

    cold    a new workdir, the cache empty; after its first step it is sent SIGTERM, as a preemption, and
            saves a checkpoint there
    warm    another new workdir, the cache warm: a fresh run's start-up when its programs are kept
    resume  the cold launch's workdir again, the cache warm: the relaunch after a preemption

Each reports its `start-up:` line (trainer/run/startup.py: imports, config, distributed, checks, open, state,
loop, compile, first batch, first step); `<launch>_to_step_s` is the launch to the
first step's dispatch (every part but the step itself, which does not change with how the launch began), and
`<ratio>` the warm launches' over the cold one's. The warm and resume launches are ended once their first step
has run. Every launch is given train.steps=1000000 (it never gets there): the resume must have steps to take.
"""

import os
import signal
import subprocess
import sys
import tempfile

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from parallelism import accelerators  # noqa: E402
from trainer.run import cli, startup  # noqa: E402

_CONFIG = cli.define_config_flag()
_SIMULATE = flags.DEFINE_integer("simulate_devices", 1, "Train on this many simulated CPU devices.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(overrides: list[str], workdir: str, cache: str, end: signal.Signals) -> dict[str, float]:
    """One launch, sent `end` once its first step has run; its start-up parts in seconds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    accelerators.simulate_devices(_SIMULATE.value, env)
    command = [sys.executable, "scripts/train.py", "--config", cli.config_path(), *overrides, f"--workdir={workdir}",
               f"--config.train.compile_cache={cache}"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, parts = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("start-up: "):
            parts = startup.parse(line)
            proc.send_signal(end)
    if proc.wait() not in (0, -signal.SIGKILL) or parts is None:
        raise SystemExit(f"the launch did not reach and end its first step:\n{''.join(lines[-30:])}")
    return parts


def main():
    # This process names the machine in the row: the devices the launches train on.
    accelerators.simulate_devices(_SIMULATE.value)
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Each launch is ended after its first step; the resume must have steps left to take.
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.") and not a.startswith("--config.train.steps=")]
    overrides.append(f"--config.train.steps={10**6}")
    with tempfile.TemporaryDirectory() as folder:
        cache, run = os.path.join(folder, "compile_cache"), os.path.join(folder, "run")
        launches = {
            "cold": launch(overrides, run, cache, signal.SIGTERM),
            "warm": launch(overrides, os.path.join(folder, "warm"), cache, signal.SIGKILL),
            "resume": launch(overrides, run, cache, signal.SIGKILL),
        }
    figures = {"config": os.path.basename(cli.config_path()), "devices": _SIMULATE.value}
    for name, parts in launches.items():
        figures[f"{name}_to_step_s"] = sum(parts.values()) - parts.get("first step", 0.0)
    for name in ("warm", "resume"):
        figures[f"{name}_over_cold"] = figures[f"{name}_to_step_s"] / figures["cold_to_step_s"]
    for name, parts in launches.items():
        for part in startup.PARTS:
            figures[f"{name}_{part.replace(' ', '_')}_s"] = parts.get(part, 0.0)
    report("restart", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
