"""quickstart: a 0.9M-parameter model that learns Python's look in two minutes on a CPU.

    python scripts/train.py --config configs/quickstart.py

The same recipe as configs/tiny.py, smaller (4 layers of width 128, 128-byte
sequences, 32 a batch) and shorter (300 steps): 0.27-0.33 s a step and 1m50s in
all, compile included, on a two-core VM (README.md says how it was timed). It
prepares the corpus from your Python's standard library (~1 s), evaluates at
steps 150 and 300 (validation loss beside the unigram baseline's)
and prints what the model writes after "def ", "import " and "class ". At the
end it says where the run is and the next commands: train it longer, evaluate
it, sample from it. configs/tiny.py is the next step up (450 steps, 8-17 minutes).
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(vocab_size=384, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=128)
    c.data.update(seq_len=128)
    c.precision.compute_dtype = "float32"
    c.optim.update(lr=4e-3, warmup_steps=30, weight_decay=0.1)
    c.train.update(steps=300, global_batch_size=32, log_every=20, eval_every=150, eval_batches=4,
                   sample_prompts=("def ", "import ", "class "))  # fmt: skip
    c.checkpoint.update({"every_steps": 150, "keep": 2})
    return c
