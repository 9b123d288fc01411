"""Tokens per second and compiled memory of an SFT step, a LoRA and a QLoRA SFT step and a DPO step against a
pretraining step of the same model.

    python benchmarks/post_training.py --config configs/tiny.py [--steps 5] [--rounds 3] [--append]

The three steps (`Setup.train_step()` under data.format text, chat and preference) are timed alternately,
`--steps` steps per turn for `--rounds` rounds, in one process, on the same tokens: each row two documents
(for DPO a prompt with its chosen reply and with its rejected one, the replies the second half of each)
and a loss mask on the replies. SFT's mask changes which targets count, not the work: its step should cost
what pretraining's does. DPO's runs a forward pass of the reference weights beside the policy's forward
and backward (FLOPs per token 8N against 6N) and holds the reference on the devices (one more copy of the
parameters): `dpo_over_pretrain` is its time per step over pretraining's. A DPO pair is two sequences,
so its tokens per second are twice its pairs' tokens per second. LoRA's SFT (`--lora_rank`, on every
projection) trains adapters beside the frozen weights (`lora_over_sft`: its time over full SFT's); QLoRA's
the same adapters beside an nf4 base, dequantised a layer at a time (`qlora_over_lora`); DPO's with the
same adapters holds no second copy of the weights: its reference is the base with the adapters off
(`dpo_lora_gib` against `dpo_gib`); `*_gib`
is XLA's memory for each compiled step on one device (trainer/training/step.py memory_per_device).
"""

import os
import statistics
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import seconds_per_step  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per timed turn.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating turns of the steps.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 16, "The LoRA SFT step's model.lora.rank.")


def batch(cfg) -> dict:
    """Two documents a row, the second half of each marked as trained on."""
    import numpy as np

    b, t = cfg.train.global_batch_size, cfg.data.seq_len
    half, quarter = t // 2, t // 4
    segments = np.repeat(np.array([[1] * half + [2] * (t - half)]), b, axis=0).astype(np.int32)
    positions = np.concatenate([np.arange(half), np.arange(t - half)])
    mask = np.concatenate([np.arange(half) >= quarter, np.arange(t - half) >= quarter]).astype(np.int32)
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(3, cfg.model.vocab_size, (b, t)).astype(np.int32), "segment_ids": segments,
            "positions": np.broadcast_to(positions, (b, t)).astype(np.int32),
            "loss_mask": np.broadcast_to(mask, (b, t)).astype(np.int32)}  # fmt: skip


def main():
    import jax
    import numpy as np

    from trainer.config.forms import with_changes
    from trainer.model.flops import flops_per_token, peak_flops
    from trainer.training.setup import build

    base = _CONFIG.value
    from trainer.training.step import memory_per_device

    formats = {"pretrain": {}, "sft": {"data.format": "chat"},
               "lora": {"data.format": "chat", "model.lora.rank": _LORA_RANK.value, "checkpoint.init_from": "unused"},
               "qlora": {"data.format": "chat", "model.lora.rank": _LORA_RANK.value, "model.lora.base": "nf4",
                         "checkpoint.init_from": "unused"},
               "dpo": {"data.format": "preference", "checkpoint.init_from": "unused"},
               "dpo_lora": {"data.format": "preference", "model.lora.rank": _LORA_RANK.value,
                            "checkpoint.init_from": "unused"}}  # fmt: skip
    data = batch(base)
    steps, carries, setups, memory = {}, {}, {}, {}
    for name, changes in formats.items():
        cfg = with_changes(base, {"data.source": "text_files", **changes} if changes else {})
        setup = setups[name] = build(cfg)
        on_mesh = jax.device_put({k: v for k, v in data.items() if k in setup.abstract_batch()}, setup.batch_sharding)
        state, step = setup.new_state(), setup.train_step()
        inputs = (jax.tree.map(lambda p: p.copy(), state.params),) if setup.preference else ()
        if setup.adapted:  # the frozen base: any weights time the same
            inputs = (jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding),
                                   setup.step_inputs()[0]),)  # fmt: skip
        compiled = step.lower(setup.abstract_state(), setup.abstract_batch(), *setup.step_inputs()).compile()
        memory[name] = memory_per_device(compiled, setup.mesh.devices.flat[0].platform)["total"] / 2**30
        steps[name] = lambda s, step=step, b=on_mesh, extra=inputs: step(s, b, *extra)[0]
        carries[name], _ = seconds_per_step(steps[name], state, 1)  # compiled and warm
    times = {name: [] for name in formats}
    for _ in range(_ROUNDS.value):
        for name in formats:
            carries[name], t = seconds_per_step(steps[name], carries[name], _STEPS.value)
            times[name].append(t)
    tokens = base.train.global_batch_size * base.data.seq_len
    median = {name: statistics.median(t) for name, t in times.items()}
    peak = peak_flops(setups["pretrain"].mesh.devices.flatten().tolist())
    figures = {"config": os.path.basename(cli.config_path()), "devices": jax.device_count(), "tokens_per_step": tokens}
    for name, seconds in median.items():
        s = setups[name]
        fpt = flops_per_token(s.spec.arch, s.model.abstract_params, base.data.seq_len, s.preference)
        figures.update({f"{name}_step_s": seconds, f"{name}_tokens_per_s": tokens / seconds,
                        f"{name}_mfu": fpt * tokens / seconds / peak, f"{name}_gib": memory[name]})  # fmt: skip
    figures["sft_over_pretrain"] = median["sft"] / median["pretrain"]
    figures["dpo_over_pretrain"] = median["dpo"] / median["pretrain"]
    figures["lora_over_sft"] = median["lora"] / median["sft"]
    figures["qlora_over_lora"] = median["qlora"] / median["lora"]
    report("post_training", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
