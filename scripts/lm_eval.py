"""Downstream tasks on a checkpoint, through EleutherAI's lm-evaluation-harness (pip install -e ".[eval]"):

    python scripts/lm_eval.py --config configs/tiny.py --workdir runs/tiny --tasks hellaswag,arc_easy \\
        [--step N] [--limit K] [--num_fewshot F] [--include_path DIR] [--config.mesh.tensor=2]

Runs on the config's mesh (every process of a multi-process run takes part). The
tasks' data comes from the Hugging Face Hub or its cache; --include_path adds a folder
of task YAML files, which may read local files. Prints the harness's tables and
writes its results and per-request samples to <workdir>/lm_eval/step<N>/.
"""

import os
import sys

# This file has the harness's package name, and Python puts its folder first on the path: take it off, so
# that `import lm_eval` finds the harness.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from absl import flags  # noqa: E402

from trainer.interop import harness  # noqa: E402
from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_TASKS = flags.DEFINE_list("tasks", None, "Comma-separated task (or group) names, as the harness names them.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
_LIMIT = flags.DEFINE_float(
    "limit",
    0,
    "At most this many documents per task (below 1: that share of them; 0: all of them, as train.harness_limit=0).",
)
cli.at_least(_LIMIT, 0, "must be 0 (every document) or more: a count of documents per task, or below 1 a share of "
             "them.")  # fmt: skip
_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "Examples in each prompt; default each task's own.")
_INCLUDE = flags.DEFINE_string("include_path", "", "A folder of task YAML files of your own.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap_iters", 100000, "Resamples for standard errors (0: none).")
_SAMPLES = flags.DEFINE_bool("log_samples", True, "Also write every request and the model's answer.")
flags.mark_flags_as_required(["tasks"])


def main():
    harness.load().evaluate_checkpoint(
        _CONFIG.value, _WORKDIR.value or cli.default_workdir(), _TASKS.value, _STEP.value, limit=_LIMIT.value,
        num_fewshot=_FEWSHOT.value, include_path=_INCLUDE.value, bootstrap_iters=_BOOTSTRAP.value,
        log_samples=_SAMPLES.value,
    )  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
