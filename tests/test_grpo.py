"""GRPO (data.format=prompts): its loss and gradients against TRL's GRPOTrainer on the same completions, the
sampler's completions the same alone or batched and on 8 devices as on 1, a run that resumes exactly, and
bad settings refused in one sentence."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import micro_config

from trainer.config.errors import ConfigError
from trainer.interop.families import to_hf_tensors
from trainer.interop.huggingface import import_checkpoint, write_tokenizer
from trainer.model import adapters
from trainer.model.sampling import make_generate
from trainer.objectives import grpo
from trainer.run.loop import train
from trainer.training import rollouts
from trainer.training.resume import load_params
from trainer.training.setup import build

LLAMA = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10_000.0,
             tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Prompts asking for a word reversed, each with its answer."""
    folder, rng = tmp_path_factory.mktemp("prompts"), np.random.default_rng(0)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(120):
            w = "".join(rng.choice(list("abcdef"), 4))
            f.write(json.dumps({"prompt": f"Reverse: {w}", "answer": w[::-1]}) + "\n")
    return folder


def rl_config(rows, tmp_path, **sections):
    data = dict(source="text_files", format="prompts", name="grpo_prompts", paths=str(rows / "prompts.jsonl"),
                data_dir=str(tmp_path / "tfds"), validation_fraction=0.1, seq_len=48)  # fmt: skip
    train = dict(global_batch_size=8, log_every=1, eval_every=0)
    cfg = micro_config(data=data, model=dict(max_seq_len=64), optim=dict(clip_norm=0.0, weight_decay=0.0),
                       train=train, checkpoint=dict(every_steps=2))  # fmt: skip
    cfg.rl.update(group_size=4, max_new_tokens=10, reward="rl_rewards:variety", temperature=1.0)
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own call
@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_the_loss_and_its_gradients_equal_trls(tmp_path, loss):
    """The same completions (of several lengths), old and reference log-probabilities and advantages given to
    TRL's GRPOTrainer._compute_loss on a Llama (in fp32: TRL's default is bf16) and to ours on its import, at
    temperature 0.7 with the KL term: the loss and every weight's gradient agree. The advantages from rewards
    against TRL's own formula."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(str(tmp_path / "hf"))
    cfg = micro_config(model=dict(norm_eps=1e-5))
    write_tokenizer(cfg.data, str(tmp_path / "hf"))
    import_checkpoint(str(tmp_path / "hf"), cfg, str(tmp_path / "run"))
    setup, _, params = load_params(cfg, str(tmp_path / "run"))

    rng, group, prompt_len, new = np.random.default_rng(1), 4, 6, 7
    rewards = rng.integers(0, 3, 8).astype(np.float32)
    advantages = grpo.advantages(rewards, group, loss)
    r = torch.tensor(rewards).view(-1, group)
    theirs = (r - r.mean(1, keepdim=True)).view(-1)
    if loss == "grpo":
        theirs = theirs / (trl.trainer.utils.nanstd(r, dim=1).repeat_interleave(group) + 1e-4)
    np.testing.assert_allclose(advantages, theirs.numpy(), rtol=1e-6)

    prompt = rng.integers(3, 384, (8, prompt_len))
    completion = rng.integers(3, 384, (8, new))
    lengths = np.array([7, 3, 5, 1, 7, 6, 2, 4])
    mask = (np.arange(new) < lengths[:, None]).astype(np.int32)
    batch = rollouts.layout(list(prompt), completion, lengths, prompt_len + new + 3)
    current = np.asarray(jax.jit(rollouts.make_scorer(setup, 0.7))(params, batch))
    by_token = lambda x: np.concatenate([np.zeros((8, prompt_len)), x, np.zeros((8, 3))], axis=1)  # noqa: E731
    ours_of = lambda full: full[:, prompt_len : prompt_len + new]  # noqa: E731
    old = ours_of(current) + rng.normal(0, 0.3, (8, new))  # ratios of both sides of the clip
    ref = ours_of(current) + rng.normal(0, 0.3, (8, new))
    batch.update(old_logps=by_token(old * mask).astype(np.float32), ref_logps=by_token(ref * mask).astype(np.float32),
                 advantages=np.repeat(advantages[:, None], batch["tokens"].shape[1], 1))  # fmt: skip
    cfg.rl.update(temperature=0.7, beta=0.04, epsilon=0.2, loss=loss, max_new_tokens=new)

    def mean_loss(p):
        total, aux = grpo.sums(setup.model, p, batch, cfg.rl)
        return total / aux[1]

    our_loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", loss_type=loss, beta=0.04,
                          epsilon=0.2, temperature=0.7, num_generations=group, per_device_train_batch_size=group,
                          max_completion_length=new, use_cpu=True, save_strategy="no", bf16=False)  # fmt: skip
    dataset = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = dict(prompt_ids=torch.tensor(prompt), prompt_mask=torch.ones(8, prompt_len, dtype=torch.long),
                  completion_ids=torch.tensor(completion), completion_mask=torch.tensor(mask),
                  advantages=torch.tensor(advantages), old_per_token_logps=torch.tensor(old, dtype=torch.float32),
                  ref_per_token_logps=torch.tensor(ref, dtype=torch.float32),
                  num_items_in_batch=torch.tensor(mask.sum()))  # fmt: skip
    their_loss = trainer._compute_loss(trainer.model, inputs)
    their_loss.backward()
    assert float(our_loss) == pytest.approx(float(their_loss.detach()), rel=1e-5, abs=1e-6)
    ours = to_hf_tensors(jax.device_get(grads), setup.spec.arch)
    named = dict(trainer.model.named_parameters())
    assert set(ours) == set(named)
    for name, grad in ours.items():
        np.testing.assert_allclose(grad, named[name].grad.numpy(), rtol=2e-4, atol=2e-6, err_msg=name)


def test_a_prompt_gives_the_same_completion_alone_or_batched_and_its_log_probabilities_are_the_trainers():
    """Per-row keys: the same prompt and key give the same tokens at row 0 of one prompt or row 5 of eight of
    other lengths; the sampler's log-probabilities equal the training forward's recomputation."""
    setup = build(micro_config())
    params = setup.new_state().params
    generate = make_generate(setup.spec, setup.shard, max_new_tokens=8, temperature=1.0, top_p=0.9,
                             with_logprobs=True)  # fmt: skip
    rng = np.random.default_rng(2)
    prompts = np.zeros((8, 12), np.int32)
    lengths = rng.integers(3, 12, 8).astype(np.int32)
    for r in range(8):
        prompts[r, : lengths[r]] = rng.integers(3, 384, lengths[r])
    keys = rollouts.row_keys(0, 0, 4, 2)
    out, logps = (np.asarray(a) for a in generate(params, prompts, 0, lengths, keys))
    one = prompts[5:6, : lengths[5]]
    alone, alone_logps = (np.asarray(a) for a in generate(params, one, 0, lengths[5:6], keys[5:6]))
    np.testing.assert_array_equal(alone[0], out[5])
    np.testing.assert_allclose(alone_logps[0], logps[5], rtol=1e-5)
    assert len({tuple(row) for row in out}) == 8  # each row its own draw
    batch = rollouts.layout([prompts[r, : lengths[r]] for r in range(8)], out, np.full(8, 8), 20)
    scored = np.asarray(jax.jit(rollouts.make_scorer(setup, 1.0))(params, batch))
    for r in range(8):
        np.testing.assert_allclose(scored[r, lengths[r] : lengths[r] + 8], logps[r], rtol=1e-4, atol=1e-5)


def test_rollouts_and_steps_on_8_devices_equal_one_device(rows, tmp_path):
    """data 2 x fsdp 2 x tensor 2 against one device: the same completions, rewards, advantages and recomputed
    log-probabilities, then the same losses, gradient norms and weights over three steps (by SGD with
    momentum: AdamW moves a weight by about lr whatever its gradient's size, so a gradient near 0 summed in
    another order moves it by ~1e-4 more or less, which would hide nothing but make the weights differ)."""
    results = []
    for mesh, devices in ((dict(data=1, fsdp=1), jax.devices()[:1]), (dict(data=2, fsdp=2, tensor=2), None)):
        cfg = rl_config(rows, tmp_path, mesh=mesh, optim=dict(name="sgd", lr=0.5))
        from trainer.data import corpora, streams

        corpora.prepare(cfg.data, say=lambda *_: None)
        setup = build(cfg, devices)
        state = setup.new_state()
        holder = {"state": state}
        source = rollouts.Rollouts(setup, streams.Stream.from_config(cfg), list(range(8)),
                                   lambda h=holder: (h["state"].params, None), False)  # fmt: skip
        step = setup.train_step()
        batches, losses = [], []
        for _ in range(3):
            size, local = next(source)
            batches.append(local)
            placed = streams.to_global(local, setup.batch_sharding, size)
            holder["state"], metrics = step(holder["state"], placed)
            losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        results.append((batches, losses, jax.tree.map(np.asarray, holder["state"].params)))
    (one, one_losses, one_params), (eight, eight_losses, eight_params) = results
    for a, b in zip(one, eight, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["advantages"], b["advantages"])
        np.testing.assert_allclose(a["old_logps"], b["old_logps"], rtol=1e-4, atol=1e-5)
    assert any(np.abs(b["advantages"]).max() > 0 for b in one)  # the rewards told completions apart
    np.testing.assert_allclose(one_losses, eight_losses, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(one_params), jax.tree.leaves(eight_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # a stopped and resumed GRPO run, 22 s (2026-12-06): room for the suite's 10 minutes
def test_a_grpo_run_resumes_exactly_and_says_where_its_reward_started(rows, tmp_path):
    """Four steps straight, against two, a restart and two more, with two policy steps on each rollout (the
    second's ratio no longer 1): the same rollouts (the sampler's keys from the seed and the prompt's place),
    rewards, smoothed rewards, losses and weights. Whether the reward rose is in sight: the held-out prompts
    are scored before the first step (logged at step 0, equal to scoring the initial weights directly; read
    back by the resumed launch), `rl/reward_smoothed` is the rollouts' mean rewards' moving average (its
    closed form over the logged rewards, across the restart too), the `done:` line sets the held-out reward
    at step 0 beside the last, and the report draws them."""
    from trainer.data import streams
    from trainer.evaluation import report
    from trainer.run.cli import reached_words

    def run(steps, name):
        cfg = rl_config(rows, tmp_path, train=dict(steps=steps, eval_every=4, eval_batches=1))
        cfg.rl.updates_per_batch = 2
        return cfg, train(cfg, str(tmp_path / name))

    cfg, straight = run(4, "straight")
    assert run(2, "resumed")[1]["step"] == 2
    _, resumed = run(4, "resumed")
    for name in ("loss", "grad_norm", "param_norm", "rl/reward", "rl/reward_smoothed", "rl/entropy",
                 "rl/clip_fraction", "eval_reward", "eval_reward_before"):  # fmt: skip
        assert resumed[name] == pytest.approx(straight[name], rel=1e-6), name
    assert straight["grad_norm"] > 0

    setup = build(cfg)
    before = rollouts.HeldOut(setup, streams.Stream.from_config(cfg), 1)(setup.new_state().params)
    for name in ("eval_reward", "eval_reward_sampled", "eval_prompts"):
        assert straight[f"{name}_before"] == pytest.approx(before[name], rel=1e-9), name
    for name, evaluated in (("resumed", [0, 2, 4]), ("straight", [0, 4])):
        with open(tmp_path / name / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records if "eval_reward" in r] == evaluated, name
        logged = {r["step"]: r for r in records if "rl/reward" in r}
        average = 0.0
        for k in range(2):  # rollout k serves steps 2k+1 and 2k+2
            average = 0.9 * average + 0.1 * logged[2 * k + 1]["rl/reward"]
            for step in (2 * k + 1, 2 * k + 2):
                assert logged[step]["rl/reward_smoothed"] == pytest.approx(average / (1 - 0.9 ** (k + 1))), step
    words = reached_words(straight)
    moved = f"held-out reward {before['eval_reward']:.4f} -> {straight['eval_reward']:.4f} (greedy, from step 0 to 4)"
    assert moved in words, words
    fig = report.figure([str(tmp_path / "straight")])
    panel = fig.axes[len(report.PANELS)]
    held = next(line for line in panel.lines if line.get_label().endswith("(held-out)"))
    assert list(held.get_xdata()) == [0, 4]
    assert list(held.get_ydata()) == [before["eval_reward"], straight["eval_reward"]]
    smoothed = next(line for line in panel.lines if line.get_label().endswith("(smoothed)"))
    assert list(smoothed.get_ydata()) == [logged[s]["rl/reward_smoothed"] for s in (1, 2, 3, 4)]


def test_eval_rewards_each_held_out_prompts_greedy_and_sampled_completions_as_if_alone(rows, tmp_path):
    """eval.py on a GRPO run (data.format=prompts): the held-out prompts, batched and padded, give the mean
    reward of each prompt's greedy completion decoded alone and rewarded here, and of its rl.group_size
    completions sampled alone with their keys (the seed, the prompt's place, the held-out tag)."""
    from rl_rewards import variety

    from trainer.data import prompts, streams
    from trainer.evaluation.loss import evaluate_checkpoint

    cfg = rl_config(rows, tmp_path, train=dict(steps=2))
    train(cfg, str(tmp_path / "run"))
    result = evaluate_checkpoint(cfg, str(tmp_path / "run"), say=lambda *_: None)
    setup, _, params = load_params(cfg, str(tmp_path / "run"))
    held = prompts.rows(streams.Stream.from_config(cfg), "validation", shuffle=False)
    generate = make_generate(setup.spec, setup.shard, max_new_tokens=cfg.rl.max_new_tokens)
    judge = rollouts.Judge(cfg)
    alone = []
    for i in range(len(held)):
        out = np.asarray(generate(params, held[i].tokens[None], 0))
        n = judge.ends(out)[0]
        text = judge.tokenizer.decode([int(t) for t in out[0, :n] if int(t) not in judge.end_ids])
        alone.append(variety(held[i].prompt, text, held[i].answer))
    assert result["eval_prompts"] == len(held) > 0
    assert result["eval_reward"] == pytest.approx(np.mean(alone), rel=1e-9)

    rl = cfg.rl
    sample = make_generate(setup.spec, setup.shard, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                           top_p=rl.top_p)  # fmt: skip
    drawn = []
    for i in range(len(held)):
        keys = rollouts.row_keys(cfg.train.seed, i, 1, rl.group_size, rollouts.HELD_OUT_TAG)
        tokens = np.repeat(held[i].tokens[None], rl.group_size, axis=0)
        out = np.asarray(sample(params, tokens, 0, np.full(rl.group_size, len(held[i].tokens), np.int32), keys))
        for row, n in zip(out, judge.ends(out), strict=True):
            text = judge.tokenizer.decode([int(t) for t in row[:n] if int(t) not in judge.end_ids])
            drawn.append(variety(held[i].prompt, text, held[i].answer))
    assert len(set(drawn)) > 1  # draws, not one completion repeated
    assert result["eval_reward_sampled"] == pytest.approx(np.mean(drawn), rel=1e-9)


def test_a_mixture_of_prompts_corpora_draws_prompts_by_weight_and_the_tokenised_store_gives_the_same_prompts(
    rows, tmp_path
):
    """data.mixture of two prepared prompts corpora (mixture_unit=documents: weights are shares of prompts):
    prompts drawn 3:1, each corpus's in its own order; data.tokenized reads the same prompt tokens from the
    tokenised stores; a prompt with no room is named with its corpus; and a run trains and evaluates on it."""
    from trainer.data import corpora, prompts, streams

    upper = tmp_path / "upper.jsonl"
    with open(upper, "w") as f:
        for i in range(40):
            w = "abcdefghijklmnopqrst"[: 12 + i % 5]
            f.write(json.dumps({"prompt": f"Upper: {w}", "answer": w.upper()}) + "\n")
    cfg = rl_config(rows, tmp_path, data=dict(tokenized=True, seq_len=64),
                    train=dict(steps=2, eval_every=2, eval_batches=1))  # fmt: skip
    corpora.prepare(cfg.data)  # grpo_prompts, and its tokenised store
    corpora.prepare(rl_config(rows, tmp_path, data=dict(tokenized=True, name="upper", paths=str(upper))).data)
    cfg.data.update(mixture=("grpo_prompts:3", "upper:1"), mixture_unit="documents")
    stream = streams.Stream.from_config(cfg)

    drawn = prompts.rows(stream, "train", shuffle=True)
    taken = [drawn[i] for i in range(40)]
    assert ["of upper" in p.where for p in taken] == [False, False, False, True] * 10
    for name in ("grpo_prompts", "upper"):
        alone = prompts.corpus_rows(stream.sources()[name], "train", shuffle=True)
        order = [p for p in taken if f"of {name}" in p.where]
        assert [p.where for p in order] == [alone[i].where for i in range(len(order))]
    as_text = prompts.rows(dataclasses.replace(stream, tokenized=False), "train", shuffle=True)
    for i, p in enumerate(taken):
        assert p.prompt == as_text[i].prompt and p.answer == as_text[i].answer
        np.testing.assert_array_equal(p.tokens, as_text[i].tokens)

    longest = max(len(p.tokens) for p in taken if "of upper" not in p.where)
    with pytest.raises(ConfigError, match=r"the prompt of row \d+ of the train split of upper is \d+ tokens"):
        prompts.check_room(dataclasses.replace(stream, seq_len=longest + 10), "train", 10)

    result = train(cfg, str(tmp_path / "run"))
    assert result["step"] == 2 and np.isfinite(result["loss"]) and result["eval_prompts"] > 0
    # Each rollout's 2 prompts: the first two of the 3:1 draw, then the next two.
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        shares = [(r["mixture/grpo_prompts"], r["mixture/upper"]) for r in map(json.loads, f) if "loss" in r]
    assert shares == [(1.0, 0.0), (0.5, 0.5)], shares


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (dict(group_size=1), "rl.group_size=1: GRPO compares a prompt's completions"),
        (dict(beta=0.1), "rl.beta=0.1 pulls the policy towards a reference"),
        (dict(reward="no_such_module:f"), "rl.reward names no_such_module:f, which cannot be imported"),
        (dict(reward="format"), "rl.reward names format, which needs the pattern"),
        (dict(loss="ppo"), "rl.loss='ppo' is not one of"),
        (dict(max_new_tokens=48), "rl.max_new_tokens=48 leaves no room for a prompt"),
    ],
)
def test_bad_rl_settings_are_one_sentence_before_anything_compiles(rows, tmp_path, changes, says):
    cfg = rl_config(rows, tmp_path)
    cfg.rl.update(changes)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        build(cfg)


