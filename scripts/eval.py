"""Evaluate a checkpoint on the held-out split, on any mesh:

    python scripts/eval.py --config configs/tiny.py --workdir runs/tiny [--step N] [--config.mesh.tensor=2]

Restores parameters only and reads data.eval_split once through, each process
its own rows' documents (override --config.data.* to evaluate another dataset);
says how far it has got, then how many documents and tokens it read. Prints one JSON line
{"step", "loss", "perplexity", "bits_per_byte", ...} last and writes it to
<workdir>/eval/<split>_step<N>.json.
"""

import json

from absl import flags

from trainer.evaluation.loss import evaluate_checkpoint
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
_MAX_BATCHES = flags.DEFINE_integer("max_batches", 0, "Stop after this many batches (0 = the whole split).")
cli.at_least(_MAX_BATCHES, 0, "must be 0 (the whole split) or more.")


def main():
    result = evaluate_checkpoint(
        _CONFIG.value, _WORKDIR.value or cli.default_workdir(), _STEP.value, _MAX_BATCHES.value
    )
    print(json.dumps(result))  # last: the record, whose "file" says where it was written


if __name__ == "__main__":
    cli.run(main)
