"""KV-cached generation against recomputing the whole prefix for every token."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from trainer.model import sampling
from trainer.model.sampling import make_generate, sample
from trainer.training.setup import build


def setup_and_params(mesh, n_devices):
    setup = build(micro_config(mesh=mesh), jax.devices()[:n_devices])
    state = setup.new_state()
    return setup, state.params


def naive_generate(setup, params, prompt, n, seed=0, temperature=0.0, top_k=0, top_p=1.0):
    """The reference: the full forward pass over the whole prefix for every token, no cache, with the
    same per-token keys the cached loop is documented to use. The buffer has its final length from
    the start (one compile): attention is causal, so the positions not yet filled change nothing."""
    batch, length = prompt.shape
    tokens = np.zeros((batch, length + n), np.int32)
    tokens[:, :length] = prompt
    forward = jax.jit(lambda p, t: setup.model.apply(p, t))
    keys = jax.random.split(jax.random.key(seed), n)
    for i in range(n):
        logits = forward(params, jnp.asarray(tokens))[:, length + i - 1]
        tokens[:, length + i] = np.asarray(sample(logits, keys[i], temperature, top_k, top_p))
    return tokens[:, length:]


@pytest.mark.parametrize("mesh,n_devices", [(dict(fsdp=4, tensor=2), 8)])
def test_cached_greedy_decoding_equals_recomputing_the_prefix(mesh, n_devices):
    setup, params = setup_and_params(mesh, n_devices)
    prompt = np.random.default_rng(0).integers(3, 384, (2, 7)).astype(np.int32)
    generate = make_generate(setup.spec, setup.shard, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(generate(params, prompt, 0)), naive_generate(setup, params, prompt, 12))
    # Prompts of different lengths side by side, the shorter padded with other tokens: each row as if alone.
    lengths = np.array([7, 4], np.int32)
    got = np.asarray(generate(params, prompt, 0, lengths))
    np.testing.assert_array_equal(got[1], naive_generate(setup, params, prompt[1:, :4], 12)[0])
    np.testing.assert_array_equal(got[0], naive_generate(setup, params, prompt[:1], 12)[0])


def test_a_long_prompt_prefilled_in_chunks_decodes_as_the_whole_prefix_recomputed(monkeypatch):
    """Prompts longer than PREFILL_CHUNK (300 and 130 tokens, padded to one width; 5 is one chunk's worth
    and all padding after) go through the prefill a chunk at a time, a local layer's ring included: each
    row's greedy continuation equals recomputing its whole prefix without a cache, and every new token's
    log-probability the prompt prefilled whole."""
    cfg = micro_config(model=dict(max_seq_len=512, sliding_window=64, global_every=2))
    setup = build(cfg, jax.devices()[:1])
    params = setup.new_state().params
    prompt = np.random.default_rng(2).integers(3, 384, (3, 300)).astype(np.int32)
    lengths = np.array([300, 130, 5], np.int32)
    runs = []
    for chunk in (sampling.PREFILL_CHUNK, 512):
        monkeypatch.setattr(sampling, "PREFILL_CHUNK", chunk)
        generate = make_generate(setup.spec, setup.shard, max_new_tokens=6, with_logprobs=True)
        runs.append([np.asarray(a) for a in generate(params, prompt, 0, lengths)])
    (got, logps), (_, whole) = runs
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(got[row], naive_generate(setup, params, prompt[row : row + 1, :length], 6)[0])
    np.testing.assert_allclose(logps, whole, rtol=1e-5, atol=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy_and_sampling_equals_uncached_sampling():
    setup, params = setup_and_params(dict(fsdp=1), 1)
    prompt = np.random.default_rng(1).integers(3, 384, (1, 5)).astype(np.int32)
    greedy = make_generate(setup.spec, setup.shard, max_new_tokens=8)(params, prompt, 0)
    top1 = make_generate(setup.spec, setup.shard, max_new_tokens=8, temperature=1.0, top_k=1)
    nucleus = make_generate(setup.spec, setup.shard, max_new_tokens=8, temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(np.asarray(top1(params, prompt, 3)), np.asarray(greedy))
    np.testing.assert_array_equal(np.asarray(nucleus(params, prompt, 3)), np.asarray(greedy))
    free = make_generate(setup.spec, setup.shard, max_new_tokens=8, temperature=1.0)
    reference = naive_generate(setup, params, prompt, 8, seed=5, temperature=1.0)
    np.testing.assert_array_equal(np.asarray(free(params, prompt, 5)), reference)
    assert not np.array_equal(np.asarray(free(params, prompt, 6)), reference)


def test_top_k_and_top_p_only_ever_pick_allowed_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(0), 3)
    top2 = np.asarray(sample(logits, keys[0], 1.0, 2, 1.0))
    assert set(top2.tolist()) == {0, 1}
    assert 0.55 < (top2 == 0).mean() < 0.70  # 0.5 / 0.8 = 0.625 after renormalising
    nucleus = np.asarray(sample(logits, keys[1], 1.0, 0, 0.75))  # 0.5 + 0.3 reaches 0.75
    assert set(nucleus.tolist()) == {0, 1}
    assert set(np.asarray(sample(logits, keys[2], 1.0, 0, 0.9)).tolist()) == {0, 1, 2}


def test_a_request_the_model_cannot_make_as_asked_is_refused_in_one_sentence():
    """generate.py's checks (training's samples pass through the same): the numbers, before any compile."""
    from trainer.config.errors import ConfigError
    from trainer.data.tokenizers import ByteTokenizer
    from trainer.evaluation.samples import check_request

    cfg, tok = micro_config(), ByteTokenizer()  # max_seq_len 64, vocab 384; a byte is a token
    names = dict(new_tokens="--max_new_tokens", top_k="--top_k", top_p="--top_p", temperature="--temperature")
    check_request(cfg, tok, "x" * 13, 50, names)  # 1 + 13 + 50 = 64: fits exactly
    with pytest.raises(ConfigError, match=r"^the prompt 'xxxxxxxxxxxxxx' \(15 tokens with its begin-of-document id\) "
                                          r"and --max_new_tokens=50 make 65 tokens, more than model.max_seq_len=64; "
                                          r"ask for at most 49 new tokens, or shorten the prompt\.$"):  # fmt: skip
        check_request(cfg, tok, "x" * 14, 50, names)
    # The prompt alone leaves no room: said of the prompt, quoted by its start only.
    with pytest.raises(ConfigError, match=r"^the prompt 'abcdefghijabcdefghijabcdefghij\.\.\.' \(71 tokens with its "
                                          r"begin-of-document id\) leaves no room in model.max_seq_len=64 for a new "
                                          r"token; shorten it to at most 62 tokens\.$"):  # fmt: skip
        check_request(cfg, tok, "abcdefghij" * 7, 8, names)
    check_request(cfg, tok, "", 8, names, temperature=0.8, top_k=384)
    with pytest.raises(ConfigError, match=r"^--top_k=385 is more than the model's 384 token ids \(model.vocab_size\); "
                                          r"use at most 384, or 0 for all\.$"):  # fmt: skip
        check_request(cfg, tok, "", 8, names, temperature=0.8, top_k=385)
    with pytest.raises(
        ConfigError,
        match=r"^--top_k=50 and --top_p=0.95 would be ignored: --temperature=0 is "
        r"greedy; give a --temperature above 0 to sample \(e.g. 0.8\)\.$",
    ):
        check_request(cfg, tok, "", 8, names, top_k=50, top_p=0.95)
    with pytest.raises(ConfigError, match=r"^--top_p=0.9 would be ignored"):
        check_request(cfg, tok, "", 8, names, top_p=0.9)


@pytest.mark.slow  # the docs' chat command through the script, 18 s (2026-12-06): room for the suite's 10 minutes
def test_the_documented_chat_command_runs_with_the_new_tokens_that_fit_and_says_a_number_that_works(tmp_path):
    """generate.py --chat --prompt with no --max_new_tokens generates what fits after the message as the chat
    template renders it; too many are refused naming that prompt's real length and a number that works, which
    then runs."""
    import json
    import subprocess
    import sys

    from conftest import REPO, cli_args

    from trainer.run.loop import train

    rows = [{"messages": [{"role": "user", "content": f"Reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in ("python", "abc", "stone", "north") * 50]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = micro_config(data=dict(source="text_files", format="chat", name="reverse", paths=str(tmp_path / "chat.jsonl"),
                                 data_dir=str(tmp_path / "tfds")),
                       train=dict(steps=2), checkpoint={"every_steps": 2})  # fmt: skip
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    command = [sys.executable, "scripts/generate.py", *cli_args(cfg), f"--workdir={workdir}", "--chat",
               "--prompt=Reverse: python"]  # fmt: skip
    fits = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0 and not fits.stderr.strip(), fits.stderr[-2000:]
    # <s><|user|>\nReverse: python\n<|assistant|>\n: 40 byte tokens, so 24 fit in max_seq_len=64
    too_many = subprocess.run([*command, "--max_new_tokens=30"], cwd=REPO, capture_output=True, text=True, timeout=300)
    said = too_many.stdout + too_many.stderr
    assert too_many.returncode != 0 and re.search(
        r"the prompt 'Reverse: python' \(40 tokens rendered through the chat "
        r"template\) and --max_new_tokens=30 make 70 tokens, more than "
        r"model.max_seq_len=64; ask for at most 24 new tokens",
        said,
    ), said
    works = subprocess.run([*command, "--max_new_tokens=24"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert works.returncode == 0, works.stderr[-2000:]
