"""Our train step and MaxText's, compiled for the same model, batch, mesh and remat on TPU targets, side by side.

    python benchmarks/vs_maxtext.py --maxtext ~/maxtext --python ~/maxtext-venv/bin/python
        [--shapes llm_1b,8b] [--trainers ours,maxtext] [--out benchmarks/report/vs_maxtext.jsonl]
        [--maxtext_commit SHA] [--table]

MaxText runs from its source checkout (`--maxtext`, its `src/` on PYTHONPATH) in
its own Python (`--python`: 3.12, its pinned requirements and jax[tpu] of our
version; RESULTS.md says how it was installed) through its ahead-of-time entry
point, `maxtext.trainers.pre_train.train_compile`, offline (DECOUPLE_GCLOUD=TRUE),
dumping its HLO. Ours is compiled in this process for the same slice, dumping
the same way. No TPU is needed: both compile through libtpu. Each dump is then
read by the same code (`read_dump`):

- heap: XLA:TPU's HBM heap from the buffer-assignment report it dumps;
- FLOPs and HBM bytes: the HLO with loops counted by their trips, and each
  splash-attention call by the kernel's schedule (trainer/planning/plan.py
  `hlo_cost`, trainer/model/splash.py), whichever form (our multi-query calls
  with the fused backward, MaxText's multi-head calls with separate dq and dkv);
- the roofline on the target's chip, and GiB sent per device per step by each
  kind of collective (parallelism/collectives.py).

Both train the same decoder: fsdp over every chip, full remat, splash attention,
bf16 compute with fp32 weights and AdamW moments, no gradient accumulation,
untied embeddings. Each (shape, target, trainer) is one JSON line in --out; lines
already there are not compiled again. The table is printed at the end.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.run import cli  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_MAXTEXT = flags.DEFINE_string("maxtext", None, "A MaxText source checkout (its src/ holds the maxtext package).")
_PYTHON = flags.DEFINE_string("python", None, "The Python of a venv with MaxText's requirements.")
_SHAPES = flags.DEFINE_list("shapes", ["llm_1b", "8b"], "Shapes of SHAPES to compile.")
_TRAINERS = flags.DEFINE_list("trainers", ["ours", "maxtext"], "Whose steps to compile.")
_OUT = flags.DEFINE_string("out", os.path.join(HERE, "report", "vs_maxtext.jsonl"), "JSON lines file.")
_COMMIT = flags.DEFINE_string("maxtext_commit", "", "MaxText's commit, where --maxtext is not a git checkout.")
_TABLE = flags.DEFINE_bool("table", False, "Print the table from --out and compile nothing.")

# Llama-like decoders, each on the targets where its state and a few sequences per chip fit in HBM.
SHAPES = {
    "llm_1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 5632, "vocab_size": 32000,
               "seq_len": 2048, "batch_per_chip": 4, "targets": ["v5e-4", "v5p-8", "v6e-4"]},
    "8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_ff": 14336, "vocab_size": 128256,
           "seq_len": 2048, "batch_per_chip": 2, "targets": ["v5e-16", "v5p-8", "v6e-8"]},
}  # fmt: skip


def read_dump(folder: str, chip) -> dict:
    """What one compiled train step costs per device, from the folder XLA dumped it into: the largest
    module (the step; the rest are small helpers such as the RNG's)."""
    from parallelism import collectives, hlo
    from trainer.planning.plan import hlo_cost
    from trainer.training.step import dumped_spaces

    path = max(glob.glob(os.path.join(folder, "*after_optimizations.txt")), key=os.path.getsize)
    with open(path) as f:
        text = f.read()
    spaces = dumped_spaces(path.removesuffix(".txt") + "-memory-usage-report.txt")
    cost = hlo_cost(hlo.read(text), chip)
    sent = {kind: v["sent"] for kind, v in collectives.parse(text).items()}
    return {"heap": spaces["default"], "module": os.path.basename(path), **cost, "collectives_sent": sent}


def ours(shape: dict, target: str, folder: str) -> None:
    """Compile our step for `shape` on `target`, dumping into `folder`."""
    from trainer.config.forms import from_file, with_changes
    from trainer.planning.targets import parse_target, target_devices
    from trainer.training.setup import build
    from trainer.training.step import abstract_batch

    hardware = parse_target(target)
    model = {k: shape[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")}
    changes = {**{f"model.{k}": v for k, v in model.items()}, "model.max_seq_len": shape["seq_len"],
               "data.seq_len": shape["seq_len"], "model.remat": "full", "model.attention": "splash",
               "train.global_batch_size": shape["batch_per_chip"] * hardware.chips, "train.grad_accum_steps": 1,
               "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1}  # fmt: skip
    cfg = with_changes(from_file(os.path.join(os.path.dirname(HERE), "configs", "llm_1b.py")), changes)
    setup = build(cfg, target_devices(hardware))
    batch = abstract_batch(cfg.train.global_batch_size, shape["seq_len"], setup.batch_sharding)
    setup.train_step().lower(setup.abstract_state(), batch).compile(compiler_options={"xla_dump_to": folder})


def maxtext(shape: dict, target: str, folder: str) -> None:
    """Compile MaxText's step for `shape` on `target` in its own Python, dumping into `folder`."""
    args = [f"compile_topology={target}", "compile_topology_num_slices=1",
            f"base_emb_dim={shape['d_model']}", f"base_num_query_heads={shape['n_heads']}",
            f"base_num_kv_heads={shape['n_kv_heads']}", f"head_dim={shape['d_model'] // shape['n_heads']}",
            f"base_mlp_dim={shape['d_ff']}", f"base_num_decoder_layers={shape['n_layers']}",
            f"vocab_size={shape['vocab_size']}", f"max_target_length={shape['seq_len']}",
            f"per_device_batch_size={shape['batch_per_chip']}", "remat_policy=full", "attention=flash",
            "dataset_type=synthetic", "enable_checkpointing=false", "dump_hlo=true", f"dump_hlo_local_dir={folder}",
            "run_name=vs_maxtext", f"base_output_directory={folder}/out"]  # fmt: skip
    env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "PYTHONPATH": os.path.join(_MAXTEXT.value, "src")}
    done = subprocess.run([_PYTHON.value, "-m", "maxtext.trainers.pre_train.train_compile",
                           "src/maxtext/configs/base.yml", *args], cwd=_MAXTEXT.value, env=env, capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"MaxText's compile failed: {done.stderr[-2000:]}")


def versions() -> dict:
    import jax
    import libtpu

    head = subprocess.run(["git", "-C", _MAXTEXT.value, "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = head.stdout.strip() if head.returncode == 0 else _COMMIT.value or "unknown"
    return {"jax": jax.__version__, "libtpu": libtpu.__version__, "maxtext": commit}


def run() -> None:
    from trainer.planning.targets import parse_target

    done = set()
    if os.path.exists(_OUT.value):
        with open(_OUT.value) as f:
            done = {(r["shape"], r["target"], r["trainer"]) for r in map(json.loads, f)}
    for name in _SHAPES.value:
        for target in SHAPES[name]["targets"]:
            for trainer, compile_step in (("ours", ours), ("maxtext", maxtext)):
                if (name, target, trainer) in done or trainer not in _TRAINERS.value:
                    continue
                row = {"shape": name, "target": target, "trainer": trainer, **versions()}
                start = time.perf_counter()
                with tempfile.TemporaryDirectory() as folder:
                    try:
                        compile_step(SHAPES[name], target, folder)
                        row.update(read_dump(folder, parse_target(target).chip))
                    except Exception as e:  # recorded, and the grid goes on: the table says which and why
                        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[-400:]}"
                row["seconds"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
                with open(_OUT.value, "a") as f:
                    f.write(json.dumps(row) + "\n")


def table(path: str) -> str:
    """Markdown: per shape and target, each trainer's heap, FLOPs, HBM bytes, roofline and collectives."""
    with open(path) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: (list(SHAPES).index(r["shape"]),
                      SHAPES[r["shape"]]["targets"].index(r["target"]), r["trainer"] != "ours"))  # fmt: skip
    gib = 2**30
    kinds = ["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"]
    head = ["shape", "target", "trainer", "heap GiB", "FLOPs", "splash FLOPs", "HBM GB", "splash HBM GB",
            "roofline s", *(f"{k} GiB" for k in kinds)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 3 + " ---: |" * (len(head) - 3)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['target']} | {r['trainer']} | failed: {r['error'][:100]} |")
            continue
        k = r["kernels"]
        cells = [r["shape"], r["target"], r["trainer"], f"{r['heap'] / gib:.2f}", f"{r['flops']:.3g}",
                 f"{k['flops']:.3g}", f"{r['bytes_accessed'] / 1e9:.0f}", f"{k['bytes'] / 1e9:.0f}",
                 f"{r['roofline_seconds']:.3f} ({r['bound']})",
                 *(f"{r['collectives_sent'].get(kind, 0) / gib:.2f}" for kind in kinds)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    if not _TABLE.value:
        if not (_MAXTEXT.value and _PYTHON.value):
            raise cli.ConfigError("--maxtext (a MaxText checkout) and --python (its venv's Python) are needed to "
                                  "compile; --table prints what --out holds.")  # fmt: skip
        run()
    print(table(_OUT.value))


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
