"""small: a ~126M-parameter LLaMA-style model (GPT-2-small class).

    python scripts/train_tokenizer.py --config configs/small.py   # once: a 32k SentencePiece model
    python scripts/train.py --config configs/small.py

12 layers, d_model 768, 12 query / 4 key-value heads, SwiGLU 2048, 32768-token
SentencePiece vocabulary, 1024-token sequences, bf16 compute, FSDP over all
devices. On one accelerator (or a TPU v4-8) expect a few hundred thousand
tokens/s; on a laptop CPU it runs but slowly (use tiny there). Point
--config.data.paths at your own corpus for a real run.
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, max_seq_len=1024)
    c.data.update(seq_len=1024, tokenizer="sentencepiece", tokenizer_path="tokenizers/python_stdlib_32k.model")
    c.optim.update(lr=6e-4, warmup_steps=500, schedule="cosine", min_lr_ratio=0.1)
    c.train.update(steps=10_000, global_batch_size=64, log_every=20, eval_every=500, eval_batches=8)
    c.checkpoint.update({"every_steps": 1000, "keep": 3})
    return c
