"""Offline distillation's stored logits: their bytes per token, how fast the teacher writes them, and how fast
training reads them beside the tokens.

    python benchmarks/teacher_logits.py --config configs/distill_tiny.py [--windows 20] [--append]

The teacher is the config's distill.teacher, or with --teacher_config a model of that recipe trained one step
(speed does not depend on what it learnt) in a temporary folder. scripts/teacher_logits.py's writing, in this
process, of `windows` windows of every row (`write_tokens_per_s`: tokens scored by the teacher and written,
with the teacher's compile), the files' size (`bytes_per_token`: 8 x top_k and the files' headers), and the
training batches read from the prepared corpus with their logits (`read_tokens_per_s`) against without
(`tokens_only_per_s`), both in one thread as training's reading thread reads them.
"""

import os
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_WINDOWS = flags.DEFINE_integer("windows", 20, "Windows of every row written and read (train.steps of the logits).")
_TEACHER = flags.DEFINE_string("teacher_config", "", "A recipe whose model, trained one step, is the teacher.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def read_rate(stream, cfg, windows: int) -> float:
    from trainer.data import streams

    rows = cfg.train.global_batch_size
    data = iter(streams.batches(stream, cfg.data.train_split, range(rows), shuffle=True))
    next(data)
    start = time.perf_counter()
    for _ in range(windows - 1):
        next(data)
    return (windows - 1) * rows * cfg.data.seq_len / (time.perf_counter() - start)


def main():
    from trainer.config.forms import from_file, with_changes
    from trainer.data import corpora, streams
    from trainer.run.loop import train
    from trainer.training.offline_teacher import write_logits
    from trainer.training.teacher import teacher_config

    cfg, windows = _CONFIG.value, _WINDOWS.value
    folder = tempfile.mkdtemp()
    if _TEACHER.value:
        teacher = with_changes(from_file(_TEACHER.value), {"train.steps": 1, "train.eval_every": 0,
                                                            "train.sample_prompts": (), "optim.warmup_steps": 0,
                                                            "data.data_dir": cfg.data.data_dir})  # fmt: skip
        train(teacher, os.path.join(folder, "teacher"))
        cfg.distill.teacher = os.path.join(folder, "teacher")
    cfg = with_changes(cfg, {"distill.mode": "offline", "train.steps": windows, "optim.warmup_steps": 0,
                             "distill.logits_dir": os.path.join(folder, "logits")})  # fmt: skip
    if cfg.data.source == "text_files":
        corpora.prepare(cfg.data)
    tokens = windows * cfg.train.global_batch_size * cfg.data.seq_len
    start = time.perf_counter()
    written = write_logits(cfg, say=lambda _: None)
    write = tokens / (time.perf_counter() - start)
    size = sum(os.path.getsize(os.path.join(written, "rows", f)) for f in os.listdir(os.path.join(written, "rows")))
    cfg = with_changes(cfg, {"distill.teacher": teacher_config(cfg).checkpoint.init_from})  # pinned, as written
    plain = streams.Stream.from_config(cfg)
    figures = {"top_k": cfg.distill.top_k, "bytes_per_token": round(size / tokens, 1),
               "write_tokens_per_s": round(write),
               "read_tokens_per_s": round(read_rate(plain.with_teacher_logits(cfg), cfg, windows)),
               "tokens_only_per_s": round(read_rate(plain, cfg, windows))}  # fmt: skip
    report("teacher_logits", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main)
