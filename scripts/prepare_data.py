"""Prepare a text_files corpus ahead of training:

    python scripts/prepare_data.py --config configs/tiny.py [--tokenize] [--workers N] [--beam_options "..."]

One pass over the corpus's files writes both splits and, with --tokenize, its tokenised store (the token
ids, once; training then reads them: the same as --config.data.tokenized=true). Training prepares a
corpus on first use too (process 0 alone, in one process); this script is for doing it once before a
multi-host job starts, into a shared filesystem or a bucket (--config.data.data_dir=gs://bucket/tfds,
read by every host straight from it), and for a corpus too large for one core:

    --workers N          Apache Beam's DirectRunner with N processes on this machine
    --beam_options "..." any Beam runner's pipeline options, for a cluster, e.g.
                         "--runner=DataflowRunner --project=P --region=R --temp_location=gs://B/tmp"
                         (Spark: --runner=SparkRunner, Flink: --runner=FlinkRunner, with their own options)

Both need the beam extra (pip install -e ".[beam]"). The corpus is the same whatever the runner or the
number of workers. It prints how far it has got every 30 seconds (and a bar on a terminal).
"""

from absl import flags

from trainer.data import corpora
from trainer.run import cli
from trainer.storage import workdir as wd

_CONFIG = cli.define_config_flag()
_TOKENIZE = flags.DEFINE_bool("tokenize", False, "Also write the tokenised store (data.tokenized=true).")
_WORKERS = flags.DEFINE_integer("workers", 1, "Processes on this machine (Apache Beam's DirectRunner); 1: this one.")
cli.at_least(_WORKERS, 1, "must be 1 (this process) or more (Beam's DirectRunner with that many).")
_BEAM = flags.DEFINE_string("beam_options", "", "Apache Beam pipeline options for another runner (a cluster).")


def main():
    cfg = _CONFIG.value
    data = cfg.data
    if _TOKENIZE.value:
        data.tokenized = True
    if data.source != "text_files":
        print(f"data.source={data.source} needs no preparing: it is read as it is.")
        return
    wd.wait_for_storage(corpora.data_dir(data), cfg.checkpoint.retry_seconds, print, "data.data_dir")
    corpora.prepare(data, workers=_WORKERS.value, beam_options=_BEAM.value)
    sizes = {s: len(corpora.open_split(data, s)) for s in (data.train_split, data.eval_split)}
    print(f"{data.name} under {corpora.data_dir(data)}: " + ", ".join(f"{k} {v:,} documents" for k, v in sizes.items()))


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
