"""A config's forms: a run's saved config.json given back with --config comes back exactly as it was written,
every key and type, on every recipe; the command line's list forms read as documented."""

import glob
import json
import os

import pytest
from absl import flags
from conftest import REPO

from trainer.config.forms import flatten, from_dict, from_file
from trainer.run import cli
from trainer.storage import workdir as wd

# Values a user's strings hold: commas, quotes, brackets, spaces at the ends, an empty one.
AWKWARD = ("def add(a, b):", " import ", "it's \"quoted\", isn't it", "[1, 2] (3)", "a,b", "")


def parsed(argv: list[str]):
    """The config the scripts get from this command line (trainer/run/cli.py's parsing)."""
    values = flags.FlagValues()
    holder = cli.define_config_flag(flag_values=values, sys_argv=argv)
    cli.apply_flags(argv, values)
    return holder.value


def typed(value):
    """A value with the type of every part spelt out: 1 and 1.0, ('a',) and ['a'] differ."""
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(typed(v) for v in value)
    return type(value).__name__, value


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))), ids=os.path.basename)
def test_a_saved_config_comes_back_exactly_as_it_was_written(recipe, tmp_path):
    cfg = from_file(recipe)
    awkward = {}
    for key, value in flatten(cfg).items():
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value) and key not in cli.NUMBER_LISTS:
            awkward[key] = AWKWARD
        elif isinstance(value, str) and key == "data.paths":
            awkward[key] = AWKWARD[0]  # a glob's text as typed
    assert "train.sample_prompts" in awkward and "mesh.rules.batch" in awkward
    for key, value in awkward.items():
        section, _, name = key.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = node[part]
        node[name] = value
    wd.write_config(str(tmp_path), cfg)
    back = parsed(["prog", f"--config={tmp_path / 'config.json'}"])
    want, got = flatten(cfg), flatten(back)
    assert got.keys() == want.keys()
    differ = {k: (want[k], got[k]) for k in want if typed(want[k]) != typed(got[k])}
    assert not differ, differ


def test_the_command_lines_list_forms_read_as_documented(tmp_path):
    """The comma form splits at commas (a prompt keeps its spaces); the bracketed and quoted forms are Python's
    literals, commas and all, on a recipe and on a saved config alike."""
    wd.write_config(str(tmp_path), from_file(os.path.join(REPO, "configs", "tiny.py")))
    for config in ("configs/tiny.py", str(tmp_path / "config.json")):
        for flag, want in (
            ("--config.train.sample_prompts=def ,import ", ("def ", "import ")),
            ("--config.train.sample_prompts=('def add(a, b):', 'import ')", ("def add(a, b):", "import ")),
            ("--config.train.sample_prompts=['x, y']", ("x, y",)),
            ("--config.train.sample_prompts='a, b'", ("a, b",)),
            ("--config.train.sample_prompts=", ()),
            ("--config.data.mixture=python_stdlib:3, notes:1", ("python_stdlib:3", "notes:1")),
            ("--config.mesh.rules.batch=data,fsdp", ("data", "fsdp")),
            ("--config.model.lora.targets=q,v", ("q", "v")),
        ):
            key, _, value = flag.removeprefix("--config.").partition("=")
            for form in ([flag], [f"--config.{key}", value]):  # absl reads `--flag value` as `--flag=value`
                if form[-1].startswith("-"):
                    continue  # a value that looks like a flag takes the `=` form, in absl as here
                cfg = parsed(["prog", f"--config={os.path.join(REPO, config)}", *form])
                assert flatten(cfg)[key] == want, (config, form)


def test_an_older_runs_renamed_keys_read_under_their_new_names(tmp_path):
    """train.microbatches became train.pipeline_microbatches; distill.temperature, which both divided the
    divergence's logits and sampled, became two keys, and an older run's value is read into both."""
    cfg = from_file(os.path.join(REPO, "configs", "distill_tiny.py"))
    wd.write_config(str(tmp_path), cfg)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["distill"]["divergence_temperature"], saved["distill"]["sample_temperature"]
    saved["distill"]["temperature"], saved["train"]["microbatches"] = 2.0, 4
    del saved["train"]["pipeline_microbatches"]
    back = from_dict(saved)
    assert (back.distill.divergence_temperature, back.distill.sample_temperature) == (2.0, 2.0)
    assert back.train.pipeline_microbatches == 4
