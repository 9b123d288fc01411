"""gemma3_1b: Gemma 3 1B's architecture (text), for continued pretraining of its weights or a model of that
shape from scratch.

    python scripts/convert_hf.py import --config configs/gemma3_1b.py --hf <gemma-3-1b-pt> --workdir runs/gemma3_1b
    python scripts/plan.py --config configs/gemma3_1b.py --target v5e-8   # the TPU compiler on a slice (tpu extra)
    python scripts/train.py --config configs/gemma3_1b.py --workdir runs/gemma3_1b

26 layers of width 1152: five local layers (a sliding window of 512 tokens, RoPE base 10k) then one global
(RoPE base 1M), four times, then two local; 4 query heads of width 256 on one key/value head, query/key
norms, GeGLU 6912 wide, Gemma's norms on each sublayer's output, embeddings scaled by sqrt(1152) and tied
to the head, a 262,144-token vocabulary: 1.0B parameters. Sequences of 8192 tokens: a local layer's
attention costs a sixteenth of a global one's there (docs/model_families.md). bf16 compute, full
rematerialisation, FSDP over every device. Point data.tokenizer_path at the checkpoint's tokenizer.json
(Gemma's own: BOS 2, EOS 1, padding 0) and data.paths at a corpus.
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(
        vocab_size=262_144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        d_ff=6912,
        max_seq_len=32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=True,
        sliding_window=512,
        global_every=6,
        local_rope_theta=10_000.0,
        embed_scale=True,
        post_norms=True,
        mlp_activation="gelu_tanh",
        remat="full",
        loss_chunk=1024,  # a 262k vocabulary's logits 1024 positions at a time: 1 GiB per row in fp32, not 8
        attention="auto",  # splash on a TPU (its local mask skips the blocks outside the window), cuDNN on a GPU
    )
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.update(seq_len=8192, tokenizer="hf", tokenizer_path="tokenizers/gemma3/tokenizer.json")
    c.precision.compute_dtype = "bfloat16"
    # Continued pretraining: a short warmup to a peak well below from-scratch rates, then WSD's long plateau.
    c.optim.update(lr=1e-4, warmup_steps=200, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1, weight_decay=0.1)
    c.train.update(steps=10_000, global_batch_size=64, grad_accum_steps=4, log_every=10, eval_every=500,
                   eval_batches=8)  # fmt: skip
    c.checkpoint.update({"every_steps": 500, "keep": 3})
    return c
