"""Train a model, or resume it: python scripts/train.py --config configs/tiny.py [--workdir DIR]

Any config key can be overridden: --config.optim.lr=1e-3 --config.mesh.tensor=2.
Running the same command on the same workdir resumes from its newest checkpoint.
"""

import sys

from absl import flags

from trainer.run import cli
from trainer.run.loop import train

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")


def main():
    result = train(_CONFIG.value, _WORKDIR.value or cli.default_workdir())
    if "preempted" not in result:
        cli.say_next(result, _CONFIG.value, _WORKDIR.value, sys.argv)


if __name__ == "__main__":
    cli.run(main)
