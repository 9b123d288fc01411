"""Compiled programs kept between launches (trainer/storage/compile_cache.py): written by several processes at
once, loaded by a run in another workdir, and a damaged or unusable cache compiled around in one line."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, cli_args, micro_config

from trainer.storage.compile_cache import place


def final_loss(workdir) -> float:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line][-1]["loss"]


def compile_seconds(workdir) -> float:
    with open(os.path.join(workdir, "goodput.json")) as f:
        return json.load(f)["seconds"]["compile"]


@pytest.mark.slow  # six launches of train.py, 45 s (2026-12-06): room for the suite's 10 minutes
def test_programs_are_kept_shared_across_workdirs_and_a_damaged_cache_is_compiled_afresh(tmp_path):
    cache = tmp_path / "cache"
    args = cli_args(micro_config(train=dict(steps=4, log_every=2)))

    def start(name, where=cache):
        command = [sys.executable, "scripts/train.py", *args, f"--workdir={tmp_path / name}",
                   f"--config.train.compile_cache={where}"]  # fmt: skip
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(name, where=cache):
        proc = start(name, where)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        assert "Traceback" not in err and "persistent compilation cache" not in err, err[-2000:]
        return out

    # Two cold launches at once write the same entries into one cache.
    cold = [start("a"), start("b")]
    for proc in cold:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        assert "(loaded from the compile cache)" not in out
    entries = sorted(cache.iterdir())
    assert entries and all(e.name.endswith("-kept") for e in entries), entries  # no half-written file left
    baseline = final_loss(tmp_path / "a")
    assert final_loss(tmp_path / "b") == baseline

    # A third run, in its own workdir, loads its programs: JAX's key is the program, not the workdir.
    warm = run("c")
    assert "(loaded from the compile cache)" in warm
    assert compile_seconds(tmp_path / "c") < min(compile_seconds(tmp_path / w) for w in "ab")
    assert final_loss(tmp_path / "c") == baseline

    # Damage every entry (half cut short, half with a byte changed): said once, compiled afresh, replaced.
    for i, entry in enumerate(entries):
        data = bytearray(entry.read_bytes())
        if i % 2:
            data[-100] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        entry.write_bytes(bytes(data))
    damaged = run("d")
    assert damaged.count("cannot be loaded") == 1, damaged
    assert "(loaded from the compile cache)" not in damaged
    assert final_loss(tmp_path / "d") == baseline
    assert "(loaded from the compile cache)" in run("e")

    # A cache that cannot be written (its directory would be below a file): one line, and the run goes on.
    (tmp_path / "a-file").write_text("")
    unusable = run("f", tmp_path / "a-file" / "cache")
    assert unusable.count("cannot be used") == 1, unusable
    assert final_loss(tmp_path / "f") == baseline


def test_the_cache_is_placed_from_the_workdir_and_off_when_empty(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert place("../compile_cache", "/runs/a") == "/runs/compile_cache"
    assert place("../compile_cache", "gs://bucket/runs/a") == "gs://bucket/runs/compile_cache"
    assert place("../compile_cache", "gs://bucket") == "gs://bucket/compile_cache"  # not out of the bucket
    assert place("gs://other/cache", "/runs/a") == "gs://other/cache"
    assert place("~/cache", "/runs/a") == os.path.expanduser("~/cache")
    assert place("", "/runs/a") is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert place("../compile_cache", "/runs/a") == "/elsewhere"  # the default gives way to JAX's variable
    assert place("/mine", "/runs/a") == "/mine"


def test_a_bucket_holds_the_cache_as_a_local_directory_does(bucket):
    """The store in a bucket (the emulator): a program compiled once is kept as one object and loaded by a
    later compile of it (JAX's in-memory caches cleared in between, as a new process starts without them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.storage import compile_cache
    from trainer.storage.workdir import path

    try:
        kept = compile_cache.use(f"{bucket.url}/compile_cache")

        def program(x):
            return jnp.tanh(x @ x.T) * 3.0 + 1.0

        x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
        first = np.asarray(jax.jit(program)(x))
        entries = [p.name for p in path(f"{bucket.url}/compile_cache").iterdir()]
        assert entries and all(e.endswith("-kept") for e in entries), entries
        jax.clear_caches()
        hits = kept.hits
        np.testing.assert_array_equal(np.asarray(jax.jit(program)(x)), first)
        assert kept.hits > hits
    finally:
        compile_cache.use(compile_cache.place(compile_cache.DEFAULT, None))  # the suite's own cache again
