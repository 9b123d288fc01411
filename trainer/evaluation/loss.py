"""Validation loss: during training on fixed batches, and of a saved checkpoint on a whole split.

During training the same `train.eval_batches` batches (global batches of the
eval split, the first ones, unshuffled, computed in the training step's
microbatches) are used at every evaluation, so successive numbers compare
like with like. `unigram_loss` is the entropy of the target tokens in those
batches: the loss of the best model that ignores context, the bar any language
model must clear. These batches are the openings of the first held-out
documents (licence headers, docstrings), so they read harder than the average.

`evaluate_checkpoint` restores parameters only, on any mesh, and reads the
whole eval split once: loss (nats per token), perplexity, and bits per byte
(total nats / ln 2 / UTF-8 bytes of the predicted tokens), which compares
models with different tokenizers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import time
from collections.abc import Callable

import jax
import numpy as np

from parallelism.distributed import fetch, max_over_processes
from trainer.config.errors import ConfigError
from trainer.data import corpora, held_out, prompts, run_tokenizer, streams
from trainer.data.tokenizers import load_tokenizer
from trainer.objectives import dpo
from trainer.objectives.language_model import target_weights
from trainer.storage import workdir as wd
from trainer.storage.checkpoint import Checkpointer
from trainer.storage.workdir import path, write_file
from trainer.training import rollouts
from trainer.training.resume import load_params
from trainer.training.setup import Setup
from trainer.training.step import BATCH_NAMES, batch_keys, jit_eval_step, make_eval_step


def eval_step(setup: Setup):
    """The jitted (params, global batch) -> (loss sum, token count), in the training step's microbatches."""
    step = make_eval_step(setup.inference_model, setup.shard, setup.cfg.train.grad_accum_steps)
    weights = jax.tree.map(lambda a: a.sharding, setup.abstract_params())
    return jit_eval_step(step, weights, setup.shard, batch_keys(setup.cfg, training=False))


def _dpo_step(setup: Setup):
    """The jitted (params, global batch, reference) -> (DPO loss sum, pairs, {metric: sum}) of held-out pairs."""
    shard = setup.shard

    def step(params, batch, reference):
        _, (loss, pairs, _, _, sums) = dpo.sums(setup.inference_model, params, reference, batch, setup.cfg.dpo)
        return loss, pairs, sums

    batch = {k: shard.named(BATCH_NAMES) for k in batch_keys(setup.cfg, training=False)}
    params = jax.tree.map(lambda a: a.sharding, setup.abstract_params())
    return jax.jit(step, in_shardings=(params, batch, params), out_shardings=shard.replicated())


def _targets(local: dict[str, np.ndarray]) -> np.ndarray:
    """The ids this process's rows of a batch are trained to predict."""
    targets, weights = (np.asarray(a) for a in target_weights(local["tokens"], local["segment_ids"],
                                                               local.get("loss_mask")))  # fmt: skip
    return targets[weights > 0]


def _sum_over_processes(value):
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(np.asarray(value)).sum(axis=0)


def evaluate(setup: Setup, step_fn, params, local_batches, token_bytes: np.ndarray | None = None,
             progress: Callable[[dict], None] | None = None, bos_id: int | None = None) -> dict:  # fmt: skip
    """Loss sum, token count, documents begun and batches over `local_batches` (this process's rows of each
    global batch), over all processes; with `token_bytes`, also the UTF-8 bytes of the predicted tokens.

    The pass ends with `local_batches`, or (held_out.one_pass) at the first batch before which every process's
    documents had ended, which every process reaches together; never at a batch with nothing to predict, which
    a conversation's long prompt can make. `progress` gets the sums so far after each batch.
    """
    sums = {"total": 0.0, "count": 0.0, "batches": 0, "bytes": 0, "documents": 0}
    for local in local_batches:
        if "ended" in local and max_over_processes(int(not local["ended"].all())) == 0:
            break
        s, n = fetch(step_fn(params, streams.to_global(local, setup.batch_sharding, setup.cfg.train.global_batch_size)))
        sums["total"] += float(s)
        sums["count"] += float(n)
        sums["batches"] += 1
        begun = local["documents"] if "documents" in local else streams.document_starts(local, bos_id)
        sums["documents"] += int(begun.sum())
        if token_bytes is not None:
            sums["bytes"] += int(token_bytes[_targets(local)].sum())
        if progress is not None:
            progress(sums)
    sums["bytes"], sums["documents"] = (int(x) for x in _sum_over_processes(np.array([sums["bytes"],
                                                                                      sums["documents"]])))  # fmt: skip
    return sums


