"""llm_70b: a 69B-parameter LLaMA-2-70B-shaped model, for planning a pod (and, on one, training).

    python scripts/plan.py --config configs/llm_70b.py --no_compile --simulate_devices 8
    python scripts/plan.py --config configs/llm_70b.py --no_compile --chip tpu-v5p --chips 1024

80 layers, d_model 8192, 64 query / 8 key-value heads, SwiGLU 28672, a
32000-token vocabulary, 4096-token sequences, bf16 compute with fp32 master
weights and AdamW moments, full remat, FSDP over every device. The textbook
figures the planner reproduces: bf16 weights 2 bytes x 69B = 138 GB, fp32 Adam
moments 8 bytes x 69B = 552 GB, both divided by the FSDP degree. Compiling a
step this size on a CPU host is impractical; use --no_compile here.
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(
        vocab_size=32000,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        max_seq_len=4096,
        remat="full",
        attention="auto",  # splash on a TPU, cuDNN on a GPU, the xla reference on a CPU
    )
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.update(seq_len=4096, tokenizer="sentencepiece", tokenizer_path="tokenizers/llama_32k.model")
    c.precision.compute_dtype = "bfloat16"
    c.optim.update(lr=1.5e-4, warmup_steps=2000, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1)
    c.train.update(steps=350_000, global_batch_size=1024, grad_accum_steps=8, eval_every=1000, eval_batches=8)
    c.checkpoint.update({"every_steps": 500, "keep": 3})
    return c
