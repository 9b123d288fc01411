"""What every script in scripts/ shares: flag parsing with one-sentence errors.

The library never reads flags; scripts parse them here and pass plain values in.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import sys
import traceback
from collections.abc import Callable

from absl import app, flags, logging
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from parallelism import accelerators
from trainer import config
from trainer.config import forms, last_words
from trainer.config.errors import ConfigError, TrainingError
from trainer.run import startup
from trainer.storage import faults
from trainer.storage.metrics import loss_words

_COORDINATOR = flags.DEFINE_string("coordinator", None, "Multi-process runs: host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process runs: how many processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index.")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "Join a multi-host run JAX finds by itself (a Cloud TPU VM slice).")


class _ConfigParser(ConfigFileFlagParser):
    """A configs/*.py recipe, or a run's saved config (<workdir>/config.json: every key as the run resolved
    it), so that a command after an import or a run repeats none of its --config.* flags."""

    def parse(self, path):
        # Said here, as the flag is parsed (its value is what the user typed, said before this): the library
        # defers a missing file's error to the config's first use, inside the script, as a traceback.
        from trainer.storage import workdir as wd  # a run's config.json may be in a bucket

        where = wd.path(path)
        if where.is_dir():
            saved = where / "config.json"
            hint = f"its run's saved config is {saved}" if saved.exists() else "it holds no run's config.json"
            raise ValueError(f"is a folder; give a configs/*.py recipe or a run's config.json ({hint}).")
        if not where.exists():
            raise ValueError("names no file; give a configs/*.py recipe or a run's config.json that exists.")
        if not path.endswith(".json"):
            return super().parse(path)
        import json

        try:
            saved = forms.from_dict(json.loads(where.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot be read as a run's saved config ({e}).") from None
        saved.lock()
        return saved


def define_config_flag(required: bool = True, flag_values: flags.FlagValues = flags.FLAGS, sys_argv=None):
    """--config configs/x.py (or a run's config.json), with --config.section.key=value overrides (locked:
    unknown keys fail). `flag_values` and `sys_argv`: another set of flags and its command line (tests)."""
    flag = config_flags.DEFINE_config_file("config", None, "A configs/*.py recipe, or a run's config.json.",
                                           flag_values=flag_values, lock_config=True, sys_argv=sys_argv)  # fmt: skip
    flag_values["config"].parser = _ConfigParser("config", lock_config=True)
    if required:
        flags.mark_flags_as_required(["config"], flag_values=flag_values)
    return flag


def at_least(flag: flags.FlagHolder, low: float, says: str) -> None:
    """Refuse a value of `flag` below `low` as the command line is parsed, before anything loads, in one
    sentence: "--name=value {says}"."""
    flags.register_validator(flag.name, lambda value: value is None or value >= low, message=says)


def config_args(argv: list[str]) -> list[str]:
    """The --config flags of a command line, to hand on to another script (scaling.py's --list)."""
    return [f"--config={config_path()}"] + [a for a in command_line_form(argv) if a.startswith("--config.")]


def say_next(result: dict, cfg, workdir_flag: str | None, argv: list[str]) -> None:
    """What a finished training run says last (process 0): where it is, what it reached, and the three
    commands a user runs next (train on, evaluate, generate), spelt with this command line's config flags."""
    import jax  # imported by now, quietly (parallelism/accelerators.py)

    if jax.process_index() == 0:
        print(_next_commands(result, cfg, workdir_flag, argv), flush=True)


def _next_commands(result: dict, cfg, workdir_flag: str | None, argv: list[str]) -> str:
    workdir = workdir_flag or default_workdir()
    if any(a.startswith("--config.") for a in argv) or config_path().endswith(".json"):
        # The run's own config.json holds every override (and is its workdir's): nothing typed again.
        config_flags_given, where = [f"--config={shlex.quote(posixpath.join(workdir, 'config.json'))}"], []
    else:
        config_flags_given = [f"--config={config_path()}"]
        where = [f"--workdir={shlex.quote(workdir_flag)}"] if workdir_flag else []
    reached = reached_words(result)
    prompt = cfg.train.sample_prompts[0] if cfg.train.sample_prompts else ""
    new_tokens = min(128, cfg.model.max_seq_len // 2)  # within the model's context beside a short prompt
    sample = "--temperature=0.6"  # sampled: a small model's greedy text soon repeats itself
    commands = [
        *((what, "train.py", extra) for what, extra in train_on(cfg)),
        *([("evaluate the newest checkpoint", "eval.py", [])] if cfg.data.format != "preference" else []),
        ("write from it", "generate.py", [f"--prompt={shlex.quote(prompt)}", f"--max_new_tokens={new_tokens}", sample])
        if cfg.data.format == "text"
        else ("talk to it", "generate.py", ["--chat", f"--max_new_tokens={new_tokens}"]),
    ]
    lines = [f"done: {workdir} is at step {result['step']}; {reached}", "next:"]
    for what, script, extra in commands:
        ours = {a.split("=")[0] for a in extra}  # a flag given again here replaces the one given before
        given = [a for a in config_flags_given if a.split("=")[0] not in ours]
        lines.append(f"  python scripts/{script} {' '.join(given + where + extra)}    # {what}")
    return "\n".join(lines)


def reached_words(result: dict) -> str:
    """What a run reached, for its `done:` line: the held-out figures (GRPO's beside where they started), then
    the last logged loss."""
    reached = loss_words(result) if "loss" in result else "nothing logged"
    if "unigram_loss" in result:
        beside = [f"the teacher's {result['eval_loss_teacher']:.4f}"] if "eval_loss_teacher" in result else []
        if "eval_loss_alone" in result:  # the same student trained without the teacher (Run's untaught run)
            gain = result["eval_loss_alone"] - result["eval_loss"]
            beside.append(f"trained alone {result['eval_loss_alone']:.4f} at {result['alone']}: taught, "
                          f"{abs(gain):.4f} {'lower' if gain > 0 else 'higher: the teacher did not help'}")  # fmt: skip
        return (f"validation loss {result['eval_loss']:.4f} ({''.join(b + '; ' for b in beside)}the unigram's "
                f"{result['unigram_loss']:.4f}; {result['eval_covers']}), " + reached)  # fmt: skip
    if "eval_loss" in result:
        return (f"held-out DPO loss {result['eval_loss']:.4f}, reward accuracy {result['eval_dpo/accuracy']:.3f}, "
                + reached)  # fmt: skip
    if "eval_reward" in result:
        figures = [(name, key) for name, key in (("reward", "eval_reward"), ("solved", "eval_solved")) if key in result]
        moved = ", ".join(f"{name} {result[key + '_before']:.4f} -> {result[key]:.4f}" if key + "_before" in result
                          else f"{name} {result[key]:.4f}" for name, key in figures)  # fmt: skip
        since = f" (greedy, from step 0 to {result['step']})" if "eval_reward_before" in result else " (greedy)"
        smoothed = result.get("rl/reward_smoothed")
        rollouts = f"the rollouts' reward {smoothed:.4f} smoothed, " if smoothed is not None else ""
        return f"held-out {moved}{since}, {rollouts}" + reached
    return reached


def train_on(cfg) -> list[tuple[str, list[str]]]:
    """How to go on past train.steps, as (what it does, the flags): to twice the steps, saying what that does
    to a schedule that decays to the end (it stretches, so the learning rate rises again), and then the
    flags that go on at the rate the run ended with instead."""
    from trainer.optim.schedules import make_schedule

    o, steps = cfg.optim, cfg.train.steps
    longer = [f"--config.train.steps={2 * steps}"]
    ended = float(make_schedule(o, steps)(steps - 1))  # the last update's rate
    again = float(make_schedule(o, 2 * steps)(steps))  # the next one's, under the stretched schedule
    if again <= ended * (1 + 1e-6):
        return [("train on, to twice the steps", longer)]
    stretched = (f"train on, to twice the steps: the {o.schedule} schedule then spans {2 * steps} steps, so the "
                 f"learning rate rises again, from {ended:.2e} to {again:.2e}")  # fmt: skip
    if o.schedule in ("cosine", "linear"):  # the same decay, ending where it ended, then held
        held = [f"--config.optim.decay_steps={steps - o.warmup_steps}"]
    else:  # wsd: held at its floor
        held = ["--config.optim.schedule=constant", f"--config.optim.lr={ended:.6g}", "--config.optim.warmup_steps=0"]
    steady = f"train on at the rate it ended with, {ended:.2e}, without re-warming"
    return [(stretched, longer), (steady, longer + held)]


def config_path() -> str:
    return config_flags.get_config_filename(flags.FLAGS["config"])


def default_workdir() -> str:
    """runs/<the config file's name>; for a run's own config.json, that run's workdir."""
    path = config_path()
    if os.path.basename(path) == "config.json":
        return os.path.dirname(path) or "."
    return os.path.join("runs", os.path.splitext(os.path.basename(path))[0])


NUMBER_LISTS = (
    "train.profile_steps",
    "debug.poison_batches",
    "debug.flip_batches",
    "debug.lr_spike",
)  # every other list holds strings


def command_line_form(args: list[str]) -> list[str]:
    """The command line with each list of strings given in the documented comma form
    (`--config.data.mixture=python_stdlib:3,notes:1`) spelt as the tuple the flag parser reads, which takes bare
    words alone (a ':' or a space in an element stops it). A value already in brackets or quotes is left as
    it is (a sample prompt with a comma in it: `--config.train.sample_prompts="('f(a, b',)"`)."""
    lists = {k for k, v in forms.flatten(config.defaults()).items() if isinstance(v, tuple) and k not in NUMBER_LISTS}
    out, args = [], list(args)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.removeprefix("--config.").partition("=")
        if arg.startswith("--config.") and not eq and key in lists and args and not args[0].startswith("-"):
            # absl's `--flag value` form, read as `--flag=value` so that it splits the same way
            arg, eq, value = f"{arg}={args[0]}", "=", args.pop(0)
        if arg.startswith("--config.") and eq and key in lists and not value.startswith(("(", "[", "'", '"')):
            parts = value.split(",") if key == "train.sample_prompts" else [p.strip() for p in value.split(",")]
            arg = f"--config.{key}={tuple(p for p in parts if p)!r}"  # a prompt's spaces are the prompt's
        out.append(arg)
    return out


def apply_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """Parse the command line into `flag_values` as every script does; the arguments left. A list's value is
    the flag parser's own reading after command_line_form: a literal (a saved config's tuples, a bracketed or
    quoted flag) keeps its commas."""
    return flag_values(command_line_form(argv))


def _parse(argv):
    startup.mark("imports")
    for arg in argv[1:]:
        key = arg.removeprefix("--config.").split("=")[0]
        if arg.startswith("--config.") and key in config.RENAMED:
            sys.exit(f"error: --config.{key} {config.renamed_words(key, flag=True)}; use the new name.")
    try:
        rest = apply_flags(argv)
        if "config" in flags.FLAGS:
            flags.FLAGS["config"].value  # noqa: B018 - a recipe that fails to load fails here, in our words
        return rest
    except flags.IllegalFlagValueError as e:  # at_least's refusals: "flag --name=value: says"
        flag, _, says = str(e).removeprefix("flag ").partition(": ")
        typed = [a for a in argv if a.startswith(flag.split("=")[0] + "=")]  # as the user spelt the value
        sys.exit(f"error: {typed[-1] if typed else flag} {says}")
    except flags.UnrecognizedFlagError as e:
        sys.exit(f"error: {_unknown_flag(e.flagname)}")
    except OSError as e:
        # ml_collections' message spans several lines of search attempts; the path is what matters.
        path = e.filename or str(e).split("Attempted [Relative path]:")[-1].split()[0]
        sys.exit(f"error: the config file {path} could not be read; pass --config with a file that exists.")
    except (AttributeError, KeyError, ValueError, TypeError, flags.Error) as e:
        unknown = _unknown_key(argv)
        if unknown:
            sys.exit(f"error: {unknown}")
        detail = " ".join(str(e).replace("\\n", " ").replace("\\", "").replace("'", "").split())
        sys.exit(
            f"error: a command-line flag could not be applied ({detail}); check it against trainer/config/__init__.py."
        )


def _unknown_flag(name: str) -> str:
    """A flag the script does not define, with the script's own flags (the closest first)."""
    import difflib

    script = os.path.basename(sys.argv[0])
    own = sorted({f.name for f in flags.FLAGS.get_key_flags_for_module(sys.argv[0])} | ({"config"} & set(flags.FLAGS)))
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.3)
    mean = f"did you mean --{close[0]}? " if close else ""
    return f"--{name} is not a flag of {script}; {mean}its flags: {', '.join('--' + f for f in own)}."


def _stop(sentence: str, distributed) -> None:
    """End the command on its one sentence: nothing written to stderr after it (last_words.py), the other
    processes of a multi-process run ended with it."""
    last_words.from_now_on()
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    if distributed is not None:  # several processes: the others end now, with this sentence
        distributed.stop_all(sentence)
    sys.exit(1)


def _unknown_key(argv) -> str | None:
    """The first --config.section.key=... that names no key, as a sentence with the nearest known key."""
    import difflib

    known = forms.flatten(config.defaults())
    for arg in argv[1:]:
        key = arg.removeprefix("--config.").split("=")[0]
        if not arg.startswith("--config.") or key in known or any(k.startswith(f"{key}.") for k in known):
            continue
        if key.startswith("mesh.rules."):
            continue  # a rule's name is judged with the rules (validation.py), in its own sentence
        near = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean --config.{near[0]}? " if near else ""
        return f"--config.{key} is not a config key; {hint}(every key: trainer/config/__init__.py)"
    return None


def run(main: Callable[..., None], *, takes_args: bool = False, uses_devices: bool = True) -> None:
    """app.run, with ConfigError and flag errors printed as one `error:` line (exit status 1).

    With `takes_args`, main receives the positional arguments (a sub-command).
    Scripts that use devices first join a multi-process run if one is asked for
    (see parallelism/distributed.py); the planner sets its devices up itself.
    """

    def wrapped(argv):
        if len(argv) > 1 and not takes_args:
            sys.exit(f"error: unexpected arguments {argv[1:]}; options are --flag=value.")
        # Orbax logs every file it renames and TFDS every custom config; our own lines are prints.
        logging.set_verbosity(logging.ERROR)
        # A run that stops on its storage says so in one sentence, with nothing of the libraries' winding down.
        last_words.when_stopping = last_words.from_now_on
        startup.mark("config")
        distributed = None  # scripts that use no devices run in one process
        try:
            if uses_devices:
                from parallelism import distributed

                with accelerators.stderr_held_back():  # the plugins speak as the distributed runtime loads them too
                    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                           _MULTIHOST.value)  # fmt: skip
                accelerators.start()
                startup.mark("distributed")
            main(argv[1:]) if takes_args else main()
        except (ConfigError, TrainingError) as e:
            _stop(str(e), distributed)
        except KeyboardInterrupt:  # Ctrl-C outside the training loop, or a second one inside it
            last_words.from_now_on()
            print("stopped by Ctrl-C, without saving; rerun the same command to resume from the last checkpoint",
                  file=sys.stderr, flush=True)  # fmt: skip
            sys.exit(130)  # the shell's status for a command ended by SIGINT
        except Exception as e:
            if distributed is not None and distributed.runtime_started():
                distributed.wait_if_a_process_died(e)  # a lost or stopped peer: the watchdog names it, ending this
            kind = faults.storage_trouble(e)
            if kind is not None:  # the storage's own answer, met where no read expected it: said, not traced
                fix = ("it kept failing; rerun once it answers" if kind == faults.TRANSIENT else
                       "check the path, the credentials and their permissions, then rerun")  # fmt: skip
                _stop(f"the storage failed ({faults.summary(e)}); the run stopped there; {fix}.", distributed)
            if distributed is not None and distributed.runtime_started():
                traceback.print_exc()
                distributed.stop_all(f"{type(e).__name__}: {' '.join(str(e).split())[:300]} (its log has the trace)")
            raise

    app.run(wrapped, flags_parser=_parse)
