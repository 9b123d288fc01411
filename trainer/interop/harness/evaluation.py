"""Downstream tasks through EleutherAI's lm-evaluation-harness (the `eval` extra): after training
(scripts/lm_eval.py) and in the training loop (train.harness_tasks).

Our model is an lm-eval `TemplateLM`; the scoring is trainer/interop/scoring.py's, on the run's mesh:
- loglikelihood: the context begins with the tokenizer's begin-of-document id, as every document in
  training did (an empty context is that id alone); the continuation's tokens are what the whole text's
  tokenization has after the context's. A request longer than the model's context (data.seq_len + 1
  tokens) loses tokens from the left, as the harness's own backends do, and is counted.
- loglikelihood_rolling: the text without the begin-of-document id, cut into the harness's own windows
  (utils.get_rolling_token_windows with that id as the prefix): every token predicted once, each window
  as long as the model's context.
- generate_until: greedy, from the begin-of-document id and the context (left-truncated to leave room for
  max_gen_toks, and counted), for max_gen_toks tokens, cut at the end-of-document id and then at the first
  stop sequence. Sampling (do_sample or a temperature) is refused.

Every process runs the same harness on the same requests (each holds them all and gives its devices their
part of every batch); process 0 writes the results, as the harness writes them, to
<workdir>/lm_eval/step<N>/. The harness seeds Python's, NumPy's and torch's global generators; they are
given back as they were, so a training run's state is untouched.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import difflib
import functools
import os
import random
import re
import socket
import sys
import tempfile

import jax
import numpy as np
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table

from trainer.config.errors import ConfigError
from trainer.data import run_tokenizer
from trainer.data.tokenizers import load_tokenizer
from trainer.interop.scoring import Scorer
from trainer.storage.workdir import path, write_file
from trainer.training.resume import load_params

LOCAL_DATA = (
    "copy the task's YAML into a folder of your own with `dataset_path: json` and `dataset_kwargs: {data_files: "
    "...}` naming local files, and pass that folder as --include_path (train.harness_include_path)"
)


class HarnessLM(TemplateLM):
    """lm-eval's view of `params`, scored by `scorer` (trainer/interop/scoring.py), with the run's tokenizer."""

    def __init__(self, scorer: Scorer, params, tokenizer):
        super().__init__()
        self.scorer, self.params, self.tokenizer_ = scorer, params, tokenizer
        self.truncated: collections.Counter = collections.Counter()  # requests cut from the left, per method

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer_.bos_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return [int(i) for i in self.tokenizer_.encode(string)]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        context_ids, continuation_ids = super()._encode_pair(context, continuation)
        return [self.prefix_token_id, *context_ids], continuation_ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, method: str = "loglikelihood"):
        rows, limit = [], self.max_length + 1
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ConfigError(
                    f"a {method} request's continuation is {len(continuation)} tokens, more than the model's "
                    f"context of {self.max_length} (data.seq_len); evaluate a model with a longer context."
                )
            if len(context) + len(continuation) > limit:
                self.truncated[method] += 1
                whole = (context + continuation)[-limit:]
                context = whole[: len(whole) - len(continuation)]
            rows.append((context, continuation))
        results = self.scorer.loglikelihoods(self.params, rows)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            ids = self.tok_encode(text)
            for context, predicted in map(
                make_disjoint_window, get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1)
            ):
                windows.append((None, context, predicted))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, method="rolling"), strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups = collections.defaultdict(list)  # one generation length per call
        settings = {}
        for i, (_, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError(
                    f"a task asks to sample ({gen_kwargs}); this model generates greedily only: give the task "
                    "do_sample: false (or --gen_kwargs in the harness's own command)."
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=None)
            settings[i] = until
            groups[kwargs["max_gen_toks"]].append(i)
        out = [""] * len(requests)
        for new_tokens, members in groups.items():
            room = self.max_length - new_tokens
            if room < 2:
                raise ConfigError(
                    f"a task asks for {new_tokens} new tokens, which leave no room for a prompt in the model's "
                    f"context of {self.max_length} tokens; lower the task's max_gen_toks."
                )
            prompts = []
            for i in members:
                ids = [self.prefix_token_id, *self.tok_encode(requests[i].args[0])]
                if len(ids) > room:
                    self.truncated["generate_until"] += 1
                    ids = ids[-room:]
                prompts.append(ids)
            for i, tokens in zip(members, self.scorer.greedy(self.params, prompts, new_tokens), strict=True):
                tokens = [int(t) for t in tokens]
                if self.eot_token_id in tokens:
                    tokens = tokens[: tokens.index(self.eot_token_id)]
                out[i] = postprocess_generated_text(self.tokenizer_.decode(tokens), settings[i], None)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out


@functools.cache
def task_manager(include_path: str = "", names: tuple[str, ...] = ()) -> TaskManager:
    """The harness's index of its tasks and of those in `include_path` (a folder of task YAML files); built
    once per process. The harness's own are some 15,000 YAML files (10 s here): where every task in `names` is
    the folder's own, the folder's index alone."""
    if include_path and not os.path.isdir(include_path):
        raise ConfigError(f"--include_path {include_path} is not a folder; give the folder holding your task YAML.")
    if include_path and names:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    return TaskManager(include_path=include_path or None)


def load_tasks(manager: TaskManager, names: list[str]) -> list:
    """The harness's Task and Group objects for `names`, each loaded (and its data read) on its own, so that an
    unknown name or data out of reach is said of the task it belongs to."""
    loaded = []
    for name in names:
        if name not in manager.all_tasks and not os.path.isfile(name):
            near = difflib.get_close_matches(name, manager.all_tasks, n=3)
            raise ConfigError(
                f"lm-eval knows no task {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else "")
                + "; `lm-eval ls tasks` lists the harness's own, and --include_path (train.harness_include_path) "
                "adds a folder of your own task YAML files."
            )  # fmt: skip
        try:
            try:  # from this machine first: no request that the Hub client would retry for a minute
                with _offline(), _no_progress_bars():
                    tasks = manager.load(name)
            except ConnectionError:
                if not _hub_reachable():
                    raise
                with _no_progress_bars():
                    tasks = manager.load(name)  # not here yet, and the Hub answers: fetched (then cached)
        except ConnectionError as e:
            where = re.search(r"reach '([^']+)'", str(e))
            raise ConfigError(
                f"task {name!r} reads its data from the Hugging Face Hub"
                + (f" ({where[1]})" if where else "")
                + " and this machine cannot reach it: run it once where there is a network (the data is then "
                f"cached under HF_HOME), or {LOCAL_DATA}."
            ) from None
        except FileNotFoundError as e:
            raise ConfigError(f"task {name!r} reads data files that are not there ({e}); fix its data_files.") from None
        groups = tasks.get("groups", {})
        loaded += [groups[name]] if name in groups else list(tasks["tasks"].values())
    return loaded


@contextlib.contextmanager
def _offline():
    """The Hub's and the datasets library's offline mode, as HF_HUB_OFFLINE=1 sets it, for a while."""
    import datasets
    import huggingface_hub

    before = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = before


def _hub_reachable(seconds: float = 5.0) -> bool:
    """Whether the Hub (HF_ENDPOINT) takes a connection, asked once, without the client's retries."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=seconds).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _global_generators_kept():
    """The harness seeds Python's, NumPy's and torch's global generators; give them back as they were."""
    python, numpy = random.getstate(), np.random.get_state()
    torch = sys.modules.get("torch")
    torch_state = torch.get_rng_state() if torch is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        if torch_state is not None:
            torch.set_rng_state(torch_state)


