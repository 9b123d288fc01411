"""Preparing a corpus: its rate on 1 and 2 workers, its peak memory per worker at two sizes, the read rate
of the tokenised store and of Megatron's and Dolma's files, and Dolma's own tokenizer side by side.

    python benchmarks/prepare.py [--mb 1200] [--small_mb 400] [--dolma /path/to/venv/bin/dolma] [--append]

The corpus: 16 gzip JSON-lines files (Dolma's document form, {"id", "text"}, which both read), English-like
word sequences and Python sources of this machine's standard library, `--small_mb` of them, then the same
files three times over (`--mb`). Each preparation runs in a process of its own with the hf tokenizer (a
BPE of 32,768 pieces trained first on a sample) and --tokenize:

- `rate_mb_s_<w>w`, `tokens_per_s_<w>w`: input MB and tokens per second with w workers (1: in process;
  2: Beam's DirectRunner), on the large corpus; `speedup_2w` = the 2-worker rate over the 1-worker one;
- `peak_mb_1w_small`, `peak_mb_1w_large`: the largest resident memory of the one process doing the work, on
  the small and the large corpus (flat if it does not grow with the corpus); `peak_mb_per_worker_2w_large`:
  the largest of Beam's two workers' on the large one;
- `read_tokens_per_s_<format>`: global batches of 16 x 2048 read, packed and stacked in one thread from
  the store (its flat token files), from the store's records alone (`store_records`: a store prepared
  before the flat files), from Megatron .bin/.idx (written by megatron-core's builder from the store's
  documents) and from Dolma's .npy (its own `dolma tokens` output);
- `dolma_tokens_per_s_2p`, `ours_over_dolma`: `dolma tokens` with the same tokenizer file and 2 processes
  on the same files, and our 2-worker rate over it (with --dolma: dolma 1.2.1 does not install beside this
  project, so give the `dolma` of a virtualenv of its own; without it these say "skipped").

The smoke run (tests/test_benchmarks.py) is `--mb 2 --small_mb 1 --batches 2`.
"""

import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import pipeline_rate  # noqa: E402

_MB = flags.DEFINE_integer("mb", 1200, "Size of the large corpus, MB of JSON lines (uncompressed).")
_SMALL = flags.DEFINE_integer("small_mb", 400, "Size of the small corpus (the large one is it, three times).")
_DOLMA = flags.DEFINE_string("dolma", "", "A `dolma` executable (its own virtualenv) to compare with; '' skips.")
_BATCHES = flags.DEFINE_integer("batches", 50, "Global batches of 16 x 2048 read for each read rate.")
_DIR = flags.DEFINE_string("dir", "/tmp/trainer-prepare-bench", "Where the corpora and outputs go (rebuilt).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")
FILES = 16
VOCAB = 32768

PREPARE = """
import glob, json, os, sys, threading, time
from trainer.data import corpora
from trainer.config import defaults

def high_water(pid):
    try:
        return next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return 0.0

# The kernel's high-water mark of each process doing the work (ru_maxrss would carry over its parent's at
# exec): this one, or Beam's workers, its descendants (started through a shell), looked at every 0.2 s.
children, done = {}, threading.Event()
def watch():
    while not done.wait(0.2):
        parent = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                parent[int(stat.split("/")[2])] = int(open(stat).read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
        for pid in parent:
            up = pid
            while up in parent and up != os.getpid():
                up = parent[up]
            if up == os.getpid() and pid != os.getpid():
                children[pid] = max(children.get(pid, 0.0), high_water(pid))
threading.Thread(target=watch, daemon=True).start()
cfg = defaults()
cfg.data.update(source="text_files", name="bench", paths=sys.argv[1], data_dir=sys.argv[2], tokenizer="hf",
                tokenizer_path=sys.argv[3], tokenized=True)
start = time.perf_counter()
corpora.prepare(cfg.data, workers=int(sys.argv[4]), say=lambda line: None)
seconds = time.perf_counter() - start
done.set()
peak = high_water("self") if int(sys.argv[4]) == 1 else max(children.values())
print(json.dumps({"seconds": seconds, "peak_mb": peak}))
"""


