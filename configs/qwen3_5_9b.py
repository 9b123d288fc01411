"""qwen3_5_9b: the Qwen3.5-9B shape (text; transformers' Qwen3_5TextConfig defaults, which it calls the 9B
style), for fine-tuning an imported checkpoint or planning one.

    python scripts/convert_hf.py import --config configs/qwen3_5_9b.py --hf <Qwen3.5-9B> --workdir runs/qwen3_5_9b
    python scripts/plan.py --config configs/qwen3_5_9b.py --target v5e-8   # the TPU compiler on a slice (tpu extra)
    python scripts/train.py --config configs/qwen3_5_9b.py --workdir runs/qwen3_5_9b

32 layers of width 4096, in eight units of three Gated DeltaNet layers (16 key heads of 128 serving 32 value
heads of 128, a convolution of 4) and one gated full-attention layer (16 query heads of 256 on 4 key/value
heads, a quarter of each head rotated, query/key norms); SwiGLU 12288 wide; a 248,320-token vocabulary,
untied. The import reads the Hub's Qwen3_5ForConditionalGeneration by its text model and says which keys
differ if the checkpoint is another size. bf16 compute, full rematerialisation, FSDP over every device,
bf16 Adam moments; the loss's logits 1024 positions at a time. Point data.tokenizer_path at the checkpoint's
tokenizer.json and data.paths at a corpus; for adapters add --config.model.lora.rank=16 and
--config.checkpoint.init_from=runs/qwen3_5_9b (they reach the full-attention layers' q, k, v, o, every MLP,
and the Gated DeltaNet layers' qkv, z and out: in_proj_qkv, in_proj_z and out_proj, as PEFT names them).
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(vocab_size=248_320, d_model=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
                   d_ff=12_288, max_seq_len=32_768, rope_theta=10_000.0, norm_eps=1e-6, qk_norm=True,
                   attention_gate=True, centred_norms=True, rope_fraction=0.25,
                   layer_types=("linear_attention",) * 3 + ("full_attention",),
                   remat="full", loss_chunk=1024, attention="auto")  # fmt: skip
    c.model.layer_types = c.model.layer_types * 8
    c.model.linear.update(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.update(seq_len=4096, tokenizer="hf", tokenizer_path="tokenizers/qwen3_5/tokenizer.json")
    c.precision.update(compute_dtype="bfloat16", moments_dtype="bfloat16")
    c.optim.update(lr=1e-5, warmup_steps=100, schedule="cosine", weight_decay=0.1)
    c.train.update(steps=2000, global_batch_size=32, log_every=10, eval_every=200, eval_batches=8)
    c.checkpoint.update({"every_steps": 200, "keep": 3})
    return c
