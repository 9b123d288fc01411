"""Which devices a command runs on, said in one line instead of the accelerator plugins' start-up noise.

With the `gpu` and `tpu` extras installed, JAX's CUDA plugin and libtpu speak as
they load, on machines without their hardware too: a "could not find cuda
drivers" line from C++ at `import jax`, then at the first device query a Python
traceback from the CUDA plugin and libtpu's warnings about hosts and worker
names. None of it says more than "no GPU, no TPU here". So JAX is imported
(trainer/__init__.py), and its backends started (trainer/run/cli.py), with this
process's stderr (file descriptor 2: C++ and Python write there alike) held
back, and given back whole if the step fails. Training says once, in one line,
when it runs on the CPU (trainer/run/loop.py). (plan.py's targets start the CPU backend alone, which
loads no plugin.)
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def stderr_held_back():
    """Within, what this process writes to stderr is kept aside; it is written out after all if the block
    raises (the noise is then the explanation), unless with a ConfigError, whose sentence explains it."""
    from parallelism.config_error import ConfigError

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as e:
            sys.stderr.flush()
            os.dup2(saved, 2)
            if not isinstance(e, ConfigError):
                held.seek(0)
                os.write(2, held.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def simulate_devices(n: int, env: dict | None = None) -> None:
    """`n` simulated CPU devices for a process whose CPU backend has not started (`env`: a child's environment,
    else this process's), keeping the other XLA flags already set there: a test suite's compile options, a
    user's own. The last device count given is the one XLA takes."""
    env = os.environ if env is None else env
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])


def import_jax() -> None:
    """`import jax`, without the CUDA plugin's "could not find cuda drivers" on machines without a GPU."""
    if "jax" not in sys.modules:
        with stderr_held_back():
            import jax  # noqa: F401


def start() -> list:
    """Start JAX's backends, with their noise held back; this process's devices."""
    import jax

    with stderr_held_back():
        return jax.local_devices()