def make_corpus(root: str, mb: int) -> tuple[list[str], int]:
    """FILES files of about mb/FILES MB each: word sequences and Python sources, one document a line; and the
    bytes of JSON lines written."""
    os.makedirs(root, exist_ok=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = []
    for folder, _, names in os.walk(stdlib):
        if "site-packages" not in folder:
            sources += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    code = [open(p, encoding="utf-8", errors="replace").read() for p in sorted(sources)[:1500]]
    words = np.array(sorted({w for text in code[:300] for w in text.split() if w.isalpha()}))
    rng = np.random.default_rng(0)
    paths, total = [], 0
    for f in range(FILES):
        path = os.path.join(root, f"part-{f:02d}.jsonl.gz")
        written, i = 0, 0
        with gzip.open(path, "wt", compresslevel=1) as out:
            while written < mb * 2**20 / FILES:
                if i % 3 == 2:
                    text = code[int(rng.integers(len(code)))]
                else:
                    text = " ".join(words[rng.integers(0, len(words), int(rng.lognormal(6, 0.8)))])
                line = json.dumps({"id": f"{f}-{i}", "text": text}) + "\n"
                out.write(line)
                written, i = written + len(line), i + 1
        paths.append(path)
        total += written
    return paths, total


def train_tokenizer(paths: list[str], out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        with gzip.open(paths[0], "rt") as f:
            for n, line in enumerate(f):
                if n >= 20000:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts(), trainer)
    path = os.path.join(out, "tokenizer.json")
    spec = json.loads(tok.to_str())
    # Merges as "a b" strings, the form every tokenizers version reads (dolma 1.2.1 pins 0.19, which predates
    # the pairs newer versions write); byte-level pieces hold no space.
    spec["model"]["merges"] = [" ".join(pair) if isinstance(pair, list) else pair for pair in spec["model"]["merges"]]
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def prepare(paths: str, data_dir: str, tokenizer: str, workers: int) -> dict:
    run = subprocess.run([sys.executable, "-c", PREPARE, paths, data_dir, tokenizer, str(workers)],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def tokens_in(data_dir: str) -> int:
    from trainer.config import defaults
    from trainer.data.readers import open_prepared

    data = defaults().data
    data.update(source="text_files", data_dir=data_dir, tokenized=True)
    total = 0
    for split in ("train", "validation"):
        source = open_prepared(data, "text_files/bench-tokens", split)
        total += sum(len(source[i]["tokens"]) for i in range(len(source)))
    return total


def megatron_from_store(data_dir: str, prefix: str) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from trainer.config import defaults
    from trainer.data.readers import open_prepared

    data = defaults().data
    data.update(source="text_files", data_dir=data_dir, tokenized=True)
    source = open_prepared(data, "text_files/bench-tokens", "train")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(len(source)):
        tokens = source[i]["tokens"]
        builder.add_document(torch.from_numpy(tokens.astype(np.int64)), [len(tokens)])
    builder.finalize(f"{prefix}.idx")


def dolma_from_store(data_dir: str, path: str) -> None:
    """The store's training documents as one bare uint16 token file, Dolma's form (each ends with EOS already)."""
    from trainer.config import defaults
    from trainer.data.readers import open_prepared

    data = defaults().data
    data.update(source="text_files", data_dir=data_dir, tokenized=True)
    source = open_prepared(data, "text_files/bench-tokens", "train")
    np.concatenate([source[i]["tokens"] for i in range(len(source))]).astype(np.uint16).tofile(path)


def dolma(executable: str, paths: list[str], tokenizer: str, out: str, processes: int) -> tuple[float, int]:
    start = time.perf_counter()
    run = subprocess.run([executable, "tokens", "--documents", *paths, "--destination", out,
                          "--tokenizer.name_or_path", tokenizer, "--tokenizer.eos_token_id", "2",
                          "--tokenizer.pad_token_id", "0", "--processes", str(processes), "--dtype", "uint16"],
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    seconds = time.perf_counter() - start
    tokens = sum(os.path.getsize(os.path.join(out, f)) // 2 for f in os.listdir(out) if f.endswith(".npy"))
    return seconds, tokens


def main(_):
    from trainer.config import defaults

    root = _DIR.value
    shutil.rmtree(root, ignore_errors=True)
    small, small_bytes = make_corpus(os.path.join(root, "small"), _SMALL.value)
    large = os.path.join(root, "large")
    os.makedirs(large)
    for copy in range(3):  # the same files three times over
        for path in small:
            shutil.copy(path, os.path.join(large, f"{copy}-{os.path.basename(path)}"))
    tokenizer = train_tokenizer(small, root)
    mb = {"small": small_bytes / 1e6, "large": 3 * small_bytes / 1e6}  # of JSON lines, uncompressed
    figures = {"corpus_mb": round(mb["large"], 1)}
    peak_small = prepare(f"{root}/small/*.jsonl.gz", f"{root}/out-small", tokenizer, 1)
    runs = {w: prepare(f"{root}/large/*.jsonl.gz", f"{root}/out-{w}w", tokenizer, w) for w in (1, 2)}
    tokens = tokens_in(f"{root}/out-1w")
    for w, r in runs.items():
        figures[f"rate_mb_s_{w}w"] = mb["large"] / r["seconds"]
        figures[f"tokens_per_s_{w}w"] = tokens / r["seconds"]
    figures["speedup_2w"] = runs[1]["seconds"] / runs[2]["seconds"]
    figures["peak_mb_1w_small"] = peak_small["peak_mb"]
    figures["peak_mb_1w_large"] = runs[1]["peak_mb"]
    figures["peak_mb_per_worker_2w_large"] = runs[2]["peak_mb"]

    cfg = defaults()
    cfg.model.vocab_size = VOCAB
    cfg.data.update(source="text_files", name="bench", data_dir=f"{root}/out-1w", tokenizer="hf",
                    tokenizer_path=tokenizer, tokenized=True, seq_len=2048)  # fmt: skip
    cfg.train.global_batch_size = 16
    figures["read_tokens_per_s_store"] = pipeline_rate(cfg, _BATCHES.value)
    flat = glob.glob(f"{root}/out-1w/text_files/bench-tokens/1.0.0/*.ids")
    for path in flat:  # the store as prepared before its flat token files: read from its records
        os.rename(path, path + ".aside")
    figures["read_tokens_per_s_store_records"] = pipeline_rate(cfg, _BATCHES.value)
    for path in flat:
        os.rename(path + ".aside", path)
    megatron_from_store(f"{root}/out-1w", f"{root}/megatron")
    megatron = cfg.copy_and_resolve_references()
    megatron.data.update(source="megatron", paths=f"{root}/megatron", tokenized=False)
    figures["read_tokens_per_s_megatron"] = pipeline_rate(megatron, _BATCHES.value)
    if _DOLMA.value:
        seconds, dolma_tokens = dolma(_DOLMA.value, [f"{root}/large/*.jsonl.gz"], tokenizer, f"{root}/dolma", 2)
        figures["dolma_tokens_per_s_2p"] = dolma_tokens / seconds
        figures["ours_over_dolma"] = figures["tokens_per_s_2w"] / figures["dolma_tokens_per_s_2p"]
        npy = cfg.copy_and_resolve_references()
        npy.data.update(source="dolma", paths=f"{root}/dolma/*.npy", tokenized=False, token_dtype="uint16", eos_id=2)
        figures["read_tokens_per_s_dolma"] = pipeline_rate(npy, _BATCHES.value)
    else:  # no `dolma` to write its files: the same documents in its form, written here, are read
        figures.update(dict.fromkeys(("dolma_tokens_per_s_2p", "ours_over_dolma"), "skipped"))
        dolma_from_store(f"{root}/out-1w", f"{root}/from_store.npy")
        npy = cfg.copy_and_resolve_references()
        npy.data.update(source="dolma", paths=f"{root}/from_store.npy", tokenized=False, token_dtype="uint16",
                        eos_id=2)  # fmt: skip
        figures["read_tokens_per_s_dolma"] = pipeline_rate(npy, _BATCHES.value)
    report("prepare", figures, append=_APPEND.value)


if __name__ == "__main__":
    app.run(main)
