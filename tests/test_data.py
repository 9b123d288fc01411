"""Tokenizers, the TFDS text-files builder, and the packed Grain batches."""

import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest
from conftest import REPO, micro_config

from trainer.config.errors import ConfigError
from trainer.data import corpora, readers, row_iterators, streams
from trainer.data.preparation import split as split_rule
from trainer.data.readers.store import FlatTokens, Tokens
from trainer.data.tokenizers import BOS_ID, EOS_ID, ByteTokenizer, SentencePieceTokenizer, train_sentencepiece
from trainer.data.workers import ProcessRows

SAMPLE = "def f(x):\n\treturn  x + 1  # ünïcode ✓ 🐍\n\n    pass\n"


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids.min() >= 3 and ids.max() < tok.vocab_size == 259
    assert len(ids) == len(SAMPLE.encode())
    assert tok.decode(ids) == SAMPLE


def test_sentencepiece_trained_locally_round_trips_code(tmp_path):
    json_dir = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    texts = [open(os.path.join(json_dir, f)).read() for f in sorted(os.listdir(json_dir)) if f.endswith(".py")]
    path = str(tmp_path / "spm.model")
    train_sentencepiece(texts, 400, path)
    tok = SentencePieceTokenizer(path)
    assert tok.vocab_size == 400
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE  # whitespace kept, unseen characters via byte fallback
    # 400 pieces = 256 byte fallbacks + specials + ~140 merges: still clearly shorter than bytes.
    assert len(tok.encode(texts[0])) < 0.8 * len(texts[0].encode())


def test_missing_sentencepiece_model_is_a_clear_error():
    cfg = micro_config(data=dict(tokenizer="sentencepiece", tokenizer_path="/nonexistent/x.model", source="text_files"))
    with pytest.raises(ConfigError, match="train_tokenizer.py"):
        corpora.check_vocab(cfg)