class Evaluator:
    """The training loop's evaluation: the same `train.eval_batches` held-out batches every time.

    With a mixture, each corpus is evaluated on its own (`eval_loss/<corpus>`,
    `unigram_loss/<corpus>`), and `eval_loss` / `unigram_loss` are their means
    weighted by the mixture's weights: with data.mixture_unit=tokens, the loss per
    token of held-out text mixed as training mixes it; with `documents`, the
    weights as they were given (shares of documents).
    """

    def __init__(self, setup: Setup, rows: list[int], inputs: tuple = ()):
        """`inputs`: the train step's after the batch (DPO's reference weights, or the frozen base its
        reference is under model.lora: its held-out pairs are scored by the DPO loss, reward accuracy and
        margins). It is called with the weights the model applies (Setup.weights)."""
        cfg = setup.cfg
        stream = streams.Stream.from_config(cfg, rows=cfg.train.global_batch_size)
        self._inputs = inputs
        self._sources, begun = {}, 0
        bos = None if cfg.data.source == "synthetic" else load_tokenizer(cfg.data).bos_id
        for name, source in stream.sources().items():
            batches = iter(streams.batches(source, cfg.data.eval_split, rows, shuffle=False))
            batches = list(itertools.islice(batches, cfg.train.eval_batches))
            counts = self._target_counts(setup, batches)
            if not counts.sum():
                what = f"the first train.eval_batches={cfg.train.eval_batches} held-out batches"
                raise ConfigError(
                    f"{what}{f' of {name}' if name else ''} scored nothing{_scored(cfg)}; raise train.eval_batches, "
                    "or set train.eval_every=0 and evaluate with eval.py."
                )
            self._sources[name] = (batches, _entropy(counts))
            begun += sum(int(streams.document_starts(b, bos).sum()) for b in batches)
        self.documents = int(_sum_over_processes(np.array(begun)))  # begun in these batches, on every process
        total = sum(w for _, w in stream.mixture)
        self._weights = {name: w / total for name, w in stream.mixture} or {"": 1.0}
        self._setup = setup
        # Compiled now, with the train step: not in the middle of the run, where a hang watch would wait on it.
        step = _dpo_step(setup) if setup.preference else eval_step(setup)
        weights = setup.abstract_params()
        self._step = step.lower(weights, setup.abstract_batch(training=False),
                                *((weights,) if setup.preference else ())).compile()  # fmt: skip
        # An online teacher is scored once on the same batches: the loss its student is measured against.
        teacher = setup.teacher
        self._teacher_step = (None if teacher is None else eval_step(teacher).lower(
            teacher.abstract_params(), setup.abstract_batch(training=False)).compile())  # fmt: skip
        self._teacher_loss: float | None = None

    def covers(self, result: dict) -> str:
        """What the loss of a `result` was measured on, and where the whole split's is: the console says it
        beside the number, so that it is never taken for eval.py's."""
        batches = self._setup.cfg.train.eval_batches
        return (f"the first {batches} held-out batch{'es' * (batches > 1)}: {int(result['eval_tokens']):,} tokens, "
                f"{self.documents:,} documents begun; eval.py scores the whole split")  # fmt: skip

    def __call__(self, params, progress: Callable[[], None] | None = None) -> dict[str, float]:
        """`progress()` is called after every batch (the loop's hang watch)."""
        if self._setup.preference:
            return self._preference(params, progress)
        out = {"eval_loss": 0.0, "eval_tokens": 0.0, "unigram_loss": 0.0}
        for name, (batches, unigram) in self._sources.items():
            on_batch = None if progress is None else lambda _sums: progress()
            sums = evaluate(self._setup, self._step, params, batches, progress=on_batch)
            loss = sums["total"] / max(sums["count"], 1.0)
            out["eval_loss"] += self._weights[name] * loss
            out["unigram_loss"] += self._weights[name] * unigram
            out["eval_tokens"] += sums["count"]
            if name:
                out[f"eval_loss/{name}"], out[f"unigram_loss/{name}"] = loss, unigram
        if self._teacher_step is not None:
            if self._teacher_loss is None:
                teacher = 0.0
                for name, (batches, _) in self._sources.items():
                    sums = evaluate(self._setup, self._teacher_step, self._inputs[-1], batches)
                    teacher += self._weights[name] * sums["total"] / max(sums["count"], 1.0)
                self._teacher_loss = teacher
            out["eval_loss_teacher"] = self._teacher_loss
        return out

    def _preference(self, params, progress) -> dict[str, float]:
        totals = {}
        for batch in self._sources[""][0]:
            glob = streams.to_global(batch, self._setup.batch_sharding, self._setup.cfg.train.global_batch_size)
            loss, pairs, sums = fetch(self._step(params, glob, self._setup.reference(params, self._inputs)))
            for name, value in {"eval_loss": loss, "eval_pairs": pairs, **sums}.items():
                totals[name] = totals.get(name, 0.0) + float(value)
            if progress is not None:
                progress()
        pairs = max(totals["eval_pairs"], 1.0)
        return {"eval_loss": totals["eval_loss"] / pairs, "eval_pairs": totals["eval_pairs"],
                **{f"eval_dpo/{m}": totals[m] / pairs for m in dpo.METRICS}}  # fmt: skip

    @staticmethod
    def _target_counts(setup: Setup, batches) -> np.ndarray:
        """How often each id is a target in the eval batches, over all processes' rows."""
        size = setup.cfg.model.vocab_size
        return _sum_over_processes(sum((np.bincount(_targets(b), minlength=size) for b in batches), np.zeros(size)))