FAILING = [
    ("rl_rewards:raises", "the reward rl_rewards:raises raised ValueError"),
    ("rl_rewards:text", "the reward rl_rewards:text returned 'yes' on row"),
]


@pytest.mark.parametrize(("reward", "says"), FAILING)
def test_a_reward_that_fails_on_a_row_names_the_row(rows, tmp_path, reward, says):
    """Found when a rollout is rewarded (a reward's failure depends on the completion): the run stops there
    with the row named, and its workdir holds no checkpoint."""
    cfg = rl_config(rows, tmp_path, train=dict(steps=2))
    cfg.rl.reward = reward
    with pytest.raises(ConfigError, match=says):
        train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_a_prompt_too_long_for_its_completion_is_named_before_anything_compiles(rows, tmp_path):
    cfg = rl_config(rows, tmp_path, data=dict(seq_len=32))
    cfg.rl.max_new_tokens = 20
    says = r"the prompt of row \d+ of the train split of grpo_prompts is \d+ tokens, which leaves no room in "
    says += "data.seq_len=32"
    with pytest.raises(ConfigError, match=says):
        train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()

    # Too long in the held-out split alone: refused before a run that evaluates starts, and before eval.py's
    # scoring of a run that did not (it crashed in numpy's broadcast mid-evaluation before).
    from trainer.data.preparation.split import is_validation, split_by_document
    from trainer.evaluation.loss import evaluate_checkpoint

    held = tmp_path / "held"
    held.mkdir()
    with open(held / "prompts.jsonl", "w") as f:
        for i in range(60):
            long = is_validation(split_by_document(0.1), "prompts.jsonl", i)
            f.write(json.dumps({"prompt": "Reverse: " + ("abcdef" * 6 if long else "abcd"), "answer": "x"}) + "\n")
    cfg = rl_config(held, tmp_path, data=dict(name="held_prompts"), train=dict(steps=2, eval_every=1))
    says = r"the prompt of row \d+ of the validation split of held_prompts is \d+ tokens, which leaves no room"
    with pytest.raises(ConfigError, match=says):
        train(cfg, str(tmp_path / "evaluating"))
    assert not (tmp_path / "evaluating").exists()
    cfg.train.eval_every = 0
    train(cfg, str(tmp_path / "quiet"))
    with pytest.raises(ConfigError, match=says):
        evaluate_checkpoint(cfg, str(tmp_path / "quiet"))


