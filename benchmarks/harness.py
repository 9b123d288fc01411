"""lm-eval `loglikelihood` requests per second: ours (trainer/interop/harness/evaluation.py, on this host's
devices) against the harness's own `hf` backend on the same weights exported, in one run.

    python benchmarks/harness.py --config configs/tiny.py [--requests 512] [--append]

The weights are a checkpoint of one training step (on synthetic tokens), exported by convert_hf's code.
The requests are multiple-choice-like: a context of 40-240 bytes of text and a continuation of 1-24
bytes, four continuations per context. Each side scores them all once to compile or warm up, then once
timed; ours in batches of the config's microbatch (train.global_batch_size / train.grad_accum_steps),
the hf backend in batches of the same size, in fp32. `max_abs_diff` is the largest difference between the
two sides' log-likelihoods. Needs the `eval` and `hf` extras.
"""

import os
import sys
import tempfile
import time

import numpy as np
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_REQUESTS = flags.DEFINE_integer("requests", 512, "Log-likelihood requests to score (a quarter as many contexts).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")

WORDS = "the of and to in is was for on that with as by at from his her an which are this be or had it".split()


def requests(n: int) -> list:
    from lm_eval.api.instance import Instance

    rng = np.random.default_rng(0)

    def text(low, high):
        out = ""
        while len(out) < rng.integers(low, high):
            out += " " + WORDS[rng.integers(len(WORDS))]
        return out

    out = []
    for i in range(n // 4):
        context = text(40, 240).strip()
        for j in range(4):
            out.append(Instance("loglikelihood", {}, (context, text(1, 24)), idx=j, metadata=("bench", i, 1)))
    return out


def timed(method, reqs) -> tuple[list, float]:
    start = time.perf_counter()
    out = method(reqs)
    return out, time.perf_counter() - start


def main():
    from lm_eval.models.huggingface import HFLM

    from trainer.data.tokenizers import load_tokenizer
    from trainer.interop.harness.evaluation import HarnessLM
    from trainer.interop.huggingface import export_checkpoint
    from trainer.interop.scoring import Scorer
    from trainer.run.loop import train
    from trainer.training.resume import load_params

    cfg = _CONFIG.value
    cfg.train.update(steps=1, eval_every=0, sample_prompts=(), harness_tasks=())
    cfg.optim.warmup_steps = 0
    cfg.data.source = "synthetic"
    reqs = requests(_REQUESTS.value)
    with tempfile.TemporaryDirectory() as tmp:
        workdir, exported = f"{tmp}/run", f"{tmp}/hf"
        train(cfg, workdir)
        export_checkpoint(cfg, workdir, None, exported)
        setup, _, params = load_params(cfg, workdir)
        ours = HarnessLM(Scorer(setup), params, load_tokenizer(cfg.data))
        rows = ours.scorer.rows
        theirs = HFLM(pretrained=exported, dtype="float32", batch_size=rows, max_length=cfg.data.seq_len,
                      device="cpu")  # fmt: skip
        timed(ours.loglikelihood, reqs)  # compiles each padded length
        timed(theirs.loglikelihood, reqs[: 4 * rows])
        ours_out, ours_s = timed(ours.loglikelihood, reqs)
        theirs_out, theirs_s = timed(theirs.loglikelihood, reqs)
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours_out, theirs_out, strict=True))
    report(
        "harness",
        {
            "config": os.path.basename(cli.config_path()),
            "requests": len(reqs),
            "speedup": theirs_s / ours_s,
            "ours_requests_per_s": len(reqs) / ours_s,
            "hf_requests_per_s": len(reqs) / theirs_s,
            "rows": rows,
            "max_abs_diff": float(diff),
        },
        append=_APPEND.value,
    )


if __name__ == "__main__":
    cli.run(main)