def _entropy(counts: np.ndarray) -> float:
    """The unigram loss: entropy (nats) of the targets counted."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _scored(cfg) -> str:
    """What the config scores, said beside a refusal of data that scored nothing."""
    if cfg.data.format == "chat" and cfg.data.loss_on != "all":
        return (f" (data.format=chat with data.loss_on={cfg.data.loss_on} scores replies only, and no reply token "
                "was in them)")  # fmt: skip
    return ""


def evaluate_checkpoint(cfg, workdir: str, step: int | None = None, max_batches: int = 0, devices=None,
                        say: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Loss, perplexity and bits per byte of a checkpoint on `data.eval_split`, once through, each process
    reading its own rows' documents (held_out.one_pass); process 0 says how far it has got every half minute,
    and at the end how many documents and tokens were read.

    `max_batches` > 0 stops early (and is required for a synthetic source).
    The result is also written to <workdir>/eval/, under a name that differs for every evaluation that
    differs in what was evaluated (record_name); where is said, and is the result's "file".
    """
    if cfg.data.format == "preference":
        raise ConfigError(
            "eval.py scores a language model's loss on text or conversations; a DPO run's held-out pairs are "
            "scored during training (eval_loss, eval_dpo/* in metrics.jsonl at each train.eval_every)."
        )
    cfg = run_tokenizer.settle(cfg, workdir)
    corpora.check_vocab(cfg)
    if cfg.data.format == "prompts":
        return _rewarded(cfg, workdir, step, max_batches, devices, say)
    if cfg.data.source != "synthetic":
        corpora.open_split(cfg.data, cfg.data.eval_split)
    elif not max_batches:
        raise ConfigError("a synthetic source has no end; pass a number of batches to evaluate.")
    setup, step, params = load_params(cfg, workdir, step, devices)
    B, T = cfg.train.global_batch_size, cfg.data.seq_len
    stream = streams.Stream.from_config(cfg, rows=B)
    rows = streams.process_rows(setup.batch_sharding, B, T)
    if cfg.data.source == "synthetic":
        local_batches = streams.batches(stream, cfg.data.eval_split, rows, shuffle=False)
    else:
        local_batches = held_out.one_pass(stream, cfg.data.eval_split, rows)
    if max_batches:
        local_batches = itertools.islice(local_batches, max_batches)
    tokenizer = load_tokenizer(cfg.data) if cfg.data.source != "synthetic" else None
    token_bytes = np.ones(cfg.model.vocab_size) if tokenizer is None else tokenizer.token_bytes()
    primary = jax.process_index() == 0
    if primary:
        say(f"evaluating step {step} on {cfg.data.eval_split}" + (f", {max_batches} batches" if max_batches else ""))
    sums = evaluate(setup, eval_step(setup), params, local_batches, token_bytes, _Progress(say) if primary else None,
                    None if tokenizer is None else tokenizer.bos_id)  # fmt: skip
    total, count, n_bytes = sums["total"], sums["count"], sums["bytes"]
    if not count:
        what = f"the first {max_batches} batches of the" if max_batches else "the whole"
        more = "; evaluate more batches (or all of them)" if max_batches else "; give a split with scored tokens"
        raise ConfigError(f"{what} {cfg.data.eval_split} split scored nothing: {sums['documents']:,} documents "
                          f"read{_scored(cfg)}{more}.")  # fmt: skip
    loss = total / count
    result = {
        "step": step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total / math.log(2) / max(n_bytes, 1),
        "tokens": int(count),
        "bytes": n_bytes,
        "documents": sums["documents"],
        "batches": sums["batches"],
        "split": cfg.data.eval_split,
        "mesh": dict(setup.mesh.shape),
        "evaluated": what_was_evaluated(cfg, workdir, step, max_batches),
    }
    result["file"] = str(path(workdir) / "eval" / record_name(result["evaluated"]))
    if primary:
        what = f"the first {max_batches} batches of" if max_batches else "the whole"
        say(f"read {sums['documents']:,} documents, {int(count):,} predicted tokens in {sums['batches']} batches: "
            f"loss {loss:.4f} on {what} {cfg.data.eval_split} split (training's eval_loss reads its first "
            f"train.eval_batches={cfg.train.eval_batches} batches only)")  # fmt: skip
        write_file(result["file"], json.dumps(result))
        say(f"wrote {result['file']}")
    return result


