"""distill_tiny: the quick start's student (0.9M parameters) taught by configs/tiny.py's model (3.3M) as it
trains: the teacher in the step, online.

    python scripts/train.py --config configs/tiny.py                # the teacher (runs/tiny), 8-17 minutes
    python scripts/train.py --config configs/distill_tiny.py        # the student: runs/distill_tiny

quickstart's model, data, batch, schedule and 300 steps, its objective 0.5 x the bytes' cross-entropy +
0.5 x the forward KL from the teacher's next-byte distribution (distill.beta=0; temperature 1). Both read the
same byte tokenizer, which a teacher must share. Measured on a two-core VM (2026-11-29, eval.py on the whole
held-out split): 1.5762 and 1.6391 over two seeds against 1.6967 and 1.7527 for the same student trained on
the data alone (0.117 lower on the mean; the teacher's is 1.5487), 0.38 s a step against 0.28, 2m03s in all.
docs/post_training.md has the table, and how to distil an imported Hugging Face model into a smaller one.

From stored logits instead (the teacher run once, ahead, beside the corpus):

    python scripts/teacher_logits.py --config configs/distill_tiny.py --config.distill.mode=offline \
        --config.distill.top_k=32
    python scripts/train.py --config configs/distill_tiny.py --config.distill.mode=offline \
        --config.distill.top_k=32 --workdir runs/distill_tiny_offline

(distill.top_k is set on the command line, not here: an online run reads no stored logits, and a key that
does nothing is warned about.)
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.distill.update(teacher="runs/tiny", alpha=0.5, beta=0.0, divergence_temperature=1.0)
    return c
