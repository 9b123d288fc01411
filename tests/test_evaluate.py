"""Evaluating a saved checkpoint: the same numbers on any mesh, over every held-out token once."""

import itertools
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cli_args, micro_config

from trainer.config.errors import ConfigError
from trainer.data import corpora, held_out, row_iterators, streams
from trainer.data.tokenizers import BOS_ID, EOS_ID, ByteTokenizer
from trainer.evaluation.loss import evaluate_checkpoint
from trainer.run.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_cfg(corpus_dir, **mesh):
    return micro_config(data=dict(source="text_files", data_dir=corpus_dir), mesh=mesh or dict(fsdp=8))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    workdir = str(tmp_path_factory.mktemp("eval") / "run")
    train(micro_config(data=dict(source="text_files", data_dir=corpus_dir), train=dict(steps=6)), workdir)
    return workdir


@pytest.mark.parametrize("mesh,n_devices", [(dict(fsdp=4, tensor=2), 8), (dict(data=2, fsdp=4), 8), (dict(fsdp=1), 1)])
def test_the_same_checkpoint_scores_the_same_on_any_mesh(trained, corpus_dir, mesh, n_devices):
    reference = evaluate_checkpoint(text_cfg(corpus_dir), trained, max_batches=4)
    other = evaluate_checkpoint(text_cfg(corpus_dir, **mesh), trained, max_batches=4, devices=jax.devices()[:n_devices])
    assert other["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert (other["tokens"], other["bytes"], other["step"]) == (reference["tokens"], reference["bytes"], 6)


def test_reported_figures_are_consistent_and_written(trained, corpus_dir):
    # Counted here from the batches themselves: targets are next tokens in the same document, and the text
    # they stand for is the bytes they decode to (end-of-document decodes to none); as many batches as it
    # takes for a document to end among them.
    tokens, text, ends, batches = 0, b"", 0, 0
    for b in held_out.one_pass(streams.Stream.from_config(text_cfg(corpus_dir)), "validation", range(8)):
        same = (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]) & (b["segment_ids"][:, 1:] > 0)
        targets = b["tokens"][:, 1:][same]
        tokens += targets.size
        ends += int((targets == EOS_ID).sum())
        text += bytes(int(t) - ByteTokenizer.offset for t in targets if t not in (BOS_ID, EOS_ID))
        batches += 1
        if ends:
            break
    result = evaluate_checkpoint(text_cfg(corpus_dir), trained, step=5, max_batches=batches)
    assert result["step"] == 5 and result["batches"] == batches
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert (result["tokens"], result["bytes"]) == (tokens, len(text))
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * tokens / math.log(2) / len(text))
    with open(result["file"]) as f:
        assert json.load(f) == result


def test_an_evaluation_never_overwrites_another(trained, corpus_dir, capsys):
    """Each evaluation that differs in what it evaluated (step, batches, the whole split) leaves its own record,
    saying what was evaluated; the same one again rewrites its own; the name differs for every field of it."""
    from trainer.evaluation.loss import record_name

    shutil.rmtree(os.path.join(trained, "eval"), ignore_errors=True)
    runs = [dict(step=5, max_batches=2), dict(step=5, max_batches=3), dict(step=6, max_batches=2)]
    results = []
    for kw in runs:
        results.append(evaluate_checkpoint(text_cfg(corpus_dir), trained, **kw))
        assert capsys.readouterr().out.splitlines()[-1] == f"wrote {results[-1]['file']}"
    assert evaluate_checkpoint(text_cfg(corpus_dir), trained, step=5, max_batches=2) == results[0]
    files = sorted(os.listdir(os.path.join(trained, "eval")))
    assert files == sorted(os.path.basename(r["file"]) for r in results) and len(files) == 3
    for kw, result in zip(runs, results, strict=True):
        with open(result["file"]) as f:
            record = json.load(f)
        assert record == result
        evaluated = record["evaluated"]
        assert (evaluated["step"], evaluated["batches"]) == (kw["step"], kw["max_batches"])
        assert record["evaluated"]["dataset"] == "python_stdlib" and record["evaluated"]["split"] == "validation"
        assert record["evaluated"]["checkpoint"].endswith(f"checkpoints/{kw['step']}")
    evaluated = results[0]["evaluated"]
    assert "_first2_" in record_name(evaluated) and "_first" not in record_name({**evaluated, "batches": "all"})
    others = [record_name({**evaluated, key: "other"}) for key in evaluated]
    assert len({record_name(evaluated), *others}) == len(evaluated) + 1


