"""One GRPO step's two halves timed apart: sampling the completions (and recomputing their log-probabilities)
and training on them.

    python benchmarks/grpo.py --config configs/tiny.py [--group 4] [--new_tokens 32] [--steps 3] [--append]

Prompts asking for a word reversed are written and prepared in a temporary folder (data.format=prompts),
then each of `--steps` rounds takes a rollout (trainer/training/rollouts.py: train.global_batch_size completions,
`--group` of each prompt, `--new_tokens` each, at temperature 1) and one train step on it, after one round
that compiles both. `sampled_tokens_per_s` counts every position the sampler made (completions that end
early still run to `--new_tokens`); `trained_tokens_per_s` the step's whole rows (prompt, completion and
padding: data.seq_len each). `score_s` is the trainer's recomputation of the completions' log-probabilities,
part of the rollout; `logp_diff_max` the largest difference between the sampler's and the trainer's
log-probabilities of a completion token (torchtitan's trainer/sampler mismatch).
"""

import json
import os
import statistics
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_GROUP = flags.DEFINE_integer("group", 4, "Completions per prompt (rl.group_size).")
_NEW = flags.DEFINE_integer("new_tokens", 32, "Tokens sampled per completion (rl.max_new_tokens).")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed rollouts and steps.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main():
    import jax
    import numpy as np

    from trainer.config.forms import with_changes
    from trainer.data import corpora, streams
    from trainer.training import rollouts
    from trainer.training.setup import build

    folder = tempfile.mkdtemp(prefix="grpo-bench-")
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, "rows.jsonl"), "w") as f:
        for _ in range(512):
            w = "".join(rng.choice(list("abcdefghij"), rng.integers(3, 9)))
            f.write(json.dumps({"prompt": f"Reverse: {w}", "answer": w[::-1]}) + "\n")
    cfg = with_changes(_CONFIG.value, {
        "data.source": "text_files", "data.format": "prompts", "data.name": "grpo_bench", "data.tokenizer": "byte",
        "data.paths": os.path.join(folder, "rows.jsonl"), "data.data_dir": os.path.join(folder, "tfds"),
        "rl.group_size": _GROUP.value, "rl.max_new_tokens": _NEW.value, "rl.reward": "exact,similar",
        "train.eval_every": 0})  # fmt: skip
    corpora.prepare(cfg.data, say=lambda *_: None)
    setup = build(cfg)
    holder = {"state": setup.new_state()}
    size = cfg.train.global_batch_size
    source = rollouts.Rollouts(setup, streams.Stream.from_config(cfg), list(range(size)),
                               lambda: (holder["state"].params, None), False)  # fmt: skip
    step = setup.train_step()
    times = {"rollout": [], "sample": [], "score": [], "step": []}
    diffs = []
    for i in range(_STEPS.value + 1):  # the first round compiles
        start = time.perf_counter()
        _, local = next(source)
        rollout = time.perf_counter() - start
        figures = source.figures(i + 1)
        start = time.perf_counter()
        holder["state"], metrics = step(holder["state"], streams.to_global(local, setup.batch_sharding, size))
        jax.block_until_ready(metrics)
        if i:
            times["rollout"].append(rollout)
            times["sample"].append(figures["rl/sample_seconds"])
            times["score"].append(figures["rl/score_seconds"])
            times["step"].append(time.perf_counter() - start)
            diffs.append(figures["rl/logp_diff_max"])
    median = {k: statistics.median(v) for k, v in times.items()}
    report("grpo", {
        "config": os.path.basename(cli.config_path()), "devices": jax.device_count(), "completions": size,
        "group": _GROUP.value, "new_tokens": _NEW.value, "seq_len": cfg.data.seq_len,
        "sample_s": median["sample"], "score_s": median["score"], "rollout_s": median["rollout"],
        "step_s": median["step"], "sampled_tokens_per_s": size * _NEW.value / median["sample"],
        "trained_tokens_per_s": size * cfg.data.seq_len / median["step"],
        "sampling_share": median["rollout"] / (median["rollout"] + median["step"]), "logp_diff_max": max(diffs),
    }, append=_APPEND.value)  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
