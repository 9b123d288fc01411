"""Latent attention's decode cache against grouped-query attention's at the same width: bytes a token and
layer, the whole cache, and seconds a decoded token.

    python benchmarks/latent_cache.py --config configs/deepseek_16b.py [--prompt 2048] [--new 32] [--append]

The config's attention as it is (latent: its kv_rank-wide latent and rope_dim-wide shared key part are what
a decode caches) against the same width and heads under GQA with `--kv_heads` key/value heads of
d_model / n_heads (dense, no experts, so that attention is what differs). Each is built at `--layers`
layers and the config's width with random weights, and `trainer/model/sampling.py`'s generate (one
prefill of `--prompt` tokens, then `--new` tokens one at a time, one jitted call) is timed after a
first call that compiles: seconds a new token, the prefill included in neither. Cache bytes come from the
arrays `empty_cache` makes.
"""

import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_PROMPT = flags.DEFINE_integer("prompt", 2048, "Prompt tokens (prefilled).")
_NEW = flags.DEFINE_integer("new", 32, "Tokens decoded one at a time.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Layers of each model built.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 4, "GQA's key/value heads.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main():
    import jax
    import numpy as np

    from parallelism import accelerators

    accelerators.start()  # this machine's backends, without the others' noise

    from trainer.config.forms import with_changes
    from trainer.model.sampling import empty_cache, make_generate
    from trainer.training.setup import build

    base = _CONFIG.value
    length = _PROMPT.value + _NEW.value
    common = {"model.n_layers": _LAYERS.value, "model.moe.num_experts": 0, "model.mtp.depth": 0,
              "model.max_seq_len": max(base.model.max_seq_len, length), "data.seq_len": 128,
              "data.source": "synthetic", "data.tokenizer": "byte", "model.vocab_size": 4096,
              "precision.compute_dtype": "float32", "mesh.expert": 1, "mesh.fsdp": -1, "model.loss_chunk": 0,
              "train.global_batch_size": jax.device_count(), "train.grad_accum_steps": 1}  # fmt: skip
    gqa = {"model.mla.kv_rank": 0, "model.n_kv_heads": _KV_HEADS.value,
           "model.head_dim": base.model.d_model // base.model.n_heads}  # fmt: skip
    figures = {"config": os.path.basename(cli.config_path()), "prompt": _PROMPT.value, "new": _NEW.value,
               "kv_rank": base.model.mla.kv_rank, "rope_dim": base.model.mla.rope_dim,
               "gqa_kv_heads": _KV_HEADS.value}  # fmt: skip
    prompt = np.random.default_rng(0).integers(3, 4096, (1, _PROMPT.value)).astype(np.int32)
    for name, changes in (("mla", {}), ("gqa", gqa)):
        setup = build(with_changes(base, {**common, **changes}))
        cache = jax.eval_shape(lambda s=setup: empty_cache(s.spec, 1, length, s.shard))
        total = sum(a.size * 2 for a in jax.tree.leaves(cache))  # bytes in bf16
        params = setup.new_state().params
        generate = make_generate(setup.spec, setup.shard, max_new_tokens=_NEW.value)
        short = make_generate(setup.spec, setup.shard, max_new_tokens=1)
        jax.block_until_ready((generate(params, prompt, 0), short(params, prompt, 0)))  # compiled
        start = time.perf_counter()
        jax.block_until_ready(short(params, prompt, 0))
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(generate(params, prompt, 0))
        per_token = (time.perf_counter() - start - prefill) / (_NEW.value - 1)
        figures.update({f"{name}_cache_bytes_per_token_layer": total / length / _LAYERS.value,
                        f"{name}_cache_mib": total / 2**20, f"{name}_s_per_token": per_token})  # fmt: skip
    figures["cache_ratio"] = figures["mla_cache_mib"] / figures["gqa_cache_mib"]
    report("latent_cache", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