def _write_corpus(root):
    for i in range(200):
        (root / f"doc{i:03d}.txt").write_text(f"document {i}\n" * (i % 5 + 1))
    with open(root / "lines.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"json line {i}"}) + "\n")


def held_out(place: str, fraction: float) -> bool:
    """The split rule, written here apart from the code: a document's place ("file" for a file that is one
    document, else "file:row") is hashed with SHA-256; bytes 0-3 mod 1000 plus bytes 4-11 / 2^64 are its
    position in thousandths, held out below the fraction's."""
    digest = hashlib.sha256(place.encode()).digest()
    position = int.from_bytes(digest[:4], "big") % 1000 + int.from_bytes(digest[4:12], "big") / 2**64
    return position < 1000 * fraction  # in floats: a rounding could differ once in 2^50 documents


def test_text_files_builder_prepares_splits_by_document(tmp_path):
    (tmp_path / "corpus").mkdir()
    _write_corpus(tmp_path / "corpus")
    cfg = micro_config(
        data=dict(
            source="text_files",
            name="mine",
            paths=f"{tmp_path}/corpus/*.txt,{tmp_path}/corpus/*.jsonl",
            data_dir=str(tmp_path / "tfds"),
            validation_fraction=0.1,
        )
    )
    corpora.prepare(cfg.data)
    train, val = corpora.open_split(cfg.data, "train"), corpora.open_split(cfg.data, "validation")
    texts = {name: [split[i]["text"].decode() for i in range(len(split))]
             for name, split in (("train", train), ("validation", val))}  # fmt: skip
    places = {f"doc{i:03d}.txt": f"document {i}\n" * (i % 5 + 1) for i in range(200)}
    places.update({f"lines.jsonl:{i}": f"json line {i}" for i in range(5)})
    assert sorted(texts["validation"]) == sorted(t for p, t in places.items() if held_out(p, 0.1))
    assert sorted(texts["train"]) == sorted(t for p, t in places.items() if not held_out(p, 0.1))
    assert 0 < len(val) < 0.2 * len(places)
    stamp = os.path.getmtime(os.path.join(tmp_path, "tfds", "text_files", "mine"))
    corpora.prepare(cfg.data)  # already there: untouched
    assert os.path.getmtime(os.path.join(tmp_path, "tfds", "text_files", "mine")) == stamp
    with pytest.raises(ConfigError, match=r"holds out 0.1 of its documents for validation, and "
                                          r"data.validation_fraction=0.02 asks for another share; set "
                                          r"data.validation_fraction=0.1 to read it"):  # fmt: skip
        corpora.prepare(micro_config(data=dict(cfg.data, validation_fraction=0.02)).data)
    # Read as conversations with another fraction too (a quick-start corpus under sft_tiny): the format, which no
    # fraction fixes, is said first.
    with pytest.raises(ConfigError, match=r"was prepared with data.format=text, and this config reads it with "
                                          r"data.format=chat"):  # fmt: skip
        corpora.prepare(micro_config(data=dict(cfg.data, validation_fraction=0.02, format="chat")).data)


def test_three_shards_and_one_file_split_by_document_at_the_configured_fraction(tmp_path):
    """Three Parquet shards of 3,000 rows hold out within half a point of data.validation_fraction, row by
    row (not whole shards); a single JSON-lines file trains and validates; a corpus too small to hold out one
    document is refused, saying how many it has, with nothing written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "shards"
    corpus.mkdir()
    for shard in range(3):
        rows = [f"shard {shard} row {i}" for i in range(3000)]
        pq.write_table(pa.table({"text": rows}), corpus / f"part-{shard}.parquet")
    cfg = micro_config(data=dict(source="text_files", name="shards", paths=f"{corpus}/*.parquet",
                                 data_dir=str(tmp_path / "tfds"), validation_fraction=0.05))  # fmt: skip
    corpora.prepare(cfg.data)
    val = corpora.open_split(cfg.data, "validation")
    held = {val[i]["text"].decode() for i in range(len(val))}
    assert abs(len(held) / 9000 - 0.05) < 0.005
    assert held == {f"shard {s} row {i}" for s in range(3) for i in range(3000) if held_out(f"part-{s}.parquet:{i}",
                                                                                              0.05)}  # fmt: skip
    assert all(any(f"shard {s} " in t for t in held) for s in range(3))

    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(400)))
    single = micro_config(data=dict(source="text_files", name="one", paths=str(one), data_dir=str(tmp_path / "tfds")))
    corpora.prepare(single.data)
    sizes = [len(corpora.open_split(single.data, split)) for split in ("train", "validation")]
    assert sum(sizes) == 400 and sizes[1] == sum(held_out(f"one.jsonl:{i}", 0.02) for i in range(400)) > 0

    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3)))
    small = micro_config(data=dict(source="text_files", name="few", paths=str(few), data_dir=str(tmp_path / "tfds")))
    with pytest.raises(ConfigError, match=r"gives 3 documents, too few to hold out a share of 0.02 for validation "
                                          r"and train on the rest \(0 would be held out\); give more documents, or "
                                          r"raise data.validation_fraction"):  # fmt: skip
        corpora.prepare(small.data)
    assert not (tmp_path / "tfds" / "text_files" / "few").exists()


def test_parquet_and_compressed_json_lines_are_read_by_their_text_column(tmp_path):
    """FineWeb-style shards: Parquet with the text in `content`, and JSON lines gzip- and zstd-compressed;
    every row comes back as one document, whatever the file's format."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    written = set()
    for shard in range(40):  # enough files for ~2% of them to be held out
        rows = [f"parquet shard {shard} row {i} \u00e9" for i in range(3)]
        pq.write_table(pa.table({"id": list(range(3)), "content": rows}), corpus / f"part-{shard:03d}.parquet")
        written.update(rows)
    for shard, (suffix, opener) in enumerate([(".jsonl.gz", gzip.open), (".jsonl.zst", zstandard.open)] * 5):
        lines = [f"{suffix} {shard} line {i}" for i in range(4)]
        with opener(corpus / f"lines-{shard}{suffix}", "wt") as f:
            f.writelines(json.dumps({"content": t, "url": "x"}) + "\n" for t in lines)
        written.update(lines)
    cfg = micro_config(data=dict(source="text_files", name="shards", paths=f"{corpus}/*", text_key="content",
                                 data_dir=str(tmp_path / "tfds")))  # fmt: skip
    corpora.prepare(cfg.data)
    read = set()
    for split in ("train", "validation"):
        source = corpora.open_split(cfg.data, split)
        read.update(source[i]["text"].decode() for i in range(len(source)))
    assert read == written

    pq.write_table(pa.table({"body": ["x"]}), corpus / "other.parquet")
    other = micro_config(data=dict(source="text_files", name="other", paths=f"{corpus}/*", text_key="content",
                                   data_dir=str(tmp_path / "tfds")))  # fmt: skip
    with pytest.raises(ConfigError, match=r"other.parquet has no field 'content' \(it has body\); set data.text_key"):
        corpora.prepare(other.data)
    assert not os.path.exists(tmp_path / "tfds" / "text_files" / "other")


def test_text_files_errors(tmp_path):
    nothing = micro_config(data=dict(source="text_files", paths=f"{tmp_path}/none/*.txt", data_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="matches no files"):
        corpora.prepare(nothing.data)
    (tmp_path / "one.txt").write_text("x")
    one = micro_config(data=dict(source="text_files", paths=f"{tmp_path}/one.txt", data_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="gives 1 document, too few"):
        corpora.prepare(one.data)
    assert not os.path.exists(tmp_path / "text_files")
    unprepared = micro_config(data=dict(source="tfds", name="not_a_dataset", data_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="not prepared"):
        corpora.open_split(unprepared.data, "train")


def _cfg(corpus_dir, **train):
    return micro_config(
        data=dict(source="text_files", data_dir=corpus_dir, seq_len=64), train=dict(global_batch_size=4, **train)
    )


def _take(cfg, rows, n, shuffle=True, split="train"):
    it = iter(streams.batches(streams.Stream.from_config(cfg), split, rows, shuffle=shuffle))
    return [next(it) for _ in range(n)]


def test_windows_hold_whole_document_pieces_with_restarting_positions(corpus_dir):
    cfg = _cfg(corpus_dir)
    batches = _take(cfg, [0, 1, 2, 3], 6, shuffle=False)
    source = corpora.open_split(cfg.data, "train")
    tok = ByteTokenizer()
    for row in range(4):
        docs = [
            np.concatenate([[BOS_ID], tok.encode(source[i]["text"]), [EOS_ID]]).astype(np.int32).tobytes()
            for i in range(row, min(len(source), row + 4 * 40), 4)
        ]
        for b in batches:
            seg, pos, tokens = b["segment_ids"][row], b["positions"][row], b["tokens"][row]
            assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
            for s in np.unique(seg[seg > 0]):
                piece = tokens[seg == s]
                np.testing.assert_array_equal(pos[seg == s], np.arange(len(piece)))
                # Every segment is a contiguous piece of one of this row's own documents.
                assert any(_aligned_find(d, piece.tobytes()) for d in docs), (row, s)


def _aligned_find(haystack: bytes, needle: bytes) -> bool:
    start = haystack.find(needle)
    while start != -1:
        if start % 4 == 0:
            return True
        start = haystack.find(needle, start + 1)
    return False


@pytest.mark.parametrize("bos,eos", [(BOS_ID, EOS_ID), (1, 1)], ids=["own marks", "one mark (GPT-2's)"])
def test_each_document_is_counted_once_whatever_its_marks(bos, eos):
    """Documents packed into windows as the loader packs them, with a BOS and an EOS that may be one token
    (GPT-2's <|endoftext|>): document_starts finds each document once, including where a window begins with
    the lone end mark of the last window's document, or with a piece of one that has no mark."""
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    rng = np.random.default_rng(0)
    docs = [np.concatenate([[bos], rng.integers(3, 50, n), [eos]]).astype(np.int32) for n in rng.integers(0, 9, 300)]
    windows = ConcatThenSplitIterDataset(grain.MapDataset.source([{"tokens": d} for d in docs]).to_iter_dataset(),
                                         length_struct={"tokens": 5})  # fmt: skip
    batches = [row_iterators.stack_windows([w]) for w in windows]
    lone_end = sum(int(b["positions"][0, 0] == 0 and b["segment_ids"][0, 1] != b["segment_ids"][0, 0]
                       and b["tokens"][0, 0] == eos) for b in batches)  # fmt: skip
    assert lone_end > 0  # the hard case occurs
    assert sum(int(streams.document_starts(b, bos).sum()) for b in batches) == len(docs)


def test_order_is_fixed_by_the_seed(corpus_dir):
    a = _take(_cfg(corpus_dir), range(4), 3)
    b = _take(_cfg(corpus_dir), range(4), 3)
    c = _take(_cfg(corpus_dir, seed=1), range(4), 3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    assert not all(np.array_equal(x["tokens"], z["tokens"]) for x, z in zip(a, c, strict=True))


def test_each_process_reads_only_its_rows_and_they_add_up_to_the_global_batch(corpus_dir):
    cfg = _cfg(corpus_dir)
    whole = _take(cfg, [0, 1, 2, 3], 3)
    first, second = _take(cfg, [0, 1], 3), _take(cfg, [2, 3], 3)
    for w, f, s in zip(whole, first, second, strict=True):
        for key in w:
            np.testing.assert_array_equal(w[key], np.concatenate([f[key], s[key]]))


@pytest.mark.parametrize("source", ["text_files", "synthetic"])
def test_iterator_state_restores_the_exact_position(corpus_dir, source):
    """Also where no document is half-read (synthetic documents fill whole windows), which
    grain 0.2.18 gets wrong after the JSON round trip unless the pipeline mends the state."""
    cfg = _cfg(corpus_dir)
    cfg.data.source = source
    it = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(4), shuffle=True))
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    fresh = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(4), shuffle=True))
    fresh.set_state(json.loads(json.dumps(state)))  # survives the JSON round trip of a checkpoint
    for e in expected:
        got = next(fresh)
        for key in e:
            np.testing.assert_array_equal(e[key], got[key])


def test_synthetic_source_is_deterministic_and_in_vocabulary():
    cfg = micro_config()
    a, b = _take(cfg, range(8), 2), _take(cfg, range(8), 2)
    np.testing.assert_array_equal(a[1]["tokens"], b[1]["tokens"])
    assert a[0]["tokens"].shape == (8, cfg.data.seq_len)
    assert a[0]["tokens"].max() < cfg.model.vocab_size and np.all(a[0]["segment_ids"] == 1)


def test_stdlib_corpus_validation_is_held_out_by_document(corpus_dir):
    cfg = _cfg(corpus_dir)
    train, val = corpora.open_split(cfg.data, "train"), corpora.open_split(cfg.data, "validation")
    val_sources = {val[i]["source"] for i in range(len(val))}
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.04
    assert all(held_out(s.decode(), 0.02) for s in val_sources)  # a .py file is one document
    assert not any(train[i]["source"] in val_sources for i in range(0, len(train), 7))


@pytest.fixture(scope="module")
def mixture_config(corpus_dir, tmp_path_factory):
    """The stdlib corpus and a second one (400 short notes) in the same data_dir, mixed 3:1."""
    notes = tmp_path_factory.mktemp("notes")
    for i in range(400):
        (notes / f"note{i:03d}.txt").write_text(f"note {i}: " + "plain words, not code. " * (1 + i % 7))
    cfg = micro_config(data=dict(source="text_files", data_dir=corpus_dir, name="notes", paths=str(notes / "*.txt")))
    corpora.prepare(cfg.data)
    cfg.data.update(name="python_stdlib", paths="", mixture=("python_stdlib:3", "notes:1"))
    return cfg


def test_a_mixture_by_documents_draws_each_corpus_from_its_own_stream_and_resumes_exactly(mixture_config):
    """data.mixture_unit=documents, as runs drew before the unit existed: Grain's MapDataset.mix by weight."""
    # Windows long enough to hold several whole standard-library files per row.
    stream = dataclasses.replace(streams.Stream.from_config(mixture_config), seq_len=4096, mixture_unit="documents")
    it = iter(streams.batches(stream, "train", range(8), shuffle=True))
    batches = [next(it) for _ in range(40)]
    source = np.concatenate([b["source"] for b in batches], axis=1)
    starts = np.concatenate([b["tokens"] for b in batches], axis=1) == BOS_ID
    # Each row draws 3:1 by document, deterministically: three from the first corpus, then one from the second.
    drawn = [source[row][starts[row]].tolist() for row in range(8)]
    assert all(d == ([0, 0, 0, 1] * 8)[: len(d)] for d in drawn), drawn
    assert sum(len(d) for d in drawn) > 60

    # Each row's documents of a corpus are that corpus's own row stream, in order: the plain stream of
    # `notes` alone (same seed) begins with exactly the tokens the mixture's row took from it.
    tokens = np.concatenate([b["tokens"] for b in batches], axis=1)
    alone = iter(streams.batches(stream.sources()["notes"], "train", range(8), shuffle=True))
    plain = np.concatenate([next(alone)["tokens"] for _ in range(40)], axis=1)
    for row in range(8):
        taken = tokens[row][source[row] == 1]
        np.testing.assert_array_equal(taken, plain[row][: len(taken)])

    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    fresh = iter(streams.batches(stream, "train", range(8), shuffle=True))
    fresh.set_state(json.loads(json.dumps(state)))
    for e in expected:
        got = next(fresh)
        for key in e:
            np.testing.assert_array_equal(e[key], got[key])


@pytest.fixture(scope="module")
def long_and_short(tmp_path_factory):
    """Two corpora in one data_dir: 300 long documents (300-700 bytes) and 3,000 short ones (20-60 bytes)."""
    root = tmp_path_factory.mktemp("long_short")
    rng = np.random.default_rng(0)
    for name, count, (low, high) in (("long", 300, (300, 700)), ("short", 3000, (20, 60))):
        lines = ["".join(rng.choice(list("abcdefgh "), rng.integers(low, high))) for _ in range(count)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        cfg = micro_config(data=dict(source="text_files", name=name, paths=str(root / f"{name}.jsonl"),
                                     data_dir=str(root / "tfds")))  # fmt: skip
        corpora.prepare(cfg.data)
    return micro_config(data=dict(source="text_files", name="long", data_dir=str(root / "tfds"), seq_len=256,
                                  mixture=("long:1", "short:3")), train=dict(global_batch_size=8))  # fmt: skip


def _shares(batches, unit) -> np.ndarray:
    counts = sum(streams.mixture_counts(b, unit, 2, BOS_ID) for b in batches)
    return counts / counts.sum()


def test_a_token_weighted_mixture_gives_each_corpus_its_share_of_tokens_and_resumes_exactly(long_and_short):
    """Weights 1:3 over documents ~12 times longer in the first corpus: by tokens (the default) 300 steps of
    8 x 256 tokens hold 25% and 75% of them within a point; by documents the long corpus would take most."""
    stream = streams.Stream.from_config(long_and_short)
    it = iter(streams.batches(stream, "train", range(8), shuffle=True))
    batches = [next(it) for _ in range(300)]
    np.testing.assert_allclose(_shares(batches, "tokens"), [0.25, 0.75], atol=0.01)
    by_documents = dataclasses.replace(stream, mixture_unit="documents")
    other = iter(streams.batches(by_documents, "train", range(8), shuffle=True))
    drawn = [next(other) for _ in range(300)]
    assert _shares(drawn, "tokens")[0] > 0.8  # what the unit is for
    np.testing.assert_allclose(_shares(drawn, "documents"), [0.25, 0.75], atol=0.01)

    # Resumed mid-mixture from the checkpoint's JSON, by a process holding rows 4-7 alone: the same windows.
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(3)]
    fresh = iter(streams.batches(stream, "train", range(4, 8), shuffle=True))
    fresh.set_state(state)
    for e in expected:
        got = next(fresh)
        for key in e:
            np.testing.assert_array_equal(e[key][4:], got[key])
    for done in (fresh, it, other):  # closed parent by parent, as a run's end closes them (nothing raised)
        done.close()


def test_a_mixture_run_logs_its_shares_and_each_corpus_held_out_loss_and_resumes_bit_for_bit(mixture_config,
                                                                                              tmp_path):  # fmt: skip
    from test_resume import params_at

    from trainer.run.loop import train

    def cfg(steps):  # a constant schedule: a run stopped at step 2 trained at the rates of the one to 4
        return micro_config(data=dict(mixture_config.data), train=dict(steps=steps, log_every=steps, eval_every=4),
                            optim=dict(schedule="constant", warmup_steps=1), checkpoint={"every_steps": 2})  # fmt: skip

    workdir, resumed = tmp_path / "run", tmp_path / "resumed"
    train(cfg(4), str(workdir))
    train(cfg(2), str(resumed))
    train(cfg(4), str(resumed))
    for a, b in zip(jax.tree.leaves(params_at(cfg(4), str(workdir), 4)),
                    jax.tree.leaves(params_at(cfg(4), str(resumed), 4)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    cfg = cfg(4)
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    logged = next(r for r in records if "loss" in r)
    it = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(8), shuffle=True))
    counts = np.zeros(2)
    for _ in range(4):
        b = next(it)
        counts += np.bincount(b["source"][b["segment_ids"] > 0], minlength=2)
    assert logged["mixture/python_stdlib"] == pytest.approx(counts[0] / counts.sum())
    assert logged["mixture/notes"] == pytest.approx(counts[1] / counts.sum())
    evaluated = next(r for r in records if "eval_loss" in r)
    assert evaluated["eval_loss"] == pytest.approx(
        0.75 * evaluated["eval_loss/python_stdlib"] + 0.25 * evaluated["eval_loss/notes"]
    )
    assert evaluated["eval_loss/notes"] != evaluated["eval_loss/python_stdlib"]


def test_ids_past_16_bits_are_stored_whole_whatever_the_vocabulary_counts(tmp_path):
    """A Hugging Face tokenizer whose ids have gaps: 5 tokens, the largest id 70000. Its vocabulary is the ids'
    range (70001), not its count; the store's flat files hold 70000 as its records do (a width chosen from the
    count wrapped it to 4464); an id no store width holds is one sentence."""
    tokenizers = pytest.importorskip("tokenizers", reason="the hf extra is not installed")
    from trainer.data.readers.store import FlatWriter
    from trainer.data.tokenizers import load_tokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "near": 3, "far": 70000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "files").mkdir()
    for i in range(40):
        (tmp_path / "files" / f"{i}.txt").write_text(" ".join(["near", "far"][(i + j) % 2] for j in range(5)))
    cfg = micro_config(data=dict(source="text_files", data_dir=str(tmp_path / "tfds"), name="gaps", tokenized=True,
                                 paths=str(tmp_path / "files" / "*.txt"), tokenizer="hf",
                                 tokenizer_path=str(tmp_path / "tok")))  # fmt: skip
    assert load_tokenizer(cfg.data).vocab_size == 70001
    corpora.prepare(cfg.data)
    for split in ("train", "validation"):
        flat = readers.open_split(cfg.data, "gaps", split)
        assert isinstance(flat, FlatTokens)
        records = Tokens(readers.open_prepared(cfg.data, readers.tfds_name(cfg.data, "gaps"), split, raw=True))
        assert len(flat) == len(records) > 0
        for i in range(len(flat)):
            np.testing.assert_array_equal(flat[i]["tokens"], records[i]["tokens"])
            assert 70000 in flat[i]["tokens"].tolist()
    writer = FlatWriter(str(tmp_path / "bad.ids"))
    with pytest.raises(ConfigError, match=r"^the tokenizer gave id -1, which no token store holds \(ids are 0 to "
                                          r"2\^31 - 1\); check data.tokenizer_path.$"):  # fmt: skip
        writer.write(np.array([5, -1]))