@contextlib.contextmanager
def _no_progress_bars():
    """The harness's and the datasets library's tqdm bars off: the command's output is ours (a bar per task and
    per method, redrawn, says nothing the results do not)."""
    from tqdm import tqdm

    shown = tqdm.__init__

    def hidden(self, *args, **kwargs):
        shown(self, *args, **{**kwargs, "disable": True})

    tqdm.__init__ = hidden
    try:
        yield
    finally:
        tqdm.__init__ = shown


def evaluate(scorer: Scorer, params, tokenizer, tasks: list, *, limit: float | None = None,
             num_fewshot: int | None = None, bootstrap_iters: int = 0, log_samples: bool = True,
             name: str = "trainer") -> dict:  # fmt: skip
    """The harness's results for `tasks` (load_tasks) on `params`, with "truncated": requests cut from the left
    per method, and "samples" when `log_samples`. `name` is the model's name in the results. `limit`: documents
    per task, below 1 a share of them; 0 or None all of them (the harness itself refuses 0)."""
    lm = HarnessLM(scorer, params, tokenizer)
    with _global_generators_kept(), _no_progress_bars():
        results = simple_evaluate(model=lm, model_args={"model": name}, tasks=tasks, num_fewshot=num_fewshot,
                                  limit=limit or None, bootstrap_iters=bootstrap_iters,
                                  log_samples=log_samples)  # fmt: skip
    results["truncated"] = dict(lm.truncated)
    return results


def metrics(results: dict) -> dict[str, float]:
    """harness/<task>/<metric> (and /<filter> when not the default) for each number the harness reports,
    standard errors left out: what the training loop logs."""
    out = {}
    for task, values in {**results["results"], **results.get("groups", {})}.items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            out[f"harness/{task}/{metric}" + (f"/{kind}" if kind and kind != "none" else "")] = float(value)
    return out


