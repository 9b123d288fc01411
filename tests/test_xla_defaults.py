"""The guards of numbers at the XLA that users run. The suite compiles XLA:CPU at -O0 with its classic emitters
(tests/conftest.py: 3x faster compiles); a sum's order differs there, so the tests that hold a mesh, a resume or
an import to fp32 rounding run again here at XLA's defaults, in their own process (XLA reads its flags once),
and so do the tests marked xla_defaults, whose tolerances hold only at the defaults."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

GUARDS = (
    "tests/test_moe.py::test_a_run_with_experts_trains_resumes_onto_another_expert_axis_and_decodes",
    "tests/test_equivalence.py::test_every_mesh_trains_like_one_device",
    "tests/test_step.py::test_microbatch_accumulation_equals_the_full_batch",
    "tests/test_huggingface.py::test_exported_checkpoint_gives_transformers_our_logits",
)


@pytest.mark.slow
def test_the_guards_of_numbers_hold_at_xla_defaults():
    env = {**os.environ, "TRAINER_TEST_XLA": "defaults", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-m", "not slow", "-p", "no:cacheprovider",
                           "-q", *GUARDS], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " skipped" not in done.stdout.splitlines()[-1], tail  # the marked ones ran, not skipped again
