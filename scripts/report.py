"""One PNG of a run, or of several overlaid:

    python scripts/report.py --workdir runs/tiny [--workdir runs/other ...] [--out report.png]

Loss and evaluation loss, learning rate, gradient norm, update ratio, tokens/s
and MFU, with skipped steps and rollbacks marked (trainer/evaluation/report.py). The
default --out is report.png in the first workdir.
"""

import os

from absl import flags

from trainer.evaluation import report
from trainer.run import cli

_WORKDIRS = flags.DEFINE_multi_string("workdir", None, "A run directory; repeat to overlay runs.", required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write the PNG.")


def main():
    out = _OUT.value or os.path.join(_WORKDIRS.value[0], "report.png")
    print(f"wrote {report.write(_WORKDIRS.value, out)}")


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
