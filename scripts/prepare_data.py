"""Prepare a text_files corpus ahead of training: python scripts/prepare_data.py --config configs/tiny.py

Training prepares it on first use too; this script is for doing it once on a
shared filesystem before a multi-host job starts, or to see the split sizes.
"""

from trainer import cli
from trainer.data import streams

_CONFIG = cli.define_config_flag()


def main():
    data = _CONFIG.value.data
    streams.prepare(data)
    sizes = {s: len(streams.open_split(data, s)) for s in (data.train_split, data.eval_split)}
    print(f"{data.name} under {streams.data_dir(data)}: " + ", ".join(f"{k} {v:,} documents" for k, v in sizes.items()))


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