def test_a_tokenised_cache_gives_the_same_batches_with_no_tokenizer_and_refuses_another_one(tmp_path, monkeypatch):
    corpus = tmp_path / "files"
    corpus.mkdir()
    for i in range(300):
        (corpus / f"f{i:03d}.py").write_text(f"def f{i}(x):\n    return x * {i}  # ünïcode\n" * (1 + i % 5))
    cfg = micro_config(data=dict(source="text_files", data_dir=str(tmp_path / "tfds"), name="files",
                                 paths=str(corpus / "*.py")))  # fmt: skip
    corpora.prepare(cfg.data)

    def first_batches(cfg, split, n=6):
        it = iter(streams.batches(streams.Stream.from_config(cfg), split, range(8), shuffle=split == "train"))
        return [next(it) for _ in range(n)]

    on_the_fly = {split: first_batches(cfg, split) for split in ("train", "validation")}
    before = streams.Stream.from_config(cfg).identity()
    cfg.data.tokenized = True
    corpora.prepare(cfg.data)
    assert os.path.isdir(tmp_path / "tfds" / "text_files" / "files-tokens" / "1.0.0")
    assert streams.Stream.from_config(cfg).identity() == before  # a run may resume with or without the cache

    def no_tokenizer(*_):
        raise AssertionError("the cache was read through a tokenizer")

    monkeypatch.setattr(streams, "load_tokenizer", no_tokenizer)
    for split, expected in on_the_fly.items():
        for e, got in zip(expected, first_batches(cfg, split), strict=True):
            for key in e:
                np.testing.assert_array_equal(e[key], got[key])
    monkeypatch.undo()
    store = tmp_path / "tfds" / "text_files" / "files-tokens" / "1.0.0"
    flat = {split: store / f"text_files-{split}.array_record-00000-of-00001.ids" for split in ("train", "validation")}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:  # each mapped shard holds a descriptor: the soft limit is raised to fit them and room beside
        readers.open_split(cfg.data, "files", "train")
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= len(os.listdir("/proc/self/fd")) + 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Under a hard limit too low for the store, one sentence (in a process of its own: a hard limit never rises).
    refused = subprocess.run(
        [sys.executable, "-c", "import resource; from trainer.data import readers; from conftest import micro_config; "
         "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
         f"readers.open_split(micro_config(data={dict(cfg.data)!r}).data, 'files', 'train')"],
        cwd=os.path.dirname(__file__), env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True,
    )  # fmt: skip
    assert "this process may open only 64 files (ulimit -Hn); raise that limit to at least" in refused.stderr
    for kind, split in ((FlatTokens, "train"), (FlatTokens, "validation"), (Tokens, "train"), (Tokens, "validation")):
        if kind is Tokens:  # a store prepared before the flat files: read from its records, the same documents
            for path in flat.values():
                path.unlink(missing_ok=True)
        ours = readers.open_split(cfg.data, "files", split)  # read by us (readers/store.py) and by TFDS
        theirs = readers.open_prepared(cfg.data, "text_files/files-tokens", split)
        assert isinstance(ours, kind) and len(ours) == len(theirs) > 0
        for i in range(len(theirs)):
            np.testing.assert_array_equal(ours[i]["tokens"], theirs[i]["tokens"])
            assert ours[i]["tokens"].dtype == np.int32
        if kind is FlatTokens and split == "validation":  # damaged flat files are said, with how to rebuild them
            data = flat[split].read_bytes()
            flat[split].write_bytes(data[:-20] + b"X" + data[-19:])  # another file's footer
            with pytest.raises(ConfigError, match=r"is damaged \(its footer says .* with mark b'XRNIDS01'"):
                readers.open_split(cfg.data, "files", split)
            flat[split].write_bytes(data[4:])  # cut short
            with pytest.raises(
                ConfigError,
                match=r"validation.array_record-00000-of-00001.ids is damaged \(.*\): move "
                r".*files-tokens/1.0.0 aside and run scripts/prepare_data.py with this config and --tokenize",
            ):
                readers.open_split(cfg.data, "files", split)
            flat[split].unlink()
            with pytest.raises(ConfigError, match="lacks text_files-validation.array_record-00000-of-00001.ids"):
                readers.open_split(cfg.data, "files", split)

    model = str(tmp_path / "spm.model")
    train_sentencepiece([p.read_text() for p in sorted(corpus.iterdir())[:100]], 300, model)
    cfg.data.update(tokenizer="sentencepiece", tokenizer_path=model)
    with pytest.raises(ConfigError, match="files-tokens/1.0.0 was made with tokenizer .*'byte'.* this config uses"):
        corpora.check_prepared(cfg.data, "train")


