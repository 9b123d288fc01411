"""Prepare a text_files corpus ahead of training: python scripts/prepare_data.py --config configs/tiny.py [--tokenize]

Training prepares it on first use too (process 0 alone); this script is for doing it
once before a multi-host job starts, into a shared filesystem or a bucket
(--config.data.data_dir=gs://bucket/tfds, read by every host straight from it), or
to see the split sizes.
--tokenize also writes its tokenised cache (the token ids, once) and trains
with it: the same as --config.data.tokenized=true.
"""

from absl import flags

from trainer import cli
from trainer.data import corpora
from trainer.storage import workdir as wd

_CONFIG = cli.define_config_flag()
_TOKENIZE = flags.DEFINE_bool("tokenize", False, "Also write the tokenised cache (data.tokenized=true).")


def main():
    cfg = _CONFIG.value
    data = cfg.data
    if _TOKENIZE.value:
        data.tokenized = True
    wd.wait_for_storage(corpora.data_dir(data), cfg.checkpoint.retry_seconds, print, "data.data_dir")
    corpora.prepare(data)
    sizes = {s: len(corpora.open_split(data, s)) for s in (data.train_split, data.eval_split)}
    print(f"{data.name} under {corpora.data_dir(data)}: " + ", ".join(f"{k} {v:,} documents" for k, v in sizes.items()))


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