def summary(results: dict) -> str:
    """The harness's tables, and how many requests were cut to fit the model's context."""
    lines = [make_table(results)]
    if results.get("groups"):
        lines.append(make_table(results, "groups"))
    cut = results.get("truncated", {})
    lines.append(
        "requests cut from the left to fit the model's context: "
        + (", ".join(f"{method} {n}" for method, n in sorted(cut.items())) if cut else "none")
    )
    return "\n".join(lines)


def save(results: dict, workdir: str, step: int) -> str:
    """The results (and samples) as the harness writes them, in <workdir>/lm_eval/step<N>/; returns that folder.
    Written by the harness to a local folder first, then copied: the workdir may be a bucket."""
    results = dict(results)
    samples = copy.deepcopy(results.pop("samples", None))  # the tracker turns what it writes into strings
    folder = str(path(workdir) / "lm_eval" / f"step{step}")
    with tempfile.TemporaryDirectory() as local:
        tracker = EvaluationTracker(output_path=local)
        tracker.general_config_tracker.log_experiment_args(
            model_source="trainer", model_args={"model": f"step{step}"}, system_instruction=None,
            chat_template=None, fewshot_as_multiturn=False,
        )  # fmt: skip
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results.get("configs", {}) if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
        for root, _, files in os.walk(local):
            for file in files:
                with open(os.path.join(root, file), encoding="utf-8") as f:
                    write_file(f"{folder}/{file}", f.read())
    return folder


def evaluate_checkpoint(cfg, workdir: str, tasks: list[str], step: int | None = None, *, limit: float | None = None,
                        num_fewshot: int | None = None, include_path: str = "", bootstrap_iters: int = 100000,
                        log_samples: bool = True, devices=None, say=print) -> dict:  # fmt: skip
    """The harness on a checkpoint (the newest, or `step`) on the config's mesh: the tasks are found and their
    data read before anything compiles; process 0 prints the harness's tables and writes the results."""
    cfg = run_tokenizer.settle(cfg, workdir)  # the run's own copy of its tokenizer
    tokenizer = load_tokenizer(cfg.data)
    loaded = load_tasks(task_manager(include_path, tuple(tasks)), tasks)
    setup, step, params = load_params(cfg, workdir, step, devices)
    first = jax.process_index() == 0
    if first:
        say(f"lm-eval on step {step} of {workdir}: {', '.join(tasks)} on a mesh of {dict(setup.mesh.shape)}")
    results = evaluate(Scorer(setup), params, tokenizer, loaded, limit=limit, num_fewshot=num_fewshot,
                       bootstrap_iters=bootstrap_iters, log_samples=log_samples, name=f"step{step}")  # fmt: skip
    results["step"] = step
    if first:
        say(summary(results))
        say(f"wrote {save(results, workdir, step)}")
    return results


def check(cfg) -> None:
    """train.harness_tasks found, and their data read, before a run compiles anything."""
    load_tasks(
        task_manager(cfg.train.harness_include_path, tuple(cfg.train.harness_tasks)), list(cfg.train.harness_tasks)
    )


class InLoop:
    """The training loop's harness (train.harness_*): its tasks are found and their data read when the run
    starts, before anything compiles; `__call__(params, step)` returns the metrics to log and, on process 0,
    writes the harness's results to <workdir>/lm_eval/step<N>/."""

    def __init__(self, setup, tokenizer, workdir: str, watch=None):
        t = setup.cfg.train
        self.names, self.include = list(t.harness_tasks), t.harness_include_path
        self.limit = t.harness_limit
        self.fewshot = None if t.harness_fewshot < 0 else int(t.harness_fewshot)
        self.tokenizer, self.workdir = tokenizer, workdir
        self.scorer = Scorer(setup, watch)
        load_tasks(task_manager(self.include, tuple(self.names)), self.names)

    def __call__(self, params, step: int) -> tuple[dict[str, float], str]:
        """(metrics, a console line)."""
        tasks = load_tasks(
            task_manager(self.include, tuple(self.names)), self.names
        )  # afresh: the harness keeps state in them
        results = evaluate(self.scorer, params, self.tokenizer, tasks, limit=self.limit, num_fewshot=self.fewshot,
                           log_samples=False, name=f"step{step}")  # fmt: skip
        if jax.process_index() == 0:
            save(results, self.workdir, step)
        out = metrics(results)
        cut = sum(results["truncated"].values())
        line = "  ".join(f"{k.removeprefix('harness/')} {v:.4f}" for k, v in out.items())
        return out, f"step {step:>6}  harness {line}" + (f"  ({cut} requests cut to fit)" if cut else "")
