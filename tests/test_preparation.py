"""A pretraining corpus of any size: one pass on Apache Beam or in this process, the same corpus either way;
a document's side of the split by its own place; one builder at a time; progress while it runs; and
corpora other stacks tokenised (Megatron-LM's .bin/.idx, Dolma's .npy), read as they are."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cli_args, micro_config
from test_data import held_out

from trainer.config.errors import ConfigError
from trainer.data import corpora, readers, streams
from trainer.data.preparation import progress, work
from trainer.data.tokenizers import BOS_ID, EOS_ID, ByteTokenizer


def mixed_corpus(root) -> list[tuple[str, list[str]]]:
    """Parquet, zstd JSON lines and text files (a few hundred KB): [(file below root, its documents)]."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = np.random.default_rng(0)
    words = ["def", "the", "return", "model", "data", "x", "for", "in", "ünï", "\n"]
    text = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    made = []
    root.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        rows = [text(int(n)) for n in rng.integers(1, 60, 150)]
        pq.write_table(pa.table({"text": rows}), root / f"part-{i}.parquet", row_group_size=50)
        made.append((f"part-{i}.parquet", rows))
    for i in range(2):
        lines = [text(int(n)) for n in rng.integers(1, 60, 120)]
        with zstandard.open(root / f"web-{i}.jsonl.zst", "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in lines)
        made.append((f"web-{i}.jsonl.zst", lines))
    for i in range(60):
        doc = text(int(rng.integers(50, 400)))
        (root / f"file-{i:02d}.txt").write_text(doc)
        made.append((f"file-{i:02d}.txt", [doc]))
    return sorted(made)


def read_all(data, split: str, key: str) -> list:
    source = corpora.open_split(data, split)
    return [source[i][key] for i in range(len(source))]


def test_a_corpus_is_the_same_whatever_prepares_it_and_holds_out_by_each_documents_place(tmp_path, monkeypatch):
    """One pass over Parquet, zstd JSON-lines and text files makes both splits and the tokenised store, in this
    process and on Beam's DirectRunner with 2 processes (units of ~20 KB: many shards): every document of
    both, text and token ids, in the same order; each held out by the hash of its own place, computed here
    apart from the code (test_data.held_out), in file order; the tokens are BOS, the text's bytes, EOS."""
    pytest.importorskip("apache_beam", reason="the beam extra is not installed: pip install -e '.[beam]'")
    made = mixed_corpus(tmp_path / "corpus")
    monkeypatch.setattr(work, "UNIT_BYTES", 20_000)
    prepared = {}
    for workers in (1, 2):
        data = micro_config(data=dict(source="text_files", name="mixed", paths=f"{tmp_path}/corpus/*",
                                      data_dir=str(tmp_path / f"tfds{workers}"), tokenized=True,
                                      validation_fraction=0.1)).data  # fmt: skip
        corpora.prepare(data, workers=workers)
        prepared[workers] = {(s, "tokens"): read_all(data, s, "tokens") for s in ("train", "validation")}
        data.tokenized = False  # the text corpus itself, made in the same pass
        prepared[workers].update({(s, "text"): read_all(data, s, "text") for s in ("train", "validation")})
    for key, one in prepared[1].items():
        two = prepared[2][key]
        assert len(one) == len(two) and all(np.array_equal(a, b) for a, b in zip(one, two, strict=True)), key
    shards = [f for f in os.listdir(tmp_path / "tfds2" / "text_files" / "mixed" / "1.0.0") if "-train." in f]
    assert len(shards) > 5  # the text files alone made several units
    for split in ("train", "validation"):
        place = lambda rel, i: rel if rel.endswith(".txt") else f"{rel}:{i}"  # noqa: E731 - a text file: one document
        expected = [doc for rel, docs in made for i, doc in enumerate(docs)
                    if held_out(place(rel, i), 0.1) == (split == "validation")]  # fmt: skip
        assert [t.decode() for t in prepared[1][split, "text"]] == expected
        tokens = [np.concatenate([[BOS_ID], ByteTokenizer().encode(t), [EOS_ID]]) for t in expected]
        assert all(np.array_equal(a, b) for a, b in zip(prepared[1][split, "tokens"], tokens, strict=True))
    assert 0.05 < len(prepared[1]["validation", "text"]) / sum(len(d) for _, d in made) < 0.15


def test_a_documents_side_does_not_move_when_another_directory_joins(tmp_path):
    """web/*.jsonl alone, then web/*.jsonl with code/*.jsonl: each web document is held out or not alike in
    both, by its place below web/, its glob's root (before, the place was below the files' common root, and
    most held-out web documents of the second were training documents of the first)."""
    for folder in ("web", "code"):
        (tmp_path / folder).mkdir()
        for i in range(16):
            lines = [json.dumps({"text": f"{folder} {i} line {j}"}) for j in range(10)]
            (tmp_path / folder / f"{i:02d}.jsonl").write_text("\n".join(lines) + "\n")
    held = {}
    web, code = f"{tmp_path}/web/*.jsonl", f"{tmp_path}/code/*.jsonl"
    for name, paths in (("web", web), ("both", f"{web},{code}")):
        data = micro_config(data=dict(source="text_files", name=name, paths=paths, data_dir=str(tmp_path / "tfds"),
                                      validation_fraction=0.2)).data  # fmt: skip
        corpora.prepare(data)
        held[name] = {t.decode() for t in read_all(data, "validation", "text")}
    web = {t for t in held["both"] if t.startswith("web")}
    assert web == held["web"] == {f"web {i} line {j}" for i in range(16) for j in range(10)
                                  if held_out(f"{i:02d}.jsonl:{j}", 0.2)}  # fmt: skip
    assert len(web) > 10 and len(held["both"]) > len(web)


SLOW_UNITS = """
import os, time
if os.environ.get("PREPARE_SLOWLY"):
    from trainer.data.preparation import work
    prepare_unit = work.prepare_unit

    def slowly(unit, plan):
        time.sleep(float(os.environ["PREPARE_SLOWLY"]))
        return prepare_unit(unit, plan)

    work.prepare_unit = slowly
"""


@pytest.mark.slow  # two processes preparing on Beam, 39 s (2026-12-06): room for the suite's 10 minutes
def test_two_processes_preparing_one_corpus_end_with_one_corpus(tmp_path):
    """Two scripts/prepare_data.py on the same corpus and data_dir at once (the first made slow by a
    sitecustomize that delays each unit): the second waits for the first and uses its corpus; both succeed,
    with no traceback, and one corpus, with no staging left, is there."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_UNITS)
    mixed_corpus(tmp_path / "corpus")
    args = [sys.executable, "scripts/prepare_data.py", "--config", "configs/tiny.py",
            f"--config.data.paths={tmp_path}/corpus/*", f"--config.data.data_dir={tmp_path}/tfds"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "PREPARE_SLOWLY": "6"}
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.stdout.readline().startswith("preparing python_stdlib from 65 files")  # it holds the lock
    second = subprocess.run(args, cwd=REPO, env={**env, "PREPARE_SLOWLY": ""}, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, err + second.stderr
    assert "another process is preparing python_stdlib; waiting for it to finish" in second.stdout
    assert "preparing python_stdlib from" not in second.stdout  # it built nothing
    for said in (out, second.stdout):
        assert said.strip().splitlines()[-1].startswith(f"python_stdlib under {tmp_path}/tfds: train ")
    assert "Traceback" not in err + second.stderr
    assert sorted(os.listdir(tmp_path / "tfds" / "text_files")) == ["python_stdlib"]


def test_a_long_preparation_says_how_far_it_has_got(tmp_path, monkeypatch):
    """Lines every interval (here 0.2 s, 30 by default) with the documents, text, tokens and input read so
    far, its rate and the time left; then the prepared totals."""
    mixed_corpus(tmp_path / "corpus")
    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.2)
    monkeypatch.setattr(work, "REPORT_SECONDS", 0.0)
    slow = work.documents

    def documents(*args):
        for document in slow(*args):
            yield document
            __import__("time").sleep(0.003)

    monkeypatch.setattr(work, "documents", documents)
    said = []
    data = micro_config(data=dict(source="text_files", name="slow", paths=f"{tmp_path}/corpus/*",
                                  data_dir=str(tmp_path / "tfds"), tokenized=True)).data  # fmt: skip
    corpora.prepare(data, say=said.append)
    lines = [s for s in said if s.startswith("preparing slow: ")]
    pattern = r"preparing slow: [\d,]+ documents, [\d.]+ MB of text, [\d,]+ tokens; \d+% of [\d.]+ MB read at "
    assert len(lines) >= 2 and all(re.match(pattern + r"[\d.]+ MB/s, \dm\d\ds left$", s) for s in lines), said
    assert said[-1].startswith("prepared slow: 750 documents, ")


def megatron_files(prefix, documents: list[np.ndarray]) -> None:
    """Written by megatron-core's own IndexedDatasetBuilder (uint16 ids), two of the documents in two
    sequences each."""
    torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
    pytest.importorskip("megatron.core", reason="the formats extra is not installed: pip install -e '.[formats]'")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i, doc in enumerate(documents):
        if i % 7 == 3 and len(doc) > 1:  # a document of two sequences
            builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc) // 2, len(doc) - len(doc) // 2])
        else:
            builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def dolma_file(path, documents: list[np.ndarray], dtype) -> None:
    """Dolma's token file, written from its published form (a bare array of ids, which OLMo-core memory-maps):
    neither dolma 1.2.1 nor ai2-olmo-core 3.0.0 installs here beside the rest (they pin older numpy, fsspec,
    tokenizers, huggingface_hub)."""
    array = np.concatenate(documents).astype(dtype)
    np.memmap(path, dtype, "w+", shape=array.shape)[:] = array


def test_megatron_and_dolma_token_files_are_read_as_they_are_and_mixed_with_ours(tmp_path):
    """Documents of byte ids, [BOS, text, EOS] each, written by megatron-core's builder and as Dolma's files:
    every document comes back whole, one of every 50 held out (the 50th, 100th, ...), with no preparation;
    a mixture of a corpus prepared here and both, weighted 2:1:1 by tokens, draws them so; bad files are one
    sentence each."""
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[BOS_ID], rng.integers(3, 259, int(n)), [EOS_ID]]) for n in rng.integers(5, 300, 400)]
    megatron_files(tmp_path / "meg", docs)
    dolma_file(tmp_path / "dolma-0.npy", docs[:250], np.uint32)
    dolma_file(tmp_path / "dolma-1.npy", docs[250:], np.uint32)
    # One of every 50 of the corpus, its files one after another (a file's own count does not matter).
    expected = {"train": [d for i, d in enumerate(docs) if i % 50 != 49],
                "validation": [d for i, d in enumerate(docs) if i % 50 == 49]}  # fmt: skip
    for source, paths, want in (("megatron", str(tmp_path / "meg"), expected),
                                ("dolma", f"{tmp_path}/dolma-*.npy", expected)):  # fmt: skip
        cfg = micro_config(data=dict(source=source, paths=paths, token_dtype="uint32"))
        stream = streams.Stream.from_config(cfg)
        for split, documents in want.items():
            got = readers.open_split(stream, stream.name, split)
            assert len(got) == len(documents), (source, split)
            assert all(np.array_equal(got[i]["tokens"], d) for i, d in enumerate(documents)), (source, split)

    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": "note " * int(n)}) + "\n"
                                                  for n in rng.integers(2, 60, 2000)))  # fmt: skip
    ours = dict(source="text_files", name="notes", paths=str(tmp_path / "notes.jsonl"), data_dir=str(tmp_path / "tfds"))
    corpora.prepare(micro_config(data=ours).data)
    mixed = micro_config(data=dict(ours, seq_len=256, token_dtype="uint32",
                                   mixture=("notes:2", f"{tmp_path}/meg:1", f"{tmp_path}/dolma-*.npy:1")),
                         train=dict(global_batch_size=8))  # fmt: skip
    it = iter(streams.batches(streams.Stream.from_config(mixed), "train", range(8), shuffle=True))
    counts = sum(streams.mixture_counts(next(it), "tokens", 3, BOS_ID) for _ in range(100))
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.25, 0.25], atol=0.01)
    # Shuffled by index and resumed from the checkpoint's JSON as any corpus: the same windows after.
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(3)]
    resumed = iter(streams.batches(streams.Stream.from_config(mixed), "train", range(8), shuffle=True))
    resumed.set_state(state)
    for batch in expected:
        np.testing.assert_array_equal(next(resumed)["tokens"], batch["tokens"])

    (tmp_path / "bad.idx").write_bytes(b"NOTMEGA\x00\x00" + bytes(25))
    (tmp_path / "bad.bin").write_bytes(bytes(8))
    (tmp_path / "odd.npy").write_bytes(bytes(7))
    small = micro_config(model=dict(vocab_size=128), data=dict(source="dolma", paths=f"{tmp_path}/dolma-0.npy",
                                                               token_dtype="uint32"))  # fmt: skip
    cases = [(micro_config(data=dict(source="megatron", paths=str(tmp_path / "bad"))),
              r"bad.idx does not begin with Megatron's index header"),
             (micro_config(data=dict(source="dolma", paths=str(tmp_path / "odd.npy"), token_dtype="uint32")),
              r"odd.npy is 7 bytes, not a whole number of uint32 tokens \(4 bytes each\)"),
             (small, r"dolma-0.npy holds token id 25\d, at or above model.vocab_size=128")]  # fmt: skip
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            stream = streams.Stream.from_config(cfg)
            readers.open_split(stream, stream.name, "train")


def test_a_runner_that_cannot_run_here_is_one_sentence_before_anything_is_written(tmp_path):
    pytest.importorskip("apache_beam", reason="the beam extra is not installed: pip install -e '.[beam]'")
    mixed_corpus(tmp_path / "corpus")
    data = micro_config(data=dict(source="text_files", paths=f"{tmp_path}/corpus/*",
                                  data_dir=str(tmp_path / "tfds"))).data  # fmt: skip
    with pytest.raises(ConfigError, match=r"the Beam runner NoSuchRunner cannot be loaded here"):
        corpora.prepare(data, beam_options="--runner=NoSuchRunner")
    with pytest.raises(ConfigError, match=r"the Beam runner PortableRunner runs on other machines, which cannot "
                                          r"write data.data_dir="):  # fmt: skip
        corpora.prepare(data, beam_options="--runner=PortableRunner")
    assert not (tmp_path / "tfds").exists()


BOUNDED = """
import json, sys
from trainer.config import defaults
from trainer.data import corpora
cfg = defaults()
cfg.data.update(source="text_files", name="big", paths=sys.argv[1], data_dir=sys.argv[2], validation_fraction=0.001)
corpora.prepare(cfg.data, say=lambda line: None)
sizes = [len(corpora.open_split(cfg.data, split)) for split in ("train", "validation")]
# The kernel's high-water mark of this process's own memory (ru_maxrss would carry over the parent's at exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"sizes": sizes, "peak_mb": peak / 1024}))
"""


# ~1.5 minutes on two cores (pytest -m slow): writing 1.1 GB, then one pass over it
@pytest.mark.slow
def test_a_corpus_over_a_gigabyte_is_prepared_in_bounded_memory(tmp_path):
    """1.1 GB of JSON lines in one split's worth of files (before, TFDS's shuffler spilled past 1 GB through
    TensorFlow, which is not installed, and crashed): every line is a document of one split or the other, and
    the process doing it never held more than a fraction of it (its peak resident memory, the kernel's
    high-water mark, under 400 MB; measured 228 MB, as for a single 140 MB file)."""
    (tmp_path / "big").mkdir()
    block = "".join(json.dumps({"text": f"line {i} " + "words of a document " * (i % 40 + 1)}) + "\n"
                    for i in range(20000))  # fmt: skip
    lines = 0
    for f in range(8):
        with open(tmp_path / "big" / f"part-{f}.jsonl", "w") as out:
            for _ in range(1100 * 2**20 // (8 * len(block)) + 1):
                out.write(block)
                lines += 20000
    assert sum(os.path.getsize(tmp_path / "big" / f) for f in os.listdir(tmp_path / "big")) > 1.1e9
    run = subprocess.run([sys.executable, "-c", BOUNDED, f"{tmp_path}/big/*.jsonl", str(tmp_path / "tfds")],
                         cwd=REPO, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert sum(result["sizes"]) == lines and result["sizes"][1] > 0
    assert result["peak_mb"] < 400, result


def test_token_files_of_few_documents_each_hold_out_the_asked_fraction_and_a_real_npy_is_read_as_its_array(tmp_path):
    """Forty Dolma files of 7 documents and forty Megatron datasets of 7 (fewer than K = 50 each): the corpus
    holds out one of every 50 of its 280 documents, whatever its files' sizes. A file np.save wrote (with its
    \x93NUMPY header) is read as the array it holds, not as tokens. A corpus too small to hold any out is
    one sentence naming its files and the rule."""
    rng = np.random.default_rng(2)
    docs = [np.concatenate([[BOS_ID], rng.integers(3, 259, int(n)), [EOS_ID]]) for n in rng.integers(5, 60, 280)]
    for f in range(40):
        dolma_file(tmp_path / f"small-{f:02d}.npy", docs[7 * f : 7 * f + 7], np.uint16)
        megatron_files(tmp_path / f"meg-{f:02d}", docs[7 * f : 7 * f + 7])
    want = {"train": [d for i, d in enumerate(docs) if i % 50 != 49],
            "validation": [d for i, d in enumerate(docs) if i % 50 == 49]}  # fmt: skip
    megatron = ",".join(str(tmp_path / f"meg-{f:02d}") for f in range(40))
    for source, paths in (("dolma", f"{tmp_path}/small-*.npy"), ("megatron", megatron)):
        cfg = micro_config(data=dict(source=source, paths=paths, token_dtype="uint16"))
        stream = streams.Stream.from_config(cfg)
        for split, documents in want.items():
            got = readers.open_split(stream, stream.name, split)
            assert len(got) == len(documents) == {"train": 275, "validation": 5}[split], (source, split, len(got))
            assert all(np.array_equal(got[i]["tokens"], d) for i, d in enumerate(documents)), (source, split)

    np.save(tmp_path / "saved.npy", np.concatenate(docs[:60]).astype(np.uint32))
    cfg = micro_config(data=dict(source="dolma", paths=str(tmp_path / "saved.npy"), token_dtype="uint16"))
    stream = streams.Stream.from_config(cfg)
    got = readers.open_split(stream, stream.name, "train")
    assert len(got) == 59 and np.array_equal(got[0]["tokens"], docs[0])

    few = micro_config(data=dict(source="dolma", paths=f"{tmp_path}/small-0[01].npy", token_dtype="uint16"))
    stream = streams.Stream.from_config(few)
    with pytest.raises(ConfigError, match=r"small-00.npy, .*small-01.npy hold 14 documents: holding out one of "
                                          r"every 50 \(data.validation_fraction=0.02\) leaves the validation split "
                                          r"empty"):  # fmt: skip
        readers.open_split(stream, stream.name, "validation")


def test_a_bad_row_under_beams_workers_is_our_sentence_alone(tmp_path):
    """prepare_data.py --workers 2 on a chat corpus with a bad row: its sentence, and nothing of Beam's logging
    or its workers' tracebacks."""
    pytest.importorskip("apache_beam", reason="the beam extra is not installed: pip install -e '.[beam]'")
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(20)]  # fmt: skip
    rows[6] = {"text": "no messages here"}
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = micro_config(data=dict(source="text_files", format="chat", name="bad_rows",
                                 paths=str(tmp_path / "chat.jsonl"), data_dir=str(tmp_path / "tfds")))  # fmt: skip
    done = subprocess.run([sys.executable, "scripts/prepare_data.py", *cli_args(cfg), "--workers=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode != 0
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len([line for line in said if "line 7 of" in line and "has neither a messages list" in line]) == 1, said
    assert not [line for line in said if "Traceback" in line or "INFO" in line or "WARNING" in line], said[:20]


def test_a_relative_data_dir_not_made_yet_is_prepared_into(tmp_path):
    """data.data_dir=tfds (relative, not there yet): preparing walked up from the build folder to the first
    folder that exists, and a relative path's walk never ended."""
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": f"note {i}"}) + "\n" for i in range(400)))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1] + '/tests'); import conftest; "
        "from trainer.data import corpora; "
        "corpora.prepare(conftest.micro_config(data=dict(source='text_files', name='notes', "
        "paths='notes.jsonl', data_dir='tfds')).data)"
    )
    done = subprocess.run([sys.executable, "-c", code, REPO], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    made = tmp_path / "tfds" / "text_files" / "notes" / "1.0.0"
    assert (made / "dataset_info.json").exists()
    # every file as readable as the user's umask makes any other (a team's shared corpus), shards too
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in made.iterdir()}
    assert set(modes.values()) == {oct((made / "dataset_info.json").stat().st_mode & 0o777)}, modes
