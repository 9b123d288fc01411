"""A pod whose hosts share nothing but a bucket, drilled on one machine: each process has its own HOME (so
its own ~/tensorflow_datasets) and a working directory holding nothing but the config file; a GCS emulator
on localhost holds the data directory and the run directory."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest
from conftest import CPU_FLAGS, REPO

from trainer.evaluation.loss import evaluate_checkpoint
from trainer.run.loop import train
from trainer.storage import workdir as wd
from trainer.storage.checkpoint import Checkpointer
from trainer.training.setup import build
from trainer.training.state import abstract_params

STDLIB = sysconfig.get_paths()["stdlib"]
CONFIG = f'''"""The drill's recipe: a micro model on part of the standard library, its own SentencePiece tokenizer."""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    c.data.update(source="text_files", name="pod", paths="{STDLIB}/[a-s]*.py", seq_len=32,
                  tokenizer="sentencepiece", tokenizer_path="tok/pod.model")
    c.precision.compute_dtype = "float32"
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.optim.update(lr=1e-2, warmup_steps=2, schedule="cosine")
    c.train.update(steps=12, global_batch_size=8, log_every=1, eval_every=4, eval_batches=2)
    c.checkpoint.update({{"every_steps": 2, "keep": 2}})
    return c
'''


def pod_config():
    """The same recipe, in this process."""
    namespace = {}
    exec(CONFIG, namespace)  # noqa: S102 - the test's own text
    return namespace["get_config"]()


def host(tmp_path, name: str) -> dict:
    """A machine of its own: a HOME and a working directory holding only the config file."""
    home, work = tmp_path / name / "home", tmp_path / name / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    (work / "pod.py").write_text(CONFIG)
    return {"cwd": str(work), "env": {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}}


def script(machine: dict, name: str, *args, timeout=300) -> str:
    command = [sys.executable, os.path.join(REPO, "scripts", name), "--config", "pod.py", *args]
    out = subprocess.run(command, cwd=machine["cwd"], env=machine["env"], capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def launch(machines: list[dict], args: list[str], logs) -> tuple[list[subprocess.Popen], list[str]]:
    """The run's two processes, each started on its own machine with the same command, as a pod's hosts are."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, machine in enumerate(machines):
        env = {**machine["env"], "TRAINER_COORDINATOR": f"localhost:{port}", "TRAINER_NUM_PROCESSES": "2",
               "TRAINER_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {CPU_FLAGS}"}  # fmt: skip
        files.append(str(logs / f"{i}.log"))
        with open(files[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "train.py"), "--config",
                                           "pod.py", *args], cwd=machine["cwd"], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    return procs, files


def text(path: str) -> str:
    with open(path) as f:
        return f.read()


def weights(cfg, workdir: str, step: int) -> list[np.ndarray]:
    setup = build(cfg)
    ckpt = Checkpointer(wd.checkpoint_dir(workdir), read_only=True)
    out = jax.tree.leaves(jax.device_get(ckpt.restore_params(step, abstract_params(setup.model, setup.shard))))
    ckpt.close()
    return out


@pytest.mark.slow  # seven processes on four "machines": 101 s of the suite's time (2026-11-29), over time_limit.py's 90
def test_hosts_sharing_only_a_bucket_prepare_once_train_resume_evaluate_and_generate(tmp_path, bucket):
    """The README's slice recipe: the tokenizer and the data prepared once into the bucket, from one machine;
    two processes (each with nothing but the config) train from it; both are killed after a checkpoint and
    relaunched; a third machine evaluates and generates. The weights equal a one-process local run's."""
    prep, one, two, three = (host(tmp_path, n) for n in ("prep", "host0", "host1", "host2"))
    data_dir, workdir = f"{bucket.url}/tfds", f"{bucket.url}/pod"
    on_bucket = [f"--config.data.data_dir={data_dir}", "--config.data.tokenized=true"]
    script(prep, "train_tokenizer.py", *on_bucket[:1])
    script(prep, "prepare_data.py", *on_bucket, "--tokenize")
    assert wd.path(f"{data_dir}/text_files/pod-tokens/1.0.0/dataset_info.json").exists()
    # The tokenizer now lives on the preparing machine alone: process 0's working copy has it too, no other.
    os.makedirs(os.path.join(one["cwd"], "tok"))
    with open(os.path.join(prep["cwd"], "tok", "pod.model"), "rb") as f:
        model = f.read()
    with open(os.path.join(one["cwd"], "tok", "pod.model"), "wb") as f:
        f.write(model)

    args = [*on_bucket, f"--workdir={workdir}"]
    procs, logs = launch([one, two], args, tmp_path / "first")
    deadline = time.time() + 240
    while time.time() < deadline and all(p.poll() is None for p in procs):
        wd.forget_listings(workdir)  # what this process listed before, gcsfs would answer again
        try:
            if any(s >= 4 for s in wd.saved_steps(workdir)):
                break
        except FileNotFoundError:  # listed while the run was writing: the prefix was there, then not yet (seen once)
            pass
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    wd.forget_listings(workdir)
    assert 4 <= wd.saved_steps(workdir)[-1] < 12, text(logs[0])[-3000:] + text(logs[1])[-3000:]
    assert "not prepared" not in text(logs[1])

    procs, logs = launch([one, two], args, tmp_path / "second")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], text(logs[0])[-3000:] + text(logs[1])[-3000:]
    resumed = int(re.search(r"resumed from the checkpoint at step (\d+)", text(logs[0])).group(1))
    wd.forget_listings(workdir)
    assert resumed >= 4 and wd.saved_steps(workdir)[-1] == 12
    assert wd.path(f"{workdir}/tokenizer/pod.model").read_bytes() == model

    # One process on one machine, its own local corpus from the same files and tokenizer, its own run.
    cfg = pod_config()
    cfg.data.update(data_dir=str(tmp_path / "local_tfds"), tokenized=True,
                    tokenizer_path=os.path.join(prep["cwd"], "tok", "pod.model"))  # fmt: skip
    local = str(tmp_path / "local_run")
    train(cfg, local)
    for a, b in zip(weights(cfg, workdir, 12), weights(cfg, local, 12), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)

    # A third machine with nothing but the config evaluates and samples the run from the bucket.
    evaluated = json.loads(script(three, "eval.py", *args).strip().splitlines()[-1])
    expected = evaluate_checkpoint(cfg, local)
    assert evaluated["step"] == 12 and evaluated["tokens"] == expected["tokens"]
    assert evaluated["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-4)
    sampled = json.loads(script(three, "generate.py", *args, "--prompt=def ", "--max_new_tokens=8", "--json")
                         .strip().splitlines()[-1])  # fmt: skip
    assert sampled["step"] == 12 and sampled["completion"]


def test_a_corpus_on_one_host_disk_is_refused_naming_the_host_without_it_before_any_compile(tmp_path, bucket):
    """The same two machines, with the data directory left at ~/tensorflow_datasets: process 0 prepares the
    corpus on its own disk, and both stop with one sentence naming process 1, before anything compiles or
    anything is written to the run directory."""
    one, two = host(tmp_path, "host0"), host(tmp_path, "host1")
    for machine in (one, two):
        os.makedirs(os.path.join(machine["cwd"], "tok"))
    from trainer.data.tokenizers import train_sentencepiece

    texts = [open(os.path.join(STDLIB, name)).read() for name in ("abc.py", "ast.py", "base64.py", "bisect.py")]
    train_sentencepiece(texts, 384, os.path.join(one["cwd"], "tok", "pod.model"))
    workdir = f"{bucket.url}/refused"
    procs, logs = launch([one, two], [f"--workdir={workdir}"], tmp_path / "logs")
    assert [p.wait(timeout=240) for p in procs] == [1, 1]
    sentence = (
        "process 1 (none) of 2 cannot read the corpus process 0 has (text_files/pod under "
        "data.data_dir='~/tensorflow_datasets'"
    )
    for log in logs:
        assert f"error: {sentence}" in text(log), text(log)[-3000:]
        assert "scripts/prepare_data.py" in text(log) and "Traceback" not in text(log)
        assert "compiled the train step" not in text(log)
    assert not wd.path(workdir).exists()


def test_a_tokenizer_file_other_than_the_runs_copy_is_refused_by_name(tmp_path):
    """A started run keeps its tokenizer; a config whose path now holds another file is refused, naming it, and
    a config whose path holds nothing reads the copy. A run from before copies were kept keeps its path."""
    from trainer.config.errors import ConfigError
    from trainer.data import run_tokenizer
    from trainer.data.tokenizers import train_sentencepiece

    texts = [open(os.path.join(STDLIB, name)).read() for name in ("abc.py", "ast.py", "base64.py", "bisect.py")]
    model = str(tmp_path / "tok.model")
    train_sentencepiece(texts, 384, model)
    cfg, workdir = pod_config(), str(tmp_path / "run")
    cfg.data.tokenizer_path = model
    assert run_tokenizer.settle(cfg, workdir) is cfg  # not started: the config's own file
    wd.write_config(workdir, cfg)  # the run starts, as prepare_run and Run do
    run_tokenizer.store(cfg, workdir)
    copy = os.path.join(workdir, "tokenizer", "tok.model")
    assert run_tokenizer.settle(cfg, workdir).data.tokenizer_path == copy
    train_sentencepiece(texts[:3], 384, str(tmp_path / "other.model"))
    os.replace(tmp_path / "other.model", model)
    with pytest.raises(ConfigError, match=f"data.tokenizer_path='{model}' is another tokenizer .* copied to {copy}"):
        run_tokenizer.settle(cfg, workdir)
    os.remove(model)
    assert run_tokenizer.settle(cfg, workdir).data.tokenizer_path == copy

    old = str(tmp_path / "old")
    wd.write_config(old, cfg)
    cfg.data.tokenizer_path = str(tmp_path / "elsewhere.model")
    with pytest.raises(ConfigError, match=f"trained with data.tokenizer_path='{tmp_path}/tok.model' and keeps no copy"):
        run_tokenizer.settle(cfg, old)


def test_a_data_directory_in_a_bucket_that_does_not_exist_is_one_sentence_before_anything_runs(tmp_path, bucket):
    from trainer.config.errors import ConfigError

    cfg = pod_config()
    cfg.data.update(data_dir="gs://nosuchbucket/tfds", tokenizer="byte", tokenizer_path="")
    with pytest.raises(ConfigError, match=r"^the bucket gs://nosuchbucket does not exist; create it, or choose "
                                          r"another data.data_dir.$"):  # fmt: skip
        train(cfg, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")