def eval_line(step: int, result: dict, covers: str = "") -> str:
    """The loop's console line for an evaluation: held-out loss (`covers`: what it read), DPO's pairs, or
    GRPO's rewarded prompts."""
    if "unigram_loss" in result:
        teacher = f"the teacher's {result['eval_loss_teacher']:.4f}, " if "eval_loss_teacher" in result else ""
        return (f"step {step:>6}  eval_loss {result['eval_loss']:.4f}  ({teacher}unigram "
                f"{result['unigram_loss']:.4f}; {covers})")  # fmt: skip
    if "eval_reward" in result:
        return f"step {step:>6}  eval {rewarded(result)} ({int(result['eval_prompts'])} held-out prompts)"
    return (f"step {step:>6}  eval DPO loss {result['eval_loss']:.4f}  reward accuracy "
            f"{result['eval_dpo/accuracy']:.3f}  margin {result['eval_dpo/margins']:.3f} "
            f"({int(result['eval_pairs'])} held-out pairs)")  # fmt: skip


def rewarded(result: dict) -> str:
    """GRPO's held-out figures in words: the greedy completions', then the sampled ones' (as rollouts sample)."""

    def words(suffix: str) -> str:
        solved = f", solved {result['eval_solved' + suffix]:.4f}" if "eval_solved" + suffix in result else ""
        return f"reward {result['eval_reward' + suffix]:.4f}{solved}"

    return f"{words('')} greedy; {words('_sampled')} sampled"


