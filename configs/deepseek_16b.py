"""deepseek_16b: a DeepSeek-V3-style mixture with latent attention and multi-token prediction, sized for a
TPU slice (DeepSeek-V2-Lite's shape under V3's router).

    python scripts/plan.py --config configs/deepseek_16b.py --target v5p-32   # XLA:TPU for 16 chips (tpu extra)
    python scripts/train.py --config configs/deepseek_16b.py

27 layers of width 2048: the first dense (SwiGLU 10944), the other 26 with 64 experts of width 1408, 6 per
token under the sigmoid router (loss-free balancing, weights times 1.0), beside 2 shared experts; latent
attention with 16 heads, keys and values from a 512-wide latent (queries projected directly), each head's
query and key 128 wide plus a 64-wide RoPE part, values 128 wide; a 102,400-token vocabulary, untied; one
multi-token prediction module at weight 0.3. 4096-token sequences, bf16 compute, full rematerialisation,
the experts over 8 devices (mesh.expert), everything else FSDP. A decode caches 576 numbers a token and
layer (the latent and the RoPE key part), where 16 heads of keys and values would take 6,144.
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(vocab_size=102_400, d_model=2048, n_layers=27, n_heads=16, n_kv_heads=16, d_ff=10_944,
                   max_seq_len=4096, rope_theta=10_000.0, norm_eps=1e-6, remat="full", attention="auto",
                   loss_chunk=1024)  # fmt: skip
    c.model.mla.update(kv_rank=512, q_rank=0, nope_dim=128, rope_dim=64, v_dim=128)
    c.model.moe.update(num_experts=64, experts_per_token=6, shared_experts=2, d_ff=1408, dense_layers=1,
                       router="sigmoid", routed_scale=1.0, router_bias=0.001, aux_loss=0.0001, impl="capacity",
                       capacity_factor=1.25)  # fmt: skip
    c.model.mtp.update(depth=1, weight=0.3)
    c.mesh.update(expert=8, fsdp=-1)
    c.data.update(seq_len=4096, tokenizer="hf", tokenizer_path="tokenizers/deepseek/tokenizer.json")
    c.precision.compute_dtype = "bfloat16"
    c.optim.update(lr=4.2e-4, warmup_steps=2000, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1,
                   weight_decay=0.1)  # fmt: skip
    c.train.update(steps=50_000, global_batch_size=256, grad_accum_steps=8, log_every=10, eval_every=1000,
                   eval_batches=8)  # fmt: skip
    c.checkpoint.update({"every_steps": 1000, "keep": 3})
    return c
