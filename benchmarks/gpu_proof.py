"""The proof on one GPU (issue 67), prepared on a CPU to run once: the GPU-only code paths, llm_1b's
tokens/s and MFU in a few configurations, PyTorch beside it, and memory three ways.

    python benchmarks/gpu_proof.py --out DIR [--small]

Each part runs in a process of its own, with a time limit: XLA's flags are fixed per process, and JAX and
PyTorch then hold the card one at a time (but in vs_pytorch.py, which alternates them in one process). A
part that fails is written down with its last words and the rest go on. Rows go to DIR/gpu_proof.jsonl,
each part's output to DIR/<part>.log, and the table is printed last. `--small` shrinks every shape so the
whole script runs on a CPU in minutes (the cuDNN part then compares xla with jax.nn's own XLA kernel):
what is checked here before a GPU's minutes are spent on it.

The parts:
- env: the card and the versions in use.
- matmul: a bf16 matrix product's TFLOP/s (the card's measured ceiling), and its error against float64.
- cudnn: the loss and gradients of a small model on packed documents (several per row, attention kept
  inside each) through cuDNN's fused kernel, against the xla kernel at the same bf16 compute, both against
  the xla kernel in float32: cuDNN's error must be of bf16's size.
- llm_<name>: llm_1b (seq 2048, bf16 compute, fp32 AdamW) on the one card: compile time, step time,
  tokens/s, MFU (model FLOPs per token, trainer/model/flops.py, over 989 TFLOP/s dense bf16), and memory: the
  planner's arithmetic (trainer/planning/memory.py), XLA:GPU's compiled peak, and the card's own peak
  (`device.memory_stats()`).
- torch: benchmarks/vs_pytorch.py on the fastest llm_ configuration, at a batch both sides hold at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_BF16_DENSE = 989e12  # the datasheet's dense bf16 peak (SXM), the MFU denominator the issue names
# llm_1b on one card: configurations picked on the CPU (remat policy, microbatch, XLA's flags); the
# attention kernel is cuDNN's throughout (model.attention=auto on a GPU), checked by the cudnn part.
TUNED_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false"
VARIANTS = {
    "full_b8": ({"model.remat": "full", "train.global_batch_size": 8}, ""),
    "dots_b8": ({"model.remat": "save_dots", "train.global_batch_size": 8}, ""),
    "dots_b8_flags": ({"model.remat": "save_dots", "train.global_batch_size": 8}, TUNED_FLAGS),
    # A second round, after the first showed save_dots ahead: more tokens a step, and no remat at all.
    "dots_b16": ({"model.remat": "save_dots", "train.global_batch_size": 16}, ""),
    "none_b8": ({"model.remat": "none", "train.global_batch_size": 8}, ""),
    "dots_nb_b16": ({"model.remat": "save_dots_no_batch", "train.global_batch_size": 16}, ""),
}
FIRST_ROUND = ("full_b8", "dots_b8", "dots_b8_flags")
TORCH_BATCH = 4  # both frameworks' states and activations on the card at once
LIMITS = {"env": 45, "matmul": 45, "cudnn": 100, "llm": 130, "torch": 170}


def llm_config(overrides: dict, small: bool):
    from trainer.config.forms import from_file, with_changes

    cfg = from_file(os.path.join(REPO, "configs", "llm_1b.py"))
    # Every device the process has: the card alone on the GPU host, the simulated ones of a test's CPU.
    changes = {"data.source": "synthetic", "mesh.fsdp": -1, "train.grad_accum_steps": 1, **overrides}
    if small:
        changes.update({"model.n_layers": 2, "model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 2,
                        "model.d_ff": 512, "model.vocab_size": 1024, "model.max_seq_len": 256,
                        "data.seq_len": 256})  # fmt: skip
    return with_changes(cfg, changes)


def part_env(small: bool) -> dict:
    import jax

    out = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "jax": jax.__version__}
    for name in ("flax", "optax", "orbax.checkpoint", "torch", "transformers"):
        try:
            module = __import__(name, fromlist=["_"])
            out[name] = getattr(module, "__version__", "?")
        except ImportError as e:
            out[name] = f"missing ({e})"
    return out


def part_matmul(small: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = 1024 if small else 8192
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
    product = jax.jit(lambda x, y: x @ y)
    product(a, b).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    m = 512  # against float64 on the same bf16 inputs: bf16 output rounding alone is ~4e-3
    x, y = (np.asarray(v[:m, :m].astype(jnp.float32), np.float64) for v in (a, b))
    got = np.asarray(product(a[:m, :m], b[:m, :m]).astype(jnp.float32), np.float64)
    error = np.linalg.norm(got - x @ y) / np.linalg.norm(x @ y)
    return {"matmul_tflops": 2 * n**3 / statistics.median(times) / 1e12, "matmul_rel_err": float(error)}


def packed_batch(cfg, setup, rng):
    """A synthetic batch whose rows each hold documents of random lengths (segment ids 1, 2, ..., positions
    restarting), so that attention must stay inside each document."""
    import numpy as np
    from timing import synthetic_batch

    from trainer.data.streams import to_global

    local, _ = synthetic_batch(cfg, setup)
    rows, length = local["tokens"].shape
    segments, positions = np.zeros((rows, length), np.int32), np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, length), 3, replace=False))
        for i, (start, end) in enumerate(zip([0, *cuts], [*cuts, length], strict=True)):
            segments[r, start:end], positions[r, start:end] = i + 1, np.arange(end - start)
    local.update(segment_ids=segments, positions=positions)
    return to_global(local, setup.batch_sharding, cfg.train.global_batch_size)


def part_cudnn(small: bool) -> dict:
    import jax
    import numpy as np

    from trainer.training.setup import build
    from trainer.training.step import make_eval_step

    fused = "dot_product" if small else "cudnn"  # on a CPU, jax.nn's XLA kernel stands in for cuDNN's
    base = {"model.n_layers": 2, "model.d_model": 512, "model.n_heads": 8, "model.n_kv_heads": 4,
            "model.d_ff": 1024, "model.vocab_size": 4096, "model.max_seq_len": 512, "data.seq_len": 512,
            "train.global_batch_size": 8}  # fmt: skip
    results = {}
    for name, impl, dtype in (("fp32", "xla", "float32"), ("xla", "xla", "bfloat16"), ("fused", fused, "bfloat16")):
        cfg = llm_config({**base, "model.attention": impl, "precision.compute_dtype": dtype}, small=False)
        setup = build(cfg)
        params = setup.new_state().params
        batch = packed_batch(cfg, setup, np.random.default_rng(0))
        scored = make_eval_step(setup.model, setup.shard, 1)
        loss = jax.jit(jax.value_and_grad(lambda p, b, f=scored: (lambda s, n: s / n)(*f(p, b))))
        value, grads = loss(params, batch)
        results[name] = (float(value), np.concatenate([np.ravel(np.asarray(g, np.float64))
                                                       for g in jax.tree.leaves(grads)]))  # fmt: skip
    reference, grads = results["fp32"]

    def error(name):
        value, g = results[name]
        return abs(value - reference) / abs(reference), float(np.linalg.norm(g - grads) / np.linalg.norm(grads))

    (xla_loss, xla_grad), (fused_loss, fused_grad) = error("xla"), error("fused")
    return {
        "kernel": fused,
        "loss_fp32": reference,
        "loss_rel_err_xla_bf16": xla_loss,
        "loss_rel_err_fused_bf16": fused_loss,
        "grad_rel_err_xla_bf16": xla_grad,
        "grad_rel_err_fused_bf16": fused_grad,
        "fused_within_bf16": fused_loss <= max(3 * xla_loss, 1e-3) and fused_grad <= max(3 * xla_grad, 1e-2),
    }


def part_llm(small: bool, overrides: dict) -> dict:
    import jax
    from timing import synthetic_batch

    from trainer.model.flops import flops_per_token
    from trainer.planning.memory import bytes_per_device
    from trainer.training.setup import build
    from trainer.training.step import abstract_batch, memory_per_device

    cfg = llm_config(overrides, small)
    setup = build(cfg)
    B, T = cfg.train.global_batch_size, cfg.data.seq_len
    start = time.perf_counter()
    compiled = setup.train_step().lower(setup.abstract_state(), abstract_batch(B, T, setup.batch_sharding)).compile()
    compile_s = time.perf_counter() - start
    _, batch = synthetic_batch(cfg, setup)
    state = setup.new_state()
    for _ in range(2):  # the first runs allocate and autotune
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    steps, times = 3 if small else 10, []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    per_token = flops_per_token(setup.spec.arch, setup.model.abstract_params, T)
    device = jax.devices()[0]
    platform = device.platform
    xla = memory_per_device(compiled, platform)
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    gib = 2**30
    return {"step_s": step_s, "tokens_per_s": B * T / step_s, "mfu": per_token * B * T / step_s / H100_BF16_DENSE,
            "compile_s": compile_s, "loss": float(metrics["loss"]),
            "planner_gib": bytes_per_device(cfg, setup)["total"] / gib,
            "xla_gib": xla["total"] / gib, "device_peak_gib": None if peak is None else peak / gib,
            "flops_per_token": per_token}  # fmt: skip


def part_torch(small: bool, overrides: dict) -> dict:
    """vs_pytorch.py's JSON line, on the given llm_ configuration at TORCH_BATCH sequences."""
    config = {**overrides, "train.global_batch_size": TORCH_BATCH}
    args = [f"--config.{k}={v}" for k, v in {"data.source": "synthetic", "mesh.fsdp": 1,
                                              "train.grad_accum_steps": 1, **config}.items()]  # fmt: skip
    if small:
        args += ["--config.model.n_layers=2", "--config.model.d_model=256", "--config.model.n_heads=4",
                 "--config.model.n_kv_heads=2", "--config.model.d_ff=512", "--config.model.vocab_size=1024",
                 "--config.model.max_seq_len=256", "--config.data.seq_len=256"]  # fmt: skip
    command = [sys.executable, os.path.join(REPO, "benchmarks", "vs_pytorch.py"), "--config",
               os.path.join(REPO, "configs", "llm_1b.py"), *args, "--steps", "5", "--rounds", "2",
               "--torch_device", "cpu" if small else "cuda"]  # fmt: skip
    # JAX takes what it needs as it goes, not three quarters of the card up front: PyTorch shares it.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=LIMITS["torch"] - 10)
    print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"benchmark": "vs_pytorch"')]
    if done.returncode or not lines:
        raise RuntimeError(f"vs_pytorch.py ended with {done.returncode}: {done.stderr.strip()[-300:]}")
    return json.loads(lines[-1])


