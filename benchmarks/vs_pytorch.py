"""Our training throughput against PyTorch's on the same model, batch and optimiser, in one run.

    python benchmarks/vs_pytorch.py --config configs/tiny.py [--steps 10] [--rounds 3] [--append]
    python benchmarks/vs_pytorch.py --config configs/llm_1b.py --torch_device cuda --torch_compile   # on a GPU

PyTorch's side is Hugging Face's `LlamaForCausalLM` built from our model's
shapes (trainer/interop/huggingface.py writes the same config for export), trained with
`torch.optim.AdamW` and global-norm clipping, with SDPA attention; on a GPU,
`--torch_compile` wraps it in `torch.compile` and runs bf16 autocast when our
config computes in bf16. Ours is `Setup.train_step()` on this host's devices.
Both take the same batch of tokens; they are timed alternately, `--steps`
steps per turn. `speedup` is our tokens per second over PyTorch's.
Needs the `hf` extra (torch, transformers).
"""

import os
import statistics
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import seconds_per_step, synthetic_batch  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timed turn.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating turns of ours and PyTorch's.")
_DEVICE = flags.DEFINE_string("torch_device", "cpu", "Where PyTorch runs: cpu or cuda.")
_COMPILE = flags.DEFINE_bool("torch_compile", False, "Wrap PyTorch's model in torch.compile.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def torch_trainer(cfg, spec, tokens_np):
    """A closure running one PyTorch train step on the fixed batch, and the device sync to time it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.interop.huggingface import hf_config

    device = torch.device(_DEVICE.value)
    config = LlamaConfig(**hf_config(spec.arch, cfg.model.max_seq_len))
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2),
                            eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)  # fmt: skip
    forward = torch.compile(model) if _COMPILE.value else model
    tokens = torch.as_tensor(tokens_np, dtype=torch.long, device=device)
    autocast = cfg.precision.compute_dtype == "bfloat16" and device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, sync


def main():
    import numpy as np

    from trainer.training.setup import build

    cfg = _CONFIG.value
    setup = build(cfg)
    local, _ = synthetic_batch(cfg, setup)
    # One document per row, so both sides see the same causal attention over the whole sequence.
    local["segment_ids"] = np.ones_like(local["tokens"])
    local["positions"] = np.broadcast_to(np.arange(local["tokens"].shape[1]), local["tokens"].shape).copy()
    from trainer.data.streams import to_global

    batch = to_global(local, setup.batch_sharding, cfg.train.global_batch_size)
    state, ours = setup.new_state(), setup.train_step()
    torch_step, torch_sync = torch_trainer(cfg, setup.spec, local["tokens"])

    def ours_step(state):
        return ours(state, batch)[0]

    def time_torch():
        start = time.perf_counter()
        for _ in range(_STEPS.value):
            torch_step()
        torch_sync()
        return (time.perf_counter() - start) / _STEPS.value

    state, _ = seconds_per_step(ours_step, state, _STEPS.value)  # compile and warm up both
    time_torch()
    ours_s, torch_s = [], []
    for _ in range(_ROUNDS.value):
        state, t = seconds_per_step(ours_step, state, _STEPS.value)
        ours_s.append(t)
        torch_s.append(time_torch())
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    ours_tps, torch_tps = tokens / statistics.median(ours_s), tokens / statistics.median(torch_s)
    report(
        "vs_pytorch",
        {
            "config": os.path.basename(cli.config_path()),
            "speedup": ours_tps / torch_tps,
            "ours_tokens_per_s": ours_tps,
            "torch_tokens_per_s": torch_tps,
            "torch": f"{_DEVICE.value}{', compiled' if _COMPILE.value else ''}",
        },
        append=_APPEND.value,
    )


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
