"""lm-evaluation-harness on our checkpoints, against the harness's own `hf` backend on the exported model.

The tasks are the harness YAML files in tests/lm_eval_tasks over local jsonl: a multiple-choice task, a
generation task with a stop sequence and a rolling perplexity task, some of whose requests are longer than
the model's context (32 tokens), so that the truncation is compared too.
"""

import functools
import glob
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, cli_args, micro_config
from test_resume import params_at

pytest.importorskip("lm_eval", reason="the eval extra is not installed: pip install -e '.[eval]'")
pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")

import lm_eval  # noqa: E402

from trainer.config.errors import ConfigError  # noqa: E402
from trainer.interop.harness import evaluation as harness  # noqa: E402
from trainer.interop.huggingface import export_checkpoint  # noqa: E402
from trainer.run.loop import train  # noqa: E402

TASKS = "tests/lm_eval_tasks"  # read relative to the repository, where the tests run
NAMES = ["tiny_choice", "tiny_complete", "tiny_rolling"]
PAIRS = [("the cat", "sat on", "the mat"), ("the dog", "ran to", "the tree"), ("a bird", "flew over", "the house"),
         ("the fox", "jumped over", "the river")]  # fmt: skip


def sentences_config(tmp, **train_cfg):
    data = dict(source="text_files", name="sentences", paths=f"{tmp}/corpus/*.txt", data_dir=f"{tmp}/tfds")
    return micro_config(data=data, train=dict(dict(steps=200, log_every=50), **train_cfg))


