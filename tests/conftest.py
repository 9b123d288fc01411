"""Every test runs on the CPU with 8 simulated devices; set before JAX starts. TRAINER_TEST_PLATFORMS=cuda
runs them on a GPU instead (the kernel tests that say so, such as test_attention's cuDNN check)."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

PLATFORM = os.environ.get("TRAINER_TEST_PLATFORMS", "cpu")
os.environ["JAX_PLATFORMS"] = PLATFORM
# XLA:CPU's concurrency-optimised scheduler lets one device's thread run an all-gather while another
# runs an independent all-reduce; with every one of the pool's threads in one of the two, neither gathers
# its participants and the process aborts after the collective timeout (seen: a train step on 8 simulated
# devices, 2 threads in an all-gather, 6 in an all-reduce). The memory-optimised schedule never did (5 of
# 5 runs of tests/test_huggingface.py, against 3 aborts in 5 without).
# The suite's programs are tiny, so compiling them costs far more than running them: LLVM at -O0 and XLA:CPU's
# classic loop emitters compile a micro train step on 8 devices in 1.8 s against 6.0 s with the defaults (the
# same loss to the last printed digit; 5 steps run in 0.12 s against 0.09). Users' runs keep XLA's defaults, and
# so do the guards of numbers marked xla_defaults: at -O0 a sum's order differs (one weight in 8,192 2.3e-5 off
# after test_moe's 4 steps, 1e-5 at the defaults). tests/test_xla_defaults.py runs them, with the equivalence
# tests, at TRAINER_TEST_XLA=defaults (-m slow). Only XLA:CPU compiles fast: a GPU run is as its users run it.
AT_XLA_DEFAULTS = os.environ.get("TRAINER_TEST_XLA") == "defaults" or PLATFORM != "cpu"
FAST_COMPILE = "" if AT_XLA_DEFAULTS else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
CPU_FLAGS = f"--xla_cpu_enable_concurrency_optimized_scheduler=false {FAST_COMPILE}"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {CPU_FLAGS}"
# Many tests compile the same small programs, in this process and in the training processes
# they start: a compilation cache shared through the environment compiles each once per session.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402
from time_limit import (  # noqa: E402, F401 - the suite's guard on its own speed: its hooks, found here
    pytest_fixture_setup,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

from trainer.config import defaults  # noqa: E402
from trainer.config.forms import flatten, from_file  # noqa: E402

# Qwen3.5's hybrid at micro size (model.* of micro_config): a Gated DeltaNet layer, then gated full attention
# (trainer/model/delta.py).
HYBRID = dict(layer_types=("linear_attention", "full_attention"), qk_norm=True, attention_gate=True,
              centred_norms=True, rope_fraction=0.5,
              linear=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8))  # fmt: skip


def micro_config(**sections):
    """A ~0.1M-parameter model that compiles in seconds; override with section=dict(...)."""
    c = defaults()
    c.model.update(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    c.data.update(seq_len=32, source="synthetic")
    c.precision.compute_dtype = "float32"
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.optim.update(lr=1e-2, warmup_steps=2, schedule="cosine")
    c.train.update(steps=20, global_batch_size=8, log_every=2, eval_every=0, eval_batches=2)
    c.checkpoint.update({"every_steps": 5, "keep": 2})
    for name, values in sections.items():
        c[name].update(values)
    return c


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_args(cfg) -> list[str]:
    """`--config configs/tiny.py` plus the overrides that turn it into `cfg`, for running scripts."""
    base = flatten(from_file(os.path.join(REPO, "configs", "tiny.py")))
    args = ["--config", "configs/tiny.py"]
    for key, value in flatten(cfg).items():
        if base[key] != value:
            args.append(f"--config.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return args


@dataclasses.dataclass
class Bucket:
    url: str  # gs://runs
    port: int  # where the emulator listens: gcs_emulator.fault(port, ...) makes it fail
    pid: int  # the emulator's process: SIGSTOP freezes the storage (every request hangs), SIGCONT thaws it


@pytest.fixture(scope="module")
def bucket():
    """A GCS emulator on localhost (tests/gcs_emulator.py) holding the bucket `runs`, with this process and the
    processes it starts pointed at it."""
    from gcs_emulator import environment

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "tests/gcs_emulator.py", str(port), "runs"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert server.stdout.readline().strip() == "ready"
    with pytest.MonkeyPatch.context() as m:
        for name, value in environment(port).items():
            m.setenv(name, value)
        yield Bucket("gs://runs", port, server.pid)
    server.kill()
    server.wait()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """The standard-library corpus, prepared once per test session."""
    from trainer.data import corpora

    path = str(tmp_path_factory.mktemp("tfds"))
    cfg = micro_config(data=dict(source="text_files", data_dir=path))
    corpora.prepare(cfg.data)
    return path


@pytest.fixture(scope="session")
def text_batches(corpus_dir):
    """20 batches of 16 x 32 standard-library tokens: the equivalence tests' shared data."""
    from trainer.data import streams

    cfg = micro_config(data=dict(source="text_files", data_dir=corpus_dir), train=dict(global_batch_size=16))
    stream = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(16), shuffle=True))
    return [next(stream) for _ in range(20)]