def _rewarded(cfg, workdir: str, step: int | None, max_batches: int, devices, say) -> dict:
    """A GRPO run's checkpoint (data.format=prompts): one greedy completion of each held-out prompt (the first
    `max_batches` batches' prompts, or all) and rl.group_size sampled ones, rewarded as training rewards them
    (trainer/training/rollouts.py HeldOut)."""
    corpora.open_split(cfg.data, cfg.data.eval_split)
    prompts.check_room(streams.Stream.from_config(cfg), cfg.data.eval_split, cfg.rl.max_new_tokens)
    setup, step, params = load_params(cfg, workdir, step, devices)
    result = {"step": step, **rollouts.HeldOut(setup, streams.Stream.from_config(cfg), max_batches)(params),
              "split": cfg.data.eval_split, "mesh": dict(setup.mesh.shape),
              "evaluated": what_was_evaluated(cfg, workdir, step, max_batches)}  # fmt: skip
    result["file"] = str(path(workdir) / "eval" / record_name(result["evaluated"]))
    if jax.process_index() == 0:
        say(f"step {step}: {rewarded(result)} over {int(result['eval_prompts'])} prompts of the "
            f"{cfg.data.eval_split} split (one greedy completion of each, and rl.group_size={cfg.rl.group_size} "
            f"sampled at rl.temperature={cfg.rl.temperature:g})")  # fmt: skip
        write_file(result["file"], json.dumps(result))
        say(f"wrote {result['file']}")
    return result


def what_was_evaluated(cfg, workdir: str, step: int, max_batches: int) -> dict:
    """Everything that decides an evaluation's figures but the mesh (which does not change them): the data
    and how it is cut into batches, how many batches, and which checkpoint (its step and when it was saved)."""
    ckpt = Checkpointer(wd.checkpoint_dir(workdir), read_only=True)
    try:
        committed = ckpt.committed_at(step)
    finally:
        ckpt.close()
    d = cfg.data
    return {
        "dataset": "+".join(map(str, d.mixture)) or d.name, "source": d.source, "paths": d.paths,
        "data_dir": d.data_dir, "split": d.eval_split, "tokenizer": d.tokenizer, "tokenizer_path": d.tokenizer_path,
        "seq_len": d.seq_len, "global_batch_size": cfg.train.global_batch_size, "batches": max_batches or "all",
        **({"processes": jax.process_count()} if max_batches else {}),  # which pieces fill the first K batches
        **({"format": d.format, "loss_on": d.loss_on} if d.format != "text" else {}),  # which tokens are scored
        "step": step, "checkpoint": f"{wd.checkpoint_dir(workdir)}/{step}", "committed_ns": committed,
        **({"average_last": cfg.checkpoint.average_last} if cfg.checkpoint.average_last > 1 else {}),
        **({"read_ema": True} if cfg.checkpoint.read_ema else {}),
    }  # fmt: skip


def record_name(evaluated: dict) -> str:
    """<split>_step<N>_<dataset>[_first<K>]_<hash of everything evaluated>.json: readable, and another for any
    evaluation that differs in what it evaluated (the same one again rewrites its own record)."""
    digest = hashlib.sha256(json.dumps(evaluated, sort_keys=True).encode()).hexdigest()[:10]
    dataset = re.sub(r"[^A-Za-z0-9.+-]", "-", evaluated["dataset"])
    first = f"_first{evaluated['batches']}" if evaluated["batches"] != "all" else ""
    return f"{evaluated['split']}_step{evaluated['step']}_{dataset}{first}_{digest}.json"


class _Progress:
    """Says, at most every `seconds`, how many batches and tokens an evaluation has read."""

    def __init__(self, say: Callable[[str], None], seconds: float = 30.0):
        self._say, self._seconds, self._last = say, seconds, time.monotonic()

    def __call__(self, sums: dict) -> None:
        if time.monotonic() - self._last >= self._seconds:
            self._last = time.monotonic()
            self._say(f"  {sums['batches']} batches, {int(sums['count']):,} tokens so far")
