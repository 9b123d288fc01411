"""A checkpoint's next-token log-probabilities for a text, to check against another implementation:

    python scripts/score.py --config configs/tiny.py --workdir runs/tiny --text "def main():" [--top 5]
        [--step N] [--logits_out logits.npy]

Prints one JSON line: {"step", "tokens" (the begin-of-document id, then the text's), "logprobs" (position i's
log-probability of token i + 1), "sum", "top" (each position's --top most likely next ids and their
log-probabilities)}; --logits_out writes the whole float32 logits (positions x vocabulary) as a .npy file.
transformers' on the export (scripts/convert_hf.py export): log_softmax of
AutoModelForCausalLM.from_pretrained(DIR)(torch.tensor([tokens])).logits, position for position.
"""

import json

import numpy as np
from absl import flags

from trainer.evaluation.logprobs import score_text
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
_TEXT = flags.DEFINE_string("text", "", "The text to score.")
_TOP = flags.DEFINE_integer("top", 5, "The most likely next tokens to list at each position.")
_LOGITS_OUT = flags.DEFINE_string("logits_out", "", "A .npy file to write the whole logits to.")


def main():
    scored = score_text(_CONFIG.value, _WORKDIR.value or cli.default_workdir(), _STEP.value, _TEXT.value, _TOP.value)
    if _LOGITS_OUT.value:
        np.save(_LOGITS_OUT.value, scored["logits"])
    print(json.dumps({k: v for k, v in scored.items() if k != "logits"}))


if __name__ == "__main__":
    cli.run(main)