# The workers take whole files (their module fixtures are built once), in the order below, or single tests of
# the files in SPLIT, whose tests share nothing but session fixtures. A long file taken last sets how long the
# suite takes, so the longest (by the slowest tests CI lists) go first. (pytest-xdist's own loadgroup cannot
# do this under pytest 9.2: it renames a test by a field pytest no longer reads.)
SPLIT = ("test_benchmarks",)
LONGEST_FIRST = ("test_multiprocess", "test_lm_eval", "test_faults", "test_hang", "test_moe", "test_huggingface",
                 "test_grpo", "test_preparation", "test_loop", "test_lora", "test_context", "test_post_training",
                 "test_optimizers", "test_compile_cache", "test_evaluate", "test_targets", "test_local_tier",
                 "test_errors", "test_crash", "test_pipeline", "test_quant", "test_resume", "test_lora_peft",
                 "test_qlora", "test_data", "test_generate")  # fmt: skip
# pytest -m slow's files, the longest first (by their drills' times in a whole -m slow run, 2026-12-06: in the
# fast order above its long files came last and one worker ran them alone, 27 minutes in all).
SLOW_LONGEST_FIRST = ("test_targets", "test_faults", "test_xla_defaults", "test_hang", "test_moe", "test_preparation",
                      "test_precision", "test_pod", "test_scaling", "test_benchmarks", "test_local_tier",
                      "test_multiprocess", "test_elastic", "test_post_training")  # fmt: skip


@pytest.hookimpl(trylast=True)  # after -m has deselected: the order is of the tests that run
def pytest_collection_modifyitems(items):
    if not AT_XLA_DEFAULTS:
        skip = pytest.mark.skip(reason="its numbers hold at XLA's defaults: tests/test_xla_defaults.py runs it")
        for item in items:
            if item.get_closest_marker("xla_defaults"):
                item.add_marker(skip)

    order = SLOW_LONGEST_FIRST if all(item.get_closest_marker("slow") for item in items) else LONGEST_FIRST

    def rank(item):
        name = item.path.stem
        return order.index(name) if name in order else len(order)

    items.sort(key=rank)  # stable: tests keep their order within a file


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """xdist's scheduling by scope, the scope a file or, in SPLIT, a test; in collection order, which
        --no-loadscope-reorder keeps."""

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0]
            return nodeid if os.path.splitext(os.path.basename(file))[0] in SPLIT else file

    return ByFile(config, log)


def data_state(workdir, step):
    """Every row's stream position in the checkpoint at `step` (each process's file, merged)."""
    folder, rows = os.path.join(workdir, "checkpoints", str(step), "data"), {}
    for name in sorted(n for n in os.listdir(folder) if n.startswith("process_")):
        with open(os.path.join(folder, name)) as f:
            rows.update(json.load(f)["rows"])
    return rows
