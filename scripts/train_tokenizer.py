"""Train a SentencePiece tokenizer on a config's training split, offline:

    python scripts/train_tokenizer.py --config configs/small.py [--vocab_size 32000]

Writes the model to the config's data.tokenizer_path. The vocabulary size
defaults to model.vocab_size.
"""

import os

from absl import flags

from trainer.config.errors import ConfigError
from trainer.data import corpora
from trainer.data.tokenizers import train_sentencepiece
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_VOCAB = flags.DEFINE_integer("vocab_size", 0, "Tokenizer size; default model.vocab_size.")


def main():
    cfg = _CONFIG.value
    path = cfg.data.tokenizer_path
    if not path:
        raise ConfigError("set data.tokenizer_path to where the tokenizer model should be written.")
    if os.path.exists(path):
        raise ConfigError(f"{path} exists already; delete it or choose another data.tokenizer_path.")
    corpora.prepare(cfg.data)
    source = corpora.open_split(cfg.data, cfg.data.train_split)
    key = corpora.text_feature(cfg.data)
    texts = (source[i][key].decode("utf-8", errors="replace") for i in range(len(source)))
    train_sentencepiece(texts, _VOCAB.value or cfg.model.vocab_size, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
