"""The memory arithmetic against the compilers: per-device totals on TPU slices and simulated CPUs.

    python benchmarks/memory_calibration.py [--configs tiny,small,llm_1b] [--targets v5e-4,v5p-8]
        [--cpu] [--out benchmarks/report/memory_calibration.jsonl]

For each config, remat policy (none, save_dots, full) and mesh of four devices
(fsdp=4, data=2 x fsdp=2, fsdp=2 x tensor=2) the real train step is compiled
for each TPU target (no TPU needed: libtpu, the `tpu` extra) and, with --cpu,
for four simulated CPU devices (fsdp=4 only); each compile appends one JSON line to --out
(XLA's bytes per device and the attention kernel that ran; `total` is XLA:TPU's HBM
heap on a TPU, arguments + temporaries on a CPU: trainer/training/step.py). Lines
already there are not compiled again, so an interrupted grid resumes. The
README's memory table is printed at the end, with the arithmetic of today's
code (trainer/planning/memory.py) beside the recorded compiles; `--table`
prints it without compiling.

Where XLA:TPU refuses a step whose heap exceeds the chip's HBM, the heap it
had assigned is recorded all the same (its report is written before the
refusal; the "HLO temporaries" its message states), flagged `refused`.
"""

import itertools
import json
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer import cli  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_CONFIGS = flags.DEFINE_list("configs", ["tiny", "small", "llm_1b"], "Configs under configs/.")
_TARGETS = flags.DEFINE_list("targets", ["v5e-4", "v5p-8"], "TPU targets of four devices.")
_REMATS = flags.DEFINE_list("remats", ["none", "save_dots", "full"], "Remat policies.")
_CPU = flags.DEFINE_bool("cpu", False, "Also compile for four simulated CPU devices (the fsdp=4 mesh).")
_OUT = flags.DEFINE_string("out", os.path.join(HERE, "report", "memory_calibration.jsonl"), "JSON lines file.")
_TABLE = flags.DEFINE_bool("table", False, "Print the table from --out and compile nothing.")

MESHES = {"fsdp=4": (1, 4, 1), "data=2 x fsdp=2": (2, 2, 1), "fsdp=2 x tensor=2": (1, 2, 2)}


def config_for(name: str, remat: str, mesh: tuple[int, int, int]):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(HERE), "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.model.remat = remat
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
    return cfg


def measure(cfg, devices) -> dict:
    from trainer.planning import memory
    from trainer.training.setup import build
    from trainer.training.step import OutOfHbm, abstract_batch, compile_with_heap

    setup = build(cfg, devices)
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, setup.batch_sharding)
    lowered = setup.train_step().lower(setup.abstract_state(), batch)
    out = {"attention": setup.spec.execution.attention}
    try:
        out["xla"] = compile_with_heap(lowered, setup.mesh.devices.flat[0].platform)[1]
    except OutOfHbm as e:
        if e.heap is None:
            raise
        state = memory.shard_bytes(setup.abstract_state())  # the arguments: one device's shards of the state
        out["xla"] = {"arguments": state, "heap": e.heap, "total": e.heap}
        out["refused"] = True
    return out


def run_grid():
    done = set()
    if os.path.exists(_OUT.value):
        with open(_OUT.value) as f:
            done = {(r["config"], r["compiler"], r["remat"], r["mesh"]) for r in map(json.loads, f)}
    compilers = compiler_devices(_TARGETS.value + (["cpu"] if _CPU.value else []))
    for name, remat, mesh, compiler in itertools.product(_CONFIGS.value, _REMATS.value, MESHES, compilers):
        if (name, compiler, remat, mesh) in done or (compiler == "cpu" and mesh != "fsdp=4"):
            continue
        row = {"config": name, "compiler": compiler, "remat": remat, "mesh": mesh}
        row.update(measure(config_for(name, remat, MESHES[mesh]), compilers[compiler]))
        print(json.dumps(row), flush=True)
        with open(_OUT.value, "a") as f:
            f.write(json.dumps(row) + "\n")


def arithmetic(row: dict, devices) -> dict:
    """The memory arithmetic of today's code for a recorded row (its config, remat and mesh) on `devices`."""
    from trainer.planning import memory
    from trainer.training.setup import build

    cfg = config_for(row["config"], row["remat"], MESHES[row["mesh"]])
    return memory.bytes_per_device(cfg, build(cfg, devices))


def compiler_devices(compilers) -> dict:
    import jax

    from trainer.planning.targets import parse_target, target_devices

    return {c: jax.devices("cpu")[:4] if c == "cpu" else target_devices(parse_target(c)) for c in compilers}


def table(path: str) -> str:
    """Markdown, GiB per device: today's arithmetic beside each compiler's recorded total and how far off it is."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    targets = sorted({r["compiler"] for r in rows} - {"cpu"})
    devices = compiler_devices(targets + ["cpu"])
    cells = {}
    for r in rows:
        cells.setdefault((r["config"], r["remat"], r["mesh"]), {})[r["compiler"]] = r
    gib = 2**30
    head = ["config", "remat", "mesh", "arithmetic (TPU)", *(f"XLA:TPU {t}" for t in targets),
            "arithmetic (CPU)", "XLA:CPU"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 3 + " ---: |" * (len(head) - 3)]
    for (name, remat, mesh), by in cells.items():
        parts = [name, remat, mesh]
        for compilers in (targets, ["cpu"]):
            found = [by[c] for c in compilers if c in by]
            if not found:
                parts += [""] * (1 + len(compilers))
                continue
            counted = arithmetic(found[0], devices[found[0]["compiler"]])["total"]
            parts.append(f"{counted / gib:.2f}")
            for c in compilers:
                if c not in by:
                    parts.append("")
                    continue
                x = by[c]["xla"]["total"]
                refused = " (refused)" if by[c].get("refused") else ""
                parts.append(f"{x / gib:.2f}{refused} ({counted / x - 1:+.0%})")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main():
    if not _TABLE.value:
        run_grid()
    print(table(_OUT.value))


if __name__ == "__main__":
    import jax

    jax.config.update("jax_platforms", "cpu")  # JAX read JAX_PLATFORMS when trainer.cli imported it
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    cli.run(main, uses_devices=False)