def write_corpus(tmp):
    os.makedirs(f"{tmp}/corpus", exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(200):
        text = " ".join("{} {} {}.".format(*PAIRS[k]) for k in rng.integers(0, 4, 6))
        with open(f"{tmp}/corpus/{i}.txt", "w") as f:
            f.write(text + "\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harness")
    write_corpus(tmp)
    cfg = sentences_config(tmp)
    workdir, exported = str(tmp / "run"), str(tmp / "hf")
    train(cfg, workdir)
    export_checkpoint(cfg, workdir, None, exported)
    return cfg, workdir, exported


@functools.cache
def local_tasks():
    """The harness's index of this folder's tasks alone (its own 15,000 files need not be read for them)."""
    return lm_eval.tasks.TaskManager(include_path=TASKS, include_defaults=False)


def hf_backend(exported, names, **model_args):
    manager = local_tasks()
    args = dict(pretrained=exported, dtype="float32", max_length=32, **model_args)
    return lm_eval.simple_evaluate(model="hf", model_args=args, tasks=names, task_manager=manager, batch_size=1,
                                   device="cpu", bootstrap_iters=0, log_samples=True)  # fmt: skip


def responses(samples):
    """{(task, doc_id): the model's answers to the document's requests}: log-likelihoods (and greedy flags)
    or generated text."""
    return {(task, s["doc_id"]): s["resps"] for task, docs in samples.items() for s in docs}


def assert_same(ours, theirs, atol, rtol=0.0):
    assert ours.keys() == theirs.keys()
    for key in ours:
        for a, b in zip(ours[key], theirs[key], strict=True):
            a, b = a[0], b[0]  # one response per request (the files hold numbers as strings)
            if isinstance(a, (list, tuple)):  # (log-likelihood, greedy)
                close = abs(float(a[0]) - float(b[0])) <= atol + rtol * abs(float(b[0]))
                assert close and str(a[1]) == str(b[1]), (key, a, b)
            elif key[0] == "tiny_rolling":  # a text's log-likelihood
                assert abs(float(a) - float(b)) <= atol + rtol * abs(float(b)), (key, a, b)
            else:  # generated text
                assert a == b, key


def one_device(cfg, workdir):
    """Every document of each task: a limit of 0 means all of them, as train.harness_limit=0 does."""
    return harness.evaluate_checkpoint(cfg, workdir, NAMES, include_path=TASKS, bootstrap_iters=0, limit=0,
                                       devices=jax.devices()[:1])  # fmt: skip


@pytest.mark.slow  # the harness against its HF backend, 22 s (2026-12-06): room for the suite's 10 minutes
def test_the_harness_scores_a_checkpoint_as_its_hf_backend_scores_the_export(trained):
    cfg, workdir, exported = trained
    ours = one_device(cfg, workdir)
    # The harness's hf backend: its tokenizer (exported with ours) begins every text with the begin-of-document
    # id; for rolling perplexity, told not to (add_bos_token=False), it conditions the first window on that id
    # as we do, instead of scoring the id as the text's first token.
    hf = hf_backend(exported, NAMES[:2])
    hf_rolling = hf_backend(exported, NAMES[2:], add_bos_token=False)
    theirs = {**responses(hf["samples"]), **responses(hf_rolling["samples"])}
    assert_same(responses(ours["samples"]), theirs, atol=2e-4)
    for results in (hf, hf_rolling):
        for task, values in results["results"].items():
            for metric, value in values.items():
                if isinstance(value, float):
                    np.testing.assert_allclose(ours["results"][task][metric], value, rtol=1e-5, err_msg=metric)
    # Requests cut to fit: every choice of the 4 long multiple-choice documents, the 2 long prompts.
    long_choices = sum(1 + len(d["context"]) + len(" " + c) > 33 for d in docs("choice") for c in d["choices"])
    long_prompts = sum(1 + len(d["context"]) > 32 - 12 for d in docs("complete"))
    assert ours["truncated"] == {"loglikelihood": long_choices, "generate_until": long_prompts} == {
        "loglikelihood": 16, "generate_until": 2}  # fmt: skip
    # A model that has learnt the corpus (whose sentences end as these tasks' answers do) knows most of them.
    assert (
        ours["results"]["tiny_choice"]["acc,none"] >= 0.75
        and ours["results"]["tiny_complete"]["exact_match,none"] >= 0.75
    )


# ~1.5 minutes of two cores (two processes importing the harness): pytest -m slow; the one-device answers
# above, and the in-the-loop harness on a pipeline mesh below, run in CI.
@pytest.mark.slow
def test_the_harness_on_a_pod_gives_the_one_device_answers_and_files(trained):
    """The script on two processes of 4 devices each (context 2 x fsdp 2 x tensor 2: each request's tokens
    split zig-zag over the context axis, the batch over fsdp, the heads over tensor): the same answers and
    files as one device."""
    cfg, workdir, _ = trained
    ours = one_device(cfg, workdir)
    eight = sentences_config(os.path.dirname(workdir))
    eight.mesh.update(context=2, fsdp=2, tensor=2)
    args = [*cli_args(eight), f"--workdir={workdir}", f"--tasks={','.join(NAMES)}", f"--include_path={TASKS}",
            "--bootstrap_iters=0"]  # fmt: skip
    out = subprocess.run([sys.executable, "scripts/launch_local.py", "-n", "2", "--devices_per_process", "4", "--",
                          sys.executable, "scripts/lm_eval.py", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[0] |tiny_choice" in out.stdout and "requests cut from the left to fit the model's context" in out.stdout
    assert "[1] |" not in out.stdout  # one table, from process 0
    # Nothing but what we print: no Gloo connection lines, progress bars or plugin and library log lines.
    noise = [line for line in out.stdout.splitlines()
             if re.search(r"\[Gloo\]|it/s\]|\d+%\||^\[\d\] [IWEF]\d{4} |WARNING|Traceback", line)]  # fmt: skip
    assert not noise, noise
    folder = f"{workdir}/lm_eval/step200"
    written = json.load(open(newest(f"{folder}/results_*.json")))  # (the run above wrote one too)
    assert written["truncated"] == ours["truncated"]
    samples = {}
    for task in NAMES:
        samples[task] = [json.loads(line) for line in open(newest(f"{folder}/samples_{task}_*.jsonl"))]
    # fp32 sums of up to 32 log-probabilities, reduced in another order over the context axis
    assert_same(responses(samples), responses(ours["samples"]), atol=1e-5, rtol=1e-6)


def newest(pattern):
    return sorted(glob.glob(pattern))[-1]  # the harness names its files by the time, to the microsecond


def docs(name):
    return [json.loads(line) for line in open(os.path.join(REPO, TASKS, f"{name}.jsonl"))]


@pytest.mark.slow  # a pipeline run with the harness and its resume, 26 s (2026-12-06): room for the suite's 10 minutes
def test_in_the_loop_on_a_pipeline_mesh_it_logs_each_task_and_resume_stays_bit_exact(trained, tmp_path):
    """Harness at steps 3 and 6 on stage 2 x fsdp 2 x tensor 2, the run stopped at 3 and resumed: parameters
    equal a run without the harness bit for bit; the logged figures equal the script's on one device."""
    cfg, workdir, _ = trained
    tmp = os.path.dirname(workdir)
    tasks = dict(harness_tasks=("tiny_choice", "tiny_rolling"), harness_every=3, harness_limit=4,
                 harness_include_path=TASKS)  # fmt: skip

    def piped(steps, **train_cfg):  # a constant schedule: 3 steps and 6 schedule the same rates
        c = sentences_config(tmp, steps=steps, pipeline_microbatches=2, **train_cfg)
        c.mesh.update(stage=2, fsdp=2, tensor=2)
        c.optim.update(schedule="constant", warmup_steps=1)
        return c

    run = str(tmp_path / "with_harness")
    train(piped(3, **tasks), run)
    train(piped(6, **tasks), run)  # resumed at 3
    plain = piped(6)
    train(plain, str(tmp_path / "without"))
    for a, b in zip(*(jax.tree.leaves(params_at(plain, w, 6)) for w in (run, str(tmp_path / "without"))), strict=True):
        np.testing.assert_array_equal(a, b)
    logged = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    logged = {r["step"]: r for r in logged if "harness/tiny_choice/acc" in r}
    assert sorted(logged) == [3, 6] and os.path.isfile(newest(f"{run}/lm_eval/step6/results_*.json"))
    alone = harness.evaluate_checkpoint(sentences_config(tmp), run, ["tiny_choice", "tiny_rolling"], 6, limit=4,
                                        include_path=TASKS, bootstrap_iters=0, devices=jax.devices()[:1])  # fmt: skip
    for name, value in harness.metrics(alone).items():
        np.testing.assert_allclose(logged[6][name], value, rtol=1e-5, err_msg=name)
    assert {"harness/tiny_rolling/word_perplexity", "harness/tiny_choice/acc_norm"} <= set(logged[6])


@pytest.mark.slow  # 22 s, and with it the 28 s fixture leaves the README's pytest (2026-12-06)
def test_an_unknown_task_or_one_whose_data_is_out_of_reach_is_one_sentence(trained, monkeypatch):
    import trainer.interop.harness

    with monkeypatch.context() as m:  # as without the eval extra
        m.setitem(sys.modules, "lm_eval", None)
        m.delitem(sys.modules, "trainer.interop.harness.evaluation")
        m.delattr(trainer.interop.harness, "evaluation")
        with pytest.raises(ConfigError, match=r'lm-evaluation-harness is not installed .*pip install -e ".\[eval\]"'):
            trainer.interop.harness.load()
    with pytest.raises(ConfigError, match=r"lm-eval knows no task 'tiny_choise' \(did you mean tiny_choice"):
        harness.load_tasks(harness.task_manager(TASKS), ["tiny_choise"])
    # A task whose data is on the Hub, on a machine without a network (and no HF_HUB_OFFLINE set), from the
    # script: one sentence at once, before anything compiles, rather than after the Hub client's retries.
    cfg, workdir, _ = trained
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    args = [*cli_args(cfg), f"--workdir={workdir}", "--tasks=tiny_choice,arc_easy", f"--include_path={TASKS}"]
    out = subprocess.run([sys.executable, "scripts/lm_eval.py", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 1
    assert "Retrying" not in out.stdout + out.stderr and "thrown while requesting" not in out.stdout + out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert error == [
        "error: task 'arc_easy' reads its data from the Hugging Face Hub (allenai/ai2_arc) and this machine cannot "
        "reach it: run it once where there is a network (the data is then cached under HF_HOME), or "
        f"{harness.LOCAL_DATA}."
    ], out.stderr[-3000:]
    assert "compiled" not in out.stdout + out.stderr


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_requests_are_tokenized_as_the_hf_backend_tokenizes_them_with_the_exported_tokenizer(tmp_path, kind):
    """With a SentencePiece model or a tokenizer.json, each method's tokens are those the hf backend gets from
    the exported tokenizer (which begins every text with the begin-of-document id): the harness's own pair
    splitting run over that tokenizer."""
    import transformers
    from lm_eval.api.model import TemplateLM
    from test_huggingface import llama3_style_tokenizer

    from trainer.data.tokenizers import load_tokenizer, train_sentencepiece
    from trainer.interop.huggingface import write_tokenizer

    if kind == "sentencepiece":
        path = str(tmp_path / "spm.model")
        stdlib = os.path.dirname(os.__file__)
        train_sentencepiece([open(os.path.join(stdlib, f)).read() for f in ("os.py", "glob.py", "abc.py")], 400, path)
    else:
        path = str(tmp_path / "tok")
        llama3_style_tokenizer(path)
    cfg = micro_config(data=dict(tokenizer=kind, tokenizer_path=path))
    write_tokenizer(cfg.data, str(tmp_path / "hf"))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = harness.HarnessLM(None, None, load_tokenizer(cfg.data))

    class HfBackend:  # what HFLM's tokenization is: TemplateLM's splitting over the tokenizer's own encode
        backend = "causal"

        def tok_encode(self, text, add_special_tokens=None):
            return (
                exported.encode(text) if add_special_tokens is None else exported.encode(text, add_special_tokens=False)
            )

    pairs = [("The quick brown fox", " jumps over"), ("def f(x):", "\n    return x"), ("ünïcode ✓ ", "🐍 snake"),
             ("  leading", " spaces  ")]  # fmt: skip
    for context, continuation in pairs:
        assert ours._encode_pair(context, continuation) == TemplateLM._encode_pair(HfBackend(), context, continuation)
        assert [ours.prefix_token_id, *ours.tok_encode(context)] == exported.encode(context)  # a generation prompt
        assert ours.tok_encode(context + continuation) == exported.encode(context + continuation,
                                                                          add_special_tokens=False)  # fmt: skip
