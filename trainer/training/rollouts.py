"""Reinforcement learning's batches (data.format=prompts): completions sampled from the policy being trained,
on its own mesh and weights, rewarded, and laid out for the GRPO step (trainer/objectives/grpo.py).

Rollout k takes the prompts k x P onwards of the shuffled split (trainer/data/prompts.py; P =
train.global_batch_size / rl.group_size) and samples rl.group_size completions of each with the KV-cache
sampler (trainer/model/sampling.py): row r of the batch is completion r mod G of prompt r div G. Each row
draws from a key of its own, made from the seed, the prompt's place in the stream and the completion's
number, so a prompt gives the same completions alone or among others, on any mesh, and a resumed run the
same as one never stopped. A completion ends at the first end-of-turn token (trainer/data/chat.py
end_of_turn_ids), which it keeps; one that reaches rl.max_new_tokens without it is truncated.

The trainer then recomputes each completion token's log-probability (old_logps: the ratio's denominator)
with the training step's own forward pass, and the reference's where rl.beta > 0; the sampler's are kept
beside, and their difference logged (`rl/logp_diff_mean`, `rl/logp_diff_max`). A rollout serves
rl.updates_per_batch steps; its state is the number of rollouts taken, so a checkpoint at a rollout's end
resumes exactly (checkpoint.every_steps is a multiple of rl.updates_per_batch; a preemption mid-rollout
resumes at the next rollout, its remaining updates not taken).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from parallelism.distributed import fetch, whole
from trainer.data import chat, prompts
from trainer.data.streams import to_global
from trainer.data.tokenizers import load_tokenizer
from trainer.model.sampling import make_generate
from trainer.objectives import grpo, rewards

_TAG = 0x524C  # rollouts' keys are folded from the seed with this, apart from dropout's
HELD_OUT_TAG = 0x484F  # the held-out prompts' sampled completions': apart from the rollouts' keys
# rl/reward_smoothed: an exponential moving average of the rollouts' mean rewards over about ten rollouts (one
# rollout's mean is noisy: a few prompts), divided by 1 - SMOOTHING^n as Adam's moments are, so it is not pulled
# towards 0 at the start.
SMOOTHING = 0.9


def row_keys(seed: int, first: int, count: int, group: int, tag: int = _TAG) -> jax.Array:
    """The sampling keys of `count` prompts from stream place `first` on, `group` completions each."""
    base = jax.random.fold_in(jax.random.key(seed), tag)
    return jnp.stack([jax.random.fold_in(jax.random.fold_in(base, first + j), g)
                      for j in range(count) for g in range(group)])  # fmt: skip


def completion_ends(tokens: np.ndarray, end_ids: set[int]) -> np.ndarray:
    """Each row's completion length: through its first end-of-turn token, else the whole row."""
    ended = np.isin(tokens, list(end_ids))
    return np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1])


