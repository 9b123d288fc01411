"""Write a teacher's top-k logits for every window a distilling run will train on (offline distillation):

    python scripts/teacher_logits.py --config configs/distill_tiny.py --config.distill.mode=offline \\
        [--config.distill.top_k=K] [--workers N] [--beam_options "..."]

They go beside the prepared corpus (<data.data_dir>/teacher_logits/...; distill.logits_dir to choose),
a row of the global batch a file, with a manifest of what they were made for; the run then reads them in
step with its tokens (trainer/data/teacher_logits.py). Rows already written are kept, so an interrupted
run of this script is finished by running it again. --workers N runs the rows as an Apache Beam pipeline
(DirectRunner, N processes; the beam extra), --beam_options on any runner. It prints how far it has got
every 30 seconds.
"""

from absl import flags

from trainer.data import corpora
from trainer.run import cli
from trainer.training.offline_teacher import write_logits

_CONFIG = cli.define_config_flag()
_WORKERS = flags.DEFINE_integer("workers", 1, "Processes on this machine (Apache Beam's DirectRunner); 1: this one.")
cli.at_least(_WORKERS, 1, "must be 1 (this process) or more (Beam's DirectRunner with that many).")
_BEAM = flags.DEFINE_string("beam_options", "", "Apache Beam pipeline options for another runner (a cluster).")


def main():
    cfg = _CONFIG.value
    if cfg.data.source == "text_files":
        corpora.prepare(cfg.data)
    folder = write_logits(cfg, workers=_WORKERS.value, beam_options=_BEAM.value)
    per_token = 8 * cfg.distill.top_k
    print(f"teacher logits in {folder}: top {cfg.distill.top_k} a token, {per_token} bytes a token")


if __name__ == "__main__":
    cli.run(main)
