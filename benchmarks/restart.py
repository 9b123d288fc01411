"""Seconds from launch to the first training step, with an empty compile cache and then a warm one.

    python benchmarks/restart.py --config configs/llm_1b.py --simulate_devices 8 [overrides] [--to_end] [--append]

Launches scripts/train.py twice, each in a fresh workdir (so both do the same
start-up work: checks, initialisation, compiles) and with the same fresh
`train.compile_cache`: cold, then warm. The first step is reached when the loop
says the train step is compiled, the line before it dispatches the first step;
without --to_end the launch is ended there (a 1B model's step takes minutes on a
CPU), with it the run goes on to its end and its goodput line is recorded too.
Data is synthetic: only start-up is measured.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_SIMULATE = flags.DEFINE_integer("simulate_devices", 1, "Train on this many simulated CPU devices.")
_TO_END = flags.DEFINE_bool("to_end", False, "Let each launch train to its end and record its goodput line.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED = re.compile(r"compiled the train step for \d+ sequences in ([\d.]+)s")


def launch(overrides: list[str], workdir: str, cache: str) -> dict:
    """One launch: seconds to the first step, the train step's compile seconds, and the goodput line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_SIMULATE.value}"
    command = [sys.executable, "scripts/train.py", "--config", cli.config_path(), *overrides, f"--workdir={workdir}",
               f"--config.train.compile_cache={cache}"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        compiled = COMPILED.search(line)
        if compiled and "first_step_s" not in found:
            found.update(first_step_s=time.perf_counter() - start, compile_s=float(compiled.group(1)),
                         loaded="(loaded from the compile cache)" in line)  # fmt: skip
            if not _TO_END.value:
                proc.send_signal(signal.SIGKILL)
        if line.startswith("goodput"):
            found["goodput"] = line.strip()
    proc.wait()
    if "first_step_s" not in found:
        raise SystemExit(f"the launch never reached its first step:\n{''.join(lines[-30:])}")
    return found


def main():
    # This process names the machine in the row: the devices the launches train on.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_SIMULATE.value}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    with tempfile.TemporaryDirectory() as folder:
        cache = os.path.join(folder, "compile_cache")
        cold = launch(overrides, os.path.join(folder, "cold"), cache)
        warm = launch(overrides, os.path.join(folder, "warm"), cache)
    assert not cold["loaded"] and warm["loaded"], "the warm launch did not load its train step from the cache"
    figures = {
        "config": os.path.basename(cli.config_path()),
        "devices": _SIMULATE.value,
        "cold_first_step_s": cold["first_step_s"],
        "warm_first_step_s": warm["first_step_s"],
        "warm_over_cold": warm["first_step_s"] / cold["first_step_s"],
        "cold_compile_s": cold["compile_s"],
        "warm_compile_s": warm["compile_s"],
    }
    if _TO_END.value:
        print(f"cold: {cold['goodput']}\nwarm: {warm['goodput']}")
    report("restart", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