def run_part(name: str, args: dict, out: str, small: bool, flags: str = "", deadline: float = float("inf")) -> dict:
    """One part in a process of its own, with its limit; its row (or its failure) returned and written. A part
    whose limit would pass the deadline is skipped, so the parts before it come back whole."""
    kind = name.split("_")[0]
    if time.monotonic() + LIMITS[kind] > deadline:
        row = {"part": name, "seconds": 0, "skipped": "no time left in --budget_s"}
        print(json.dumps(row), flush=True)
        return row
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    command = [sys.executable, __file__, "--part", name, "--args", json.dumps(args), "--out", out]
    start = time.perf_counter()
    try:
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            done = subprocess.run(command + ["--small"] * small, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=LIMITS[kind] * (3 if small else 1))  # fmt: skip
        row_file = os.path.join(out, f"{name}.json")
        row = json.load(open(row_file)) if done.returncode == 0 and os.path.exists(row_file) else None
        if row is None:
            tail = open(os.path.join(out, f"{name}.log")).read().strip().splitlines()[-3:]
            row = {"failed": f"exit {done.returncode}: {' | '.join(tail)[-400:]}"}
    except subprocess.TimeoutExpired:
        row = {"failed": f"over its {LIMITS[kind]} s"}
    row = {"part": name, "seconds": round(time.perf_counter() - start, 1), **({"xla_flags": flags} if flags else {}),
           **row}  # fmt: skip
    with open(os.path.join(out, "gpu_proof.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder for the rows and each part's log.")
    parser.add_argument("--small", action="store_true", help="Every shape shrunk: the script checked on a CPU.")
    parser.add_argument("--budget_s", type=float, default=560, help="Parts that would end past it are skipped.")
    parser.add_argument("--variants", default="", help=f"llm_1b configurations, of {', '.join(VARIANTS)}.")
    parser.add_argument("--checks", type=int, default=3, help="How many of env, matmul, cudnn to run first.")
    parser.add_argument("--torch", type=int, default=1, help="0: no PyTorch part.")
    parser.add_argument("--part", default="", help="(internal) run one part in this process.")
    parser.add_argument("--args", default="{}", help="(internal) the part's arguments, as JSON.")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, REPO)
    if a.part:
        kind, args = a.part.split("_")[0], json.loads(a.args)
        parts = {"env": part_env, "matmul": part_matmul, "cudnn": part_cudnn}
        row = parts[kind](a.small) if kind in parts else globals()[f"part_{kind}"](a.small, args)
        with open(os.path.join(a.out, f"{a.part}.json"), "w") as f:
            json.dump(row, f)
        return
    deadline = time.monotonic() + a.budget_s
    checks = ("env", "matmul", "cudnn")[: a.checks]
    rows = [run_part(name, {}, a.out, a.small, deadline=deadline) for name in checks]
    chosen = a.variants.split(",") if a.variants else list(FIRST_ROUND)
    timed, (last, *first) = [], chosen[::-1]  # PyTorch before the last variant, if time runs short
    for name in first[::-1]:
        timed.append((run_part(f"llm_{name}", VARIANTS[name][0], a.out, a.small, VARIANTS[name][1], deadline),
                      VARIANTS[name][0]))  # fmt: skip
    fastest = max((t for t in timed if "tokens_per_s" in t[0]), key=lambda t: t[0]["tokens_per_s"], default=None)
    flags = fastest[0].get("xla_flags", "") if fastest else ""
    torch = [run_part("torch", fastest[1], a.out, a.small, flags, deadline)] if fastest and a.torch else []
    timed.append((run_part(f"llm_{last}", VARIANTS[last][0], a.out, a.small, VARIANTS[last][1], deadline),
                  VARIANTS[last][0]))  # fmt: skip
    rows += [row for row, _ in timed] + torch
    print("\npart | seconds | figures")
    for row in rows:
        figures = {
            k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k not in ("part", "seconds")
        }
        print(f"{row['part']} | {row['seconds']} | {json.dumps(figures)}")


if __name__ == "__main__":
    main()