def todays_batches(stream, split, rows):
    """The reference: the batches of a whole-split evaluation before they were packed (issue 52): row r of B
    concatenates documents r, r+B, ... and Grain's ConcatThenSplit cuts them into windows; a row whose documents
    are done is padding, until every row's are."""
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    docs = streams.documents(stream, split, shuffle=False, endless=False)
    windows = {r: iter(ConcatThenSplitIterDataset(docs[r :: stream.rows].to_iter_dataset(),
                                                  length_struct={"tokens": stream.seq_len})) for r in rows}  # fmt: skip
    padding = {k: np.zeros(stream.seq_len, np.int32) for k in ("tokens", "tokens_segment_ids", "tokens_positions")}
    assert isinstance(docs, grain.MapDataset)
    while True:
        batch = [next(windows[r], None) for r in rows]
        if all(row is None for row in batch):
            return
        yield row_iterators.stack_windows([padding if row is None else row for row in batch])


def test_a_whole_split_fills_its_batches_and_scores_as_its_rows_did(tmp_path):
    """150 documents of 1 to 4,000 bytes (log-uniform), 30% held out, a checkpoint of 3 steps: eval.py's figures
    (loss to 1e-6, tokens, bytes and documents exactly) equal those of the rows' own windows, padded, as
    evaluation read them before (todays_batches), in far fewer batches, over 90% of whose slots hold a
    predicted token."""
    from trainer.evaluation.loss import eval_step, evaluate
    from trainer.training.resume import load_params

    rng = np.random.default_rng(0)
    for i, n in enumerate(np.exp(rng.uniform(0, np.log(4000), 150)).astype(int)):
        (tmp_path / f"doc{i:03d}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), n)))
    data = dict(source="text_files", name="varied", paths=str(tmp_path / "*.txt"), data_dir=str(tmp_path / "tfds"),
                validation_fraction=0.3)  # fmt: skip
    cfg = micro_config(data=data, train=dict(steps=3), checkpoint={"every_steps": 3})
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    packed = evaluate_checkpoint(cfg, workdir)
    setup, _, params = load_params(cfg, workdir)
    rows = todays_batches(streams.Stream.from_config(cfg), "validation", range(8))
    before = evaluate(setup, eval_step(setup), params, rows, ByteTokenizer().token_bytes(), bos_id=BOS_ID)
    assert packed["loss"] == pytest.approx(before["total"] / before["count"], rel=1e-6)
    assert (packed["tokens"], packed["bytes"], packed["documents"]) == (before["count"], before["bytes"],
                                                                        before["documents"])  # fmt: skip
    held_out = len(corpora.open_split(cfg.data, "validation"))
    assert packed["documents"] == held_out > 10
    assert packed["batches"] * 1.5 < before["batches"]  # measured: 135 against 223
    assert packed["tokens"] / (packed["batches"] * 8 * 32) > 0.9  # measured: 96%, against 51%


def test_one_pass_covers_every_held_out_token_exactly_once(corpus_dir):
    cfg = text_cfg(corpus_dir)
    source = corpora.open_split(cfg.data, "validation")
    tok = ByteTokenizer()
    expected = np.concatenate(
        [np.concatenate([[BOS_ID], tok.encode(source[i]["text"]), [EOS_ID]]) for i in range(len(source))]
    )
    stream = streams.Stream.from_config(cfg)
    passes = held_out.one_pass(stream, "validation", range(8))
    whole = list(itertools.takewhile(lambda b: b["segment_ids"].any(), passes))
    got = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in whole])
    assert len(got) == len(expected)
    np.testing.assert_array_equal(np.bincount(got, minlength=259), np.bincount(expected, minlength=259))
    assert sum(int(b["documents"].sum()) for b in whole) == len(source)
    # Two processes holding rows 0-3 and 4-7 read each its own rows' documents (r, r+8, ...) and together every
    # token once, each going on with padding once done.
    halves = []
    for rows in (range(4), range(4, 8)):
        mine = set(i for r in rows for i in range(r, len(source), 8))
        part = itertools.takewhile(lambda b: b["segment_ids"].any(), held_out.one_pass(stream, "validation", rows))
        halves.append(np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in part]))
        theirs = np.concatenate([[BOS_ID, *tok.encode(source[i]["text"]), EOS_ID] for i in sorted(mine)])
        np.testing.assert_array_equal(np.bincount(halves[-1], minlength=259), np.bincount(theirs, minlength=259))
    assert sum(map(len, halves)) == len(expected)