def layout(prompt_tokens: list[np.ndarray], completions: np.ndarray, lengths: np.ndarray, seq_len: int) -> dict:
    """Rows of prompt then completion (the first lengths[r] of its tokens), padded to seq_len; `loss_mask` on
    the completion's tokens."""
    rows = len(prompt_tokens)
    out = {k: np.zeros((rows, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    for r, (p, n) in enumerate(zip(prompt_tokens, lengths, strict=True)):
        end = len(p) + n
        out["tokens"][r, : len(p)], out["tokens"][r, len(p) : end] = p, completions[r, :n]
        out["positions"][r, :end], out["segment_ids"][r, :end] = np.arange(end), 1
        out["loss_mask"][r, len(p) : end] = 1
    return out


def padded(tokens: list[np.ndarray], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts as the sampler takes them: (rows, width) int32, each from column 0, and their lengths (1 for a
    row with no prompt, as at the end of a held-out split)."""
    prompt, lengths = np.zeros((rows, width), np.int32), np.ones(rows, np.int32)
    for r, p in enumerate(tokens):
        prompt[r, : len(p)], lengths[r] = p, len(p)
    return prompt, lengths


class Judge:
    """Completions rewarded as rl.reward says."""

    def __init__(self, cfg):
        self.rewards = rewards.load(cfg.rl)
        self.tokenizer = load_tokenizer(cfg.data)
        self.end_ids = chat.end_of_turn_ids(self.tokenizer, chat.template_for(cfg.data, self.tokenizer))
        self.weights = np.array([r.weight for r in self.rewards])

    def ends(self, out: np.ndarray) -> np.ndarray:
        return completion_ends(out, self.end_ids)

    def scores(self, out: np.ndarray, ends: np.ndarray, asked: list) -> np.ndarray:
        """(completions, rewards): completion r (its first ends[r] tokens) of prompt asked[r], each reward."""
        found = np.zeros((len(asked), len(self.rewards)), np.float64)
        for r, p in enumerate(asked):
            text = self.tokenizer.decode([int(t) for t in out[r, : ends[r]] if int(t) not in self.end_ids])
            where = f"{p.where} (its completion {text!r})"
            found[r] = rewards.score(self.rewards, p.prompt, text, p.answer, where)
        return found


class Rollouts:
    """The loop's batches under data.format=prompts: next() -> (rows, this process's part of the batch)."""

    def __init__(self, setup, stream, rows: list[int], current, reference):
        """`current()`: (the policy's weights as the model applies them, the weights of its reference or None)
        now; `reference`: whether rl.beta asks for the reference's log-probabilities."""
        cfg = setup.cfg
        self.cfg, self.rl, self.setup, self.rows, self.current = cfg, cfg.rl, setup, rows, current
        self.group, self.size = cfg.rl.group_size, cfg.train.global_batch_size
        self.prompts = prompts.rows(stream, cfg.data.train_split, shuffle=True)
        self.mixture = stream.mixture
        self.judge = Judge(cfg)
        rl = cfg.rl
        self.generate = make_generate(setup.spec, setup.shard, max_new_tokens=rl.max_new_tokens,
                                      temperature=rl.temperature, top_p=rl.top_p, with_logprobs=True,
                                      split_batch=True)  # fmt: skip
        self.score = make_scorer(setup, cfg.rl.temperature)
        self.with_reference = reference
        self.taken, self.served, self.batch = 0, 0, None
        self.metrics: dict[int, dict] = {}  # by rollout
        self.smoothed = [0.0, 0]  # the rollouts' mean rewards' moving average, unnormalised, and how many it holds

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        if self.batch is None or self.served == self.rl.updates_per_batch:
            self.batch, self.served = self.rollout(self.taken), 0
            self.taken += 1
        self.served += 1
        fresh = np.full((len(self.rows), self.cfg.data.seq_len), float(self.served == 1), np.float32)
        return self.size, {**{k: v[self.rows] for k, v in self.batch.items()}, "fresh": fresh}

    def rollout(self, k: int) -> dict[str, np.ndarray]:
        """Rollout k's whole batch (every process makes the same), its figures kept in `metrics[k]`."""
        cfg, rl, count = self.cfg, self.rl, self.size // self.group
        weights, reference = self.current()
        asked = [p for p in prompts.batch(self.prompts, k, count) for _ in range(self.group)]  # a row each
        prompt, lengths = padded([p.tokens for p in asked], self.size, cfg.data.seq_len - rl.max_new_tokens)
        start = time.perf_counter()
        keys = row_keys(cfg.train.seed, k * count, count, self.group)
        out, sampled = whole(self.generate(weights, prompt, 0, lengths, keys))
        sample_seconds = time.perf_counter() - start
        judge = self.judge
        ends = judge.ends(out)
        out = np.where(np.arange(out.shape[1]) < ends[:, None], out, judge.tokenizer.pad_id)
        batch = layout([p.tokens for p in asked], out, ends, cfg.data.seq_len)
        scores = judge.scores(out, ends, asked)
        total = scores @ judge.weights
        advantages = grpo.advantages(total, self.group, rl.loss)
        start = time.perf_counter()
        # Every process holds the whole rollout; each places its own rows of it.
        placed = to_global({n: v[self.rows] for n, v in batch.items()}, self.setup.batch_sharding, self.size)
        batch["old_logps"] = fetch(self.score(weights, placed)) * batch["loss_mask"]
        if self.with_reference:
            batch["ref_logps"] = fetch(self.score(reference, placed)) * batch["loss_mask"]
        score_seconds = time.perf_counter() - start
        batch["advantages"] = np.repeat(advantages[:, None], cfg.data.seq_len, axis=1).astype(np.float32)
        mask = batch["loss_mask"].astype(bool)
        by_row = np.zeros_like(batch["old_logps"])
        for r in range(self.size):  # the sampler's, laid out by token as the trainer's are
            by_row[r, lengths[r] : lengths[r] + ends[r]] = sampled[r, : ends[r]]
        gap = np.abs(by_row - batch["old_logps"])[mask]
        self.smoothed = [SMOOTHING * self.smoothed[0] + (1 - SMOOTHING) * float(total.mean()), self.smoothed[1] + 1]
        figures = {"rl/reward": float(total.mean()), "rl/reward_std": float(total.std()),
                   "rl/reward_smoothed": self.smoothed[0] / (1 - SMOOTHING ** self.smoothed[1]),
                   "rl/completion_length": float(ends.mean()),
                   "rl/truncated": float(np.mean(~np.isin(out[np.arange(self.size), ends - 1], list(judge.end_ids)))),
                   "rl/logp_diff_mean": float(gap.mean()), "rl/logp_diff_max": float(gap.max()),
                   "rl/sample_seconds": sample_seconds, "rl/score_seconds": score_seconds}  # fmt: skip
        for name, _ in self.mixture:  # each corpus's share of the prompts, as a text mixture logs its shares
            figures[f"mixture/{name}"] = sum(p.corpus == name for p in asked) / len(asked)
        for j, r in enumerate(judge.rewards):
            figures[f"rl/reward/{r.name}"] = float(scores[:, j].mean())
            figures[f"rl/reward/{r.name}_std"] = float(scores[:, j].std())
            if r.name == "exact":
                figures["rl/solved"] = float(scores[:, j].mean())
        self.metrics = {**{i: m for i, m in self.metrics.items() if i > k - 4}, k: figures}
        return batch

    def figures(self, step: int) -> dict:
        """The figures of the rollout that step `step` (counted from 1) trained on, if still kept."""
        return self.metrics.get((step - 1) // self.rl.updates_per_batch, {})

    def get_state(self) -> dict:
        return {"rows": {"0": {"rollouts": self.taken, "reward_smoothed": self.smoothed}}}

    def set_state(self, state: dict) -> None:
        saved = state["rows"]["0"]
        self.taken, self.batch = int(saved["rollouts"]), None
        self.smoothed = list(saved.get("reward_smoothed", [0.0, 0]))  # a checkpoint from before it was kept: anew

    def close(self) -> None:
        pass


def make_scorer(setup, temperature: float):
    """A jitted (weights, batch) -> each token's log-probability after its prefix (batch, seq; 0 at a row's
    first), by the training step's forward pass at the sampling temperature."""
    model = setup.model

    def score(weights, batch):
        logps = model.apply(weights, batch["tokens"], batch["positions"], batch["segment_ids"], None, temperature,
                            method="target_logprobs")[0]  # fmt: skip
        return jnp.pad(logps[:, :-1], ((0, 0), (1, 0)))

    return jax.jit(score, out_shardings=setup.shard.replicated())


class HeldOut:
    """Evaluation under data.format=prompts (the loop's, and eval.py's): one greedy completion of each of the
    held-out split's first `batches` x P prompts (P prompts a batch, in order; all of them for 0), rewarded
    as training rewards them: `eval_reward` (their weighted sum's mean), `eval_solved` (the exact reward's
    mean, where rl.reward has it) and `eval_prompts`. Beside them, what training optimises on those prompts:
    rl.group_size completions of each sampled as a rollout samples them (rl.temperature, rl.top_p; keys from
    the seed and the prompt's place, apart from the rollouts'), `eval_reward_sampled` and
    `eval_solved_sampled` their means."""

    def __init__(self, setup, stream, batches: int):
        cfg = setup.cfg
        self.cfg, self.count = cfg, cfg.train.global_batch_size // cfg.rl.group_size
        self.prompts = prompts.rows(stream, cfg.data.eval_split, shuffle=False)
        self.total = min(len(self.prompts), batches * self.count) if batches else len(self.prompts)
        self.judge = Judge(cfg)
        rl = cfg.rl
        self.generate = make_generate(setup.spec, setup.shard, max_new_tokens=rl.max_new_tokens)
        self.sample = make_generate(setup.spec, setup.shard, max_new_tokens=rl.max_new_tokens,
                                    temperature=rl.temperature, top_p=rl.top_p, split_batch=True)  # fmt: skip

    def __call__(self, weights, progress=lambda: None) -> dict:
        cfg, group = self.cfg, self.cfg.rl.group_size
        width, found, sampled = cfg.data.seq_len - cfg.rl.max_new_tokens, [], []
        for first in range(0, self.total, self.count):
            asked = [self.prompts[i] for i in range(first, min(first + self.count, self.total))]
            prompt, lengths = padded([p.tokens for p in asked], self.count, width)
            out = fetch(self.generate(weights, prompt, 0, lengths))
            found.append(self.judge.scores(out, self.judge.ends(out), asked))
            rows = [p for p in asked for _ in range(group)]  # as a rollout's batch: group_size rows a prompt
            prompt, lengths = padded([p.tokens for p in rows], self.count * group, width)
            keys = row_keys(cfg.train.seed, first, self.count, group, HELD_OUT_TAG)
            out = whole(self.sample(weights, prompt, 0, lengths, keys))[: len(rows)]
            sampled.append(self.judge.scores(out, self.judge.ends(out), rows))
            progress()
        result = {"eval_prompts": float(sum(len(f) for f in found))}
        names = [r.name for r in self.judge.rewards]
        for suffix, scores in (("", np.concatenate(found)), ("_sampled", np.concatenate(sampled))):
            result[f"eval_reward{suffix}"] = float((scores @ self.judge.weights).mean())
            if "exact" in names:
                result[f"eval_solved{suffix}"] = float(scores[:, names.index("exact")].mean())
        return result