def test_worker_processes_read_the_same_rows_and_state_as_the_training_process(corpus_dir):
    """data.workers: rows read by two spawned processes, whole steps and a ramp's subset of rows, give
    the in-process iterator's windows and states; a state taken from them restores either kind."""
    cfg = _cfg(corpus_dir)
    stream = streams.Stream.from_config(cfg)
    rows = list(range(cfg.train.global_batch_size))
    local = iter(streams.batches(stream, "train", rows, shuffle=True))
    as_json = lambda state: json.loads(json.dumps(state))
    workers = ProcessRows(stream, "train", rows, local.get_state(), shuffle=True, workers=2)
    try:
        for asked in (rows, rows, [0, 2], rows, rows):
            expected, got = local.read(asked), workers.read(asked)
            for key in expected:
                np.testing.assert_array_equal(expected[key], got[key])
            assert as_json(workers.get_state()) == as_json(local.get_state())
    finally:
        workers.close()
    fresh = iter(streams.batches(stream, "train", rows, shuffle=True))
    fresh.set_state(json.loads(json.dumps(workers.get_state())))
    expected = local.read(rows)
    for key in expected:
        np.testing.assert_array_equal(expected[key], fresh.read(rows)[key])


def test_a_prepared_corpus_knows_what_it_was_made_from(tmp_path, capsys):
    """Other files or another text field under the same data.name are refused by name; the same files
    under another glob (or moved elsewhere) are the same corpus, for a new run and for a resume; a cache
    killed before its tokenizer was recorded is set aside and built again; a late JSON line without the
    text field is named with its line."""
    import shutil

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(150):
        (corpus / f"doc{i:03d}.jsonl").write_text(json.dumps({"text": f"doc {i}", "body": f"b {i}"}) + "\n")

    def config(paths, text_key="text", **data):
        data = {"source": "text_files", "name": "mine", "paths": paths, "text_key": text_key,
                "data_dir": str(tmp_path / "tfds"), **data}  # fmt: skip
        return micro_config(data=data)

    built = config(f"{corpus}/*.jsonl")
    corpora.prepare(built.data)
    stamp = os.path.getmtime(tmp_path / "tfds" / "text_files" / "mine" / "1.0.0" / "made_from.json")
    respelt = config(f"{corpus}/doc0*.jsonl,{corpus}/doc1*.jsonl")
    corpora.prepare(respelt.data)  # the same 150 files: accepted, nothing rebuilt
    moved = tmp_path / "elsewhere"
    shutil.copytree(corpus, moved)
    corpora.prepare(config(f"{moved}/*.jsonl").data)
    assert os.path.getmtime(tmp_path / "tfds" / "text_files" / "mine" / "1.0.0" / "made_from.json") == stamp
    assert streams.Stream.from_config(respelt).identity() == streams.Stream.from_config(built).identity()

    with pytest.raises(ConfigError, match=r"corpus 'mine' .* was made from other data than data.paths=.*doc00\*"
                                          r".*\(140 of its 150 files are not among the 10 selected\)"):  # fmt: skip
        corpora.prepare(config(f"{corpus}/doc00*.jsonl").data)
    (moved / "doc000.jsonl").write_text(json.dumps({"text": "edited", "body": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"1 of its 150 files are not among the 150 selected"):
        corpora.prepare(config(f"{moved}/*.jsonl").data)
    with pytest.raises(ConfigError, match=r"select \(its text was read from field 'text', not 'body'\); give this"):
        corpora.prepare(config(f"{corpus}/*.jsonl", text_key="body").data)

    tokens = config(f"{corpus}/*.jsonl", tokenized=True)
    corpora.prepare(tokens.data)
    cache = tmp_path / "tfds" / "text_files" / "mine-tokens" / "1.0.0"
    (cache / "made_with_tokenizer.json").unlink()  # killed after TFDS finished, before the record
    corpora.prepare(tokens.data)
    assert "was left unfinished; moved to" in capsys.readouterr().out
    assert (cache / "made_with_tokenizer.json").exists() and len(list(cache.parent.glob("1.0.0.interrupted-*"))) == 1
    corpora.check_prepared(tokens.data, "train")

    (corpus / "late.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"line 2 of .*late.jsonl has no field 'text'; fix or remove that line"):
        corpora.prepare(config(f"{corpus}/*.jsonl", name="late").data)


def test_a_corpus_prepared_before_the_split_rule_keeps_it_and_its_run_resumes(tmp_path):
    """A corpus as the trainer before data.validation_fraction left it (whole files held out, a made_from
    record without the rule): today's default config reads it unchanged and a run on it resumes bit for bit
    from a config.json that lacks the new keys; its tokenised cache, built now, holds out the same files; a
    share it cannot give is refused; an older mixture run's config reads as drawing by documents."""
    from test_resume import params_at

    from trainer.config.forms import from_dict
    from trainer.run.loop import train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(150):
        (corpus / f"f{i:03d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 4))
    files = [(str(corpus / f"f{i:03d}.py"), f"f{i:03d}.py") for i in range(150)]
    data_dir = str(tmp_path / "tfds")
    # Prepared under the rule of then, its record written as it was then (no rule in it).
    with pytest.MonkeyPatch.context() as m:
        m.setattr(split_rule, "settled_rule", lambda directories, fraction: split_rule.SPLIT_BY_FILE)
        corpora.prepare(micro_config(data=dict(source="text_files", name="old", paths=str(corpus / "*.py"),
                                               data_dir=data_dir)).data)  # fmt: skip
    made = os.path.join(data_dir, "text_files", "old", "1.0.0", split_rule.MADE_FROM_FILE)
    record = json.loads(open(made).read())
    del record["split"]
    with open(made, "w") as f:
        json.dump(record, f)
    stamp = os.path.getmtime(made)

    def cfg(steps, **data):
        return micro_config(data=dict(source="text_files", name="old", paths=str(corpus / "*.py"), data_dir=data_dir,
                                      **data),
                            train=dict(steps=steps, log_every=1), optim=dict(schedule="constant", warmup_steps=1),
                            checkpoint={"every_steps": 2})  # fmt: skip

    run, straight = tmp_path / "run", tmp_path / "straight"
    train(cfg(2), str(run))
    saved = json.loads((run / "config.json").read_text())
    for key in ("mixture_unit", "validation_fraction"):  # as the older trainer wrote it
        del saved["data"][key]
    (run / "config.json").write_text(json.dumps(saved))
    train(cfg(4), str(run))
    train(cfg(4), str(straight))
    assert os.path.getmtime(made) == stamp
    for a, b in zip(jax.tree.leaves(params_at(cfg(4), str(run), 4)),
                    jax.tree.leaves(params_at(cfg(4), str(straight), 4)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)

    def sources(data, split):  # each document's file, as TFDS decodes it (training reads the tokens alone)
        source = readers.open_prepared(data, readers.tfds_name(data, "old"), split)
        return sorted(source[i]["source"].decode() for i in range(len(source)))

    held = sorted(rel for _, rel in files if split_rule.is_validation(split_rule.SPLIT_BY_FILE, rel, None))
    assert sources(cfg(4).data, "validation") == held
    cached = cfg(4, tokenized=True)
    corpora.prepare(cached.data)
    assert sources(cached.data, "validation") == held
    with pytest.raises(ConfigError, match=r"corpus 'old' .* holds out 0.02 of its files for validation, and "
                                          r"data.validation_fraction=0.05 asks for another share"):  # fmt: skip
        corpora.prepare(cfg(4, validation_fraction=0.05).data)
    mixed = micro_config(data=dict(source="text_files", mixture=("a:1", "b:1")))
    older = json.loads(json.dumps(mixed.to_dict()))
    del older["data"]["mixture_unit"]
    assert from_dict(older).data.mixture_unit == "documents"
    assert streams.Stream.from_config(from_dict(older)).identity() != streams.Stream.from_config(mixed).identity()