def test_eval_refuses_bad_steps_empty_workdirs_and_other_models(trained, corpus_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"no checkpoint at step 7; it has steps \[5, 6\]"):
        evaluate_checkpoint(text_cfg(corpus_dir), trained, step=7)
    with pytest.raises(ConfigError, match="holds no checkpoints"):
        evaluate_checkpoint(text_cfg(corpus_dir), str(tmp_path / "empty"))
    assert not (tmp_path / "empty").exists()
    other = text_cfg(corpus_dir)
    other.model.d_ff = 256
    with pytest.raises(ConfigError, match="model.d_ff=128 there, 256 here"):
        evaluate_checkpoint(other, trained)


@pytest.mark.slow  # four scripts launched, 17 s (2026-12-06): room for the suite's 10 minutes
def test_the_scripts_print_their_json(trained, corpus_dir):
    common = [*cli_args(micro_config(data=dict(source="text_files", data_dir=corpus_dir))), f"--workdir={trained}"]
    ev = subprocess.run([sys.executable, "scripts/eval.py", *common, "--max_batches=2"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert set(json.loads(ev.stdout.strip().splitlines()[-1])) >= {"step", "loss", "perplexity", "bits_per_byte"}
    gen = subprocess.run([sys.executable, "scripts/generate.py", *common, "--prompt=def f(", "--max_new_tokens=16",
                          "--temperature=0.8", "--top_k=20", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-2000:]
    line = json.loads(gen.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "def f(" and isinstance(line["completion"], str)
    # The run's own saved config, given back as --config (with an override on top): no --config.* flag
    # repeated, and its workdir is the default.
    again = subprocess.run([sys.executable, "scripts/eval.py", f"--config={trained}/config.json", "--max_batches=2",
                            "--config.train.eval_batches=3"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    last = [json.loads(run.stdout.strip().splitlines()[-1]) for run in (again, ev)]
    assert last[0]["loss"] == last[1]["loss"]


def test_a_one_file_parquet_corpus_and_a_one_file_zstd_json_lines_corpus_train_and_evaluate(tmp_path):
    """A user's own corpus as one file (400 documents): each is split by document, trains, and is evaluated
    over its whole held-out split, every document read once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = np.random.default_rng(0)
    texts = [f"def f{i}(x):\n    return x * {int(rng.integers(1000))}\n" * int(rng.integers(1, 4)) for i in range(400)]
    pq.write_table(pa.table({"id": list(range(400)), "content": texts}), tmp_path / "export.parquet")
    with zstandard.open(tmp_path / "dump.jsonl.zst", "wt") as f:
        f.writelines(json.dumps({"content": t}) + "\n" for t in texts)
    for name in ("export.parquet", "dump.jsonl.zst"):
        cfg = micro_config(data=dict(source="text_files", name=name.split(".")[0], paths=str(tmp_path / name),
                                     text_key="content", data_dir=str(tmp_path / "tfds")),
                           train=dict(steps=2))  # fmt: skip
        workdir = str(tmp_path / f"run-{name}")
        assert train(cfg, workdir)["step"] == 2
        result = evaluate_checkpoint(cfg, workdir)
        held = corpora.open_split(cfg.data, "validation")
        lengths = [len(held[i]["text"]) + 2 for i in range(len(held))]  # bytes, with BOS and EOS
        assert 0 < len(held) < 20 and result["documents"] == len(held)
        # Each document predicts all but its first token, less one per window boundary it crosses.
        windows = sum(lengths) // cfg.data.seq_len + cfg.train.global_batch_size
        assert sum(lengths) - len(held) - windows <= result["tokens"] <= sum(lengths) - len(held)
        assert math.isfinite(result["loss"]) and result["loss"] < math.log(cfg.model.vocab_size)


def long_prompts(tmp_path, **sections):
    """200 conversations, each a ~600-byte user turn and a short reply, read in windows of 128: most batches of
    the held-out split are all prompt, nothing in them scored (data.loss_on=assistant)."""
    rng = np.random.default_rng(0)
    with open(tmp_path / "long.jsonl", "w") as f:
        for i in range(200):
            prompt = "".join(rng.choice(list("abcdefgh "), 600))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": f"ok {i}"}]}) + "\n")  # fmt: skip
    data = dict(source="text_files", format="chat", loss_on="assistant", name="long_prompts",
                paths=str(tmp_path / "long.jsonl"), data_dir=str(tmp_path / "tfds"), validation_fraction=0.2,
                seq_len=128)  # fmt: skip
    cfg = micro_config(data=data, model=dict(max_seq_len=128), checkpoint={"every_steps": 2},
                       train=dict(steps=2, global_batch_size=8))  # fmt: skip
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


def test_a_held_out_split_whose_batches_are_often_all_prompt_is_scored_to_its_end(tmp_path):
    """Evaluation ends when the data runs out, never at a batch that scores nothing; a pass that scores nothing
    (here its first batch alone) is refused in one sentence, never reported as loss 0."""
    cfg = long_prompts(tmp_path)
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    result = evaluate_checkpoint(cfg, workdir)
    held = [json.loads(r["text"]) for r in corpora.open_split(cfg.data, "validation")]
    replies = sum(len(m["content"]) + 1 for row in held for m in row["messages"] if m["role"] == "assistant")
    assert result["documents"] == len(held) > 20
    # Every reply byte and end mark is predicted, but those that open a window (no context to predict from).
    assert 0.9 * replies <= result["tokens"] <= replies, (result["tokens"], replies)
    assert 0 < result["loss"] < 10
    with pytest.raises(ConfigError, match=r"scored nothing: .*loss_on=assistant"):
        evaluate_checkpoint(cfg, workdir, max_batches=1)


def test_training_refuses_held_out_batches_that_score_nothing_before_it_compiles(tmp_path):
    cfg = long_prompts(tmp_path, train=dict(steps=2, global_batch_size=8, eval_every=1, eval_batches=1))
    with pytest.raises(ConfigError, match=r"train.eval_batches=1 .* scored nothing"):
        train(cfg, str(tmp_path / "run"))


def test_the_mean_of_the_newest_checkpoints_is_what_evaluation_reads_where_asked(trained, corpus_dir):
    """checkpoint.average_last=2: load_params (eval.py, generate.py, the export) reads the mean of the weights
    of the run's checkpoints at steps 5 and 6, each read alone and averaged here; its evaluation is recorded
    apart from step 6's own; more than the run kept is one sentence."""
    from trainer.config.forms import with_changes
    from trainer.training.resume import load_params

    cfg = text_cfg(corpus_dir)
    alone = [jax.tree.map(np.asarray, load_params(cfg, trained, s)[2]) for s in (5, 6)]
    averaged = with_changes(cfg, {"checkpoint.average_last": 2})
    _, step, mean = load_params(averaged, trained)
    assert step == 6
    for m, a, b in zip(jax.tree.leaves(mean), *map(jax.tree.leaves, alone), strict=True):
        np.testing.assert_allclose(np.asarray(m), (a + b) / 2, rtol=1e-6, atol=1e-7)
    plain, mixed = (evaluate_checkpoint(c, trained, max_batches=2, say=lambda _: None) for c in (cfg, averaged))
    assert plain["file"] != mixed["file"] and plain["loss"] != mixed["loss"]
    with pytest.raises(ConfigError, match=r"^checkpoint.average_last=3: .* keeps 2 checkpoint\(s\) at or before step 6 "
                       r"\(\[5, 6\]\); average at most 2"):  # fmt: skip
        load_params(with_changes(cfg, {"checkpoint.average_last": 3}), trained)


def test_the_moving_average_of_the_weights_is_kept_sharded_and_read_where_asked(tmp_path, trained, corpus_dir):
    """optim.ema_half_life_tokens: the optimiser state keeps the bias-corrected moving average of the weights, each
    array placed like its parameter; checkpoint.read_ema makes load_params (eval.py, generate.py, the export)
    read it, equal to the average computed here from every checkpoint's weights read alone, and the same after a
    resume. A config that keeps
    none, both decays set, a decay of 1 and read_ema beside average_last are one sentence each."""
    from trainer.config.forms import with_changes
    from trainer.optim import averaging
    from trainer.planning import memory
    from trainer.training.resume import load_params
    from trainer.training.setup import build
    from trainer.training.validation import validate

    data, ckpt = dict(source="text_files", data_dir=corpus_dir), {"every_steps": 1, "keep": 4}
    cfg = micro_config(data=data, train=dict(steps=4), optim=dict(ema_half_life_tokens=8 * 32 * 2), checkpoint=ckpt)
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    decay = 0.5**0.5  # each update trains on 8 x 32 tokens: half the half-life
    weights = [jax.tree.map(np.asarray, load_params(cfg, workdir, s)[2]) for s in (1, 2, 3, 4)]
    reading = with_changes(cfg, {"checkpoint.read_ema": True})
    for n in (3, 4):
        shares = [(1 - decay) * decay ** (n - 1 - i) / (1 - decay**n) for i in range(n)]
        expected = jax.tree.map(lambda *w, s=shares: sum(a * x for a, x in zip(s, w, strict=True)), *weights[:n])
        _, step, ema = load_params(reading, workdir, n)
        assert step == n
        for got, want in zip(jax.tree.leaves(ema), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # A run stopped at step 2 and resumed keeps the same average.
    again = str(tmp_path / "again")
    train(with_changes(cfg, {"train.steps": 2}), again)
    train(cfg, again)
    for a, b in zip(jax.tree.leaves(load_params(reading, again)[2]), jax.tree.leaves(ema), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    setup = build(cfg)
    kept = averaging.find(setup.state_shardings.opt_state).ema_sum
    assert jax.tree.leaves(kept) == jax.tree.leaves(setup.state_shardings.params)
    state = memory.state_bytes(setup)
    assert state["average"] == state["params"] + 8 and state["optimizer"] > 3 * state["params"]  # + mass and decay
    last, averaged = (evaluate_checkpoint(c, workdir, max_batches=2, say=lambda _: None) for c in (cfg, reading))
    assert last["file"] != averaged["file"] and last["loss"] != averaged["loss"]

    with pytest.raises(ConfigError, match=r"^checkpoint.read_ema reads the moving average .* sets neither"):
        load_params(with_changes(text_cfg(corpus_dir), {"checkpoint.read_ema": True}), trained)
    for changes, said in [
        ({"optim.ema_decay": 0.9}, r"both set the moving average's decay; set one"),
        ({"optim.ema_half_life_tokens": 0, "optim.ema_decay": 1.0}, r"optim.ema_decay=1.0 must be"),
        ({"checkpoint.average_last": 2}, r"each choose the weights that are read; set one"),
    ]:
        with pytest.raises(ConfigError, match=said):
            validate(with_changes(reading, changes))