def test_the_planner_counts_a_rollouts_cache_and_compiles_its_sampler(rows, tmp_path):
    """The rollout's KV cache by closed form (rows split over data x fsdp, key/value heads over tensor, held
    twice) and the sampler's program compiled for the same devices beside the step's."""
    from trainer.planning.plan import plan

    cfg = rl_config(rows, tmp_path, mesh=dict(data=2, fsdp=2, tensor=2))
    result = plan(cfg)
    m = cfg.model
    rows_per_device, kv_per_device = cfg.train.global_batch_size // 4, m.n_kv_heads // 2
    cache = 2 * rows_per_device * cfg.data.seq_len * m.n_layers * 2 * kv_per_device * (m.d_model // m.n_heads) * 4
    assert result["rollout"]["bytes_per_device"]["kv_cache"] == cache
    assert result["rollout"]["compiled_bytes_per_device"] > 0 and result["compiled_bytes_per_device"] > 0


def test_grpo_with_adapters_pulls_towards_the_base_with_them_off(rows, tmp_path):
    """model.lora under GRPO with rl.beta: the reference is the base with the adapters switched off (no
    second copy of the weights), so the first step's KL is exactly 0 (B starts at zero) and a later one's
    is not; the base's bits never change. With the adapters' dropout, a rollout's first update takes its old
    log-probabilities from its own forward pass, as TRL does: the ratio is exactly 1, so the clip never binds
    there (a second update on the rollout uses those the rollout recorded)."""
    base = str(tmp_path / "base")
    train(rl_config(rows, tmp_path, train=dict(steps=2)), base)
    cfg = rl_config(rows, tmp_path, train=dict(steps=5), checkpoint=dict(init_from=base, every_steps=2),
                    optim=dict(lr=0.1, clip_norm=0.0, weight_decay=0.0))  # fmt: skip
    cfg.model.lora.update(rank=4, alpha=8.0, dropout=0.5)
    cfg.rl.update(beta=0.1, updates_per_batch=2, epsilon=0.05)
    train(cfg, str(tmp_path / "adapted"))
    with open(tmp_path / "adapted" / "metrics.jsonl") as f:
        logged = {r["step"]: r for r in map(json.loads, f) if "rl/kl" in r}
    assert logged[1]["rl/kl"] == 0.0 and logged[3]["rl/kl"] > 0.0, logged
    assert [logged[s]["rl/clip_fraction"] for s in (1, 3, 5)] == [0.0, 0.0, 0.0], logged
    _, _, weights = load_params(cfg, str(tmp_path / "adapted"))
    _, _, before = load_params(rl_config(rows, tmp_path), base)
    for got, want in zip(jax.tree.leaves(adapters.split(weights)[1]), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ~20 s (2026-11-29): pytest -m slow, which CI runs too
@pytest.mark.slow
def test_a_hybrid_samples_through_its_recurrent_state_as_training_scores_and_resumes_exactly(rows, tmp_path):
    """A Qwen3.5-style hybrid (a Gated DeltaNet layer, then gated full attention) under GRPO with full remat:
    the sampler decodes through each linear layer's convolution and recurrent state (token by token), the
    step scores the same completions in chunks, and the two give each token the same log-probability
    (rl/logp_diff_max); four steps straight equal two, a restart and two more."""
    hybrid = dict(layer_types=("linear_attention", "full_attention"), qk_norm=True, attention_gate=True,
                  centred_norms=True, rope_fraction=0.5, remat="full")  # fmt: skip

    def run(steps, name):
        cfg = rl_config(rows, tmp_path, train=dict(steps=steps))
        cfg.model.update(hybrid)
        cfg.model.linear.update(key_heads=2, value_heads=4, key_dim=8, value_dim=8)
        return train(cfg, str(tmp_path / name))

    straight = run(4, "straight")
    assert run(2, "resumed")["step"] == 2
    resumed = run(4, "resumed")
    for name in ("loss", "grad_norm", "param_norm", "rl/reward", "rl/logp_diff_max"):
        assert resumed[name] == pytest.approx(straight[name], rel=1e-6), name
    assert straight["rl/logp_diff_max"] < 1e-4 and straight["grad_norm"] > 0
