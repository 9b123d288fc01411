"""The README and docs/ cannot drift from the code: every command line they show names a script that exists,
flags that script defines, config files that exist and config keys that trainer/config/__init__.py declares."""

import glob
import os
import re
import shlex

from conftest import REPO

from trainer.config import defaults
from trainer.config.forms import flatten

# The pages, and the configs, whose docstrings are the commands that run them.
PAGES = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))),
         *sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))]  # fmt: skip
SAVED = re.compile(r"runs/[\w.-]+/config\.json")  # a run's saved config, which every script takes as --config
COMMAND = re.compile(r"python ((?:scripts|benchmarks)/\w+\.py)")
DEFINED = re.compile(r"""(?:DEFINE_\w+|add_argument)\(\s*(?:"-\w", )?"-*(\w+)\"""")
# absl's own flags, which every script takes
ABSL = {"help", "helpfull", "helpshort", "flagfile"}


def commands() -> list[tuple[str, str, str]]:
    """(page:line, script, its arguments) for every `python scripts/... ` or `python benchmarks/...` shown,
    in code blocks and in inline code; a command ends at a comment, a backtick or the next command."""
    found = []
    for page in PAGES:
        for n, line in enumerate(open(page).read().replace("\\\n", " ").splitlines(), 1):
            starts = list(COMMAND.finditer(line))
            for i, m in enumerate(starts):
                end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
                rest = re.split(r"`|  #|\|", line[m.end() : end])[0]
                found.append((f"{os.path.relpath(page, REPO)}:{n}", m.group(1), rest.removesuffix(" -- ")))
    return found


def flags_of(script: str) -> set[str]:
    """The flags a script defines, with those of the modules it takes them from (trainer/run/cli.py, and the
    benchmarks' shared helpers)."""
    sources = [script]
    text = open(os.path.join(REPO, script)).read()
    if "from trainer.run import cli" in text:
        sources.append("trainer/run/cli.py")
    sources += [f"benchmarks/{name}.py" for name in re.findall(r"^from (\w+) import", text, re.M)
                if os.path.exists(os.path.join(REPO, "benchmarks", f"{name}.py"))]  # fmt: skip
    names = set(ABSL)
    for source in sources:
        names.update(DEFINED.findall(open(os.path.join(REPO, source)).read()))
    if "define_config_flag" in text:
        names.add("config")
    return names


def tokens_of(rest: str) -> list[str]:
    """A shown command's arguments, as the shell splits them ([optional] brackets dropped)."""
    rest = rest.replace("[", " ").replace("]", " ")
    return shlex.split(rest if rest.count('"') % 2 == 0 else rest.replace('"', " "))  # the end of a quoted one


def test_every_command_in_the_readme_and_docs_exists_with_its_flags():
    keys = flatten(defaults())
    shown = commands()
    assert len(shown) > 50 and {"README.md", "docs/planning.md"} <= {w.split(":")[0] for w, _, _ in shown}
    wrong = []
    for where, script, rest in shown:
        if not os.path.exists(os.path.join(REPO, script)):
            wrong.append(f"{where}: {script} does not exist")
            continue
        defined = flags_of(script)
        tokens = tokens_of(rest)
        for i, token in enumerate(tokens):
            if not token.startswith("--") or token == "--":
                continue
            name = token[2:].split("=")[0]
            if name.startswith("config."):
                key = name.removeprefix("config.")
                if key not in keys and not any(k.startswith(key + ".") for k in keys):
                    wrong.append(f"{where}: {script} --{name}: no such config key")
            elif name not in defined and not (name.startswith("no") and name[2:] in defined):
                wrong.append(f"{where}: {script} has no flag --{name}")
            if name == "config":
                path = token.split("=", 1)[1] if "=" in token else (tokens[i + 1 :] or ["(nothing)"])[0]
                if path != "..." and not SAVED.fullmatch(path) and not os.path.exists(os.path.join(REPO, path)):
                    wrong.append(f"{where}: the config {path} does not exist")
    assert not wrong, "\n".join(wrong)


def test_every_config_key_the_pages_name_exists():
    """`--config.key` anywhere in the pages, prose included (a renamed key must be renamed there too)."""
    keys = flatten(defaults())
    named = [(os.path.relpath(p, REPO), k) for p in PAGES for k in re.findall(r"--config\.([\w.]+\w)", open(p).read())]
    assert len(named) > 50
    unknown = [f"{page}: --config.{k}" for page, k in named if k not in keys and not any(x.startswith(k + ".")
                                                                                          for x in keys)]  # fmt: skip
    assert not unknown, "\n".join(unknown)


def test_every_documented_override_applies_to_its_config():
    """Each shown command's --config.* overrides, parsed as the scripts parse them (trainer/run/cli.py) onto its
    config file (tiny's where it shows "..."): a documented form the flag parser cannot read fails here."""
    from absl import flags

    from trainer.run.cli import apply_flags, define_config_flag

    # and every `--config.key=value` in the prose, on its own
    prose = [(os.path.relpath(p, REPO), f"--config ... {m}") for p in PAGES
             for m in re.findall(r"`(--config\.[\w.]+\w=[^`\s]*)`", open(p).read())]  # fmt: skip
    wrong, applied = [], 0
    for where, rest in [(where, rest) for where, _, rest in commands()] + prose:
        tokens = tokens_of(rest)
        overrides = [t for t in tokens if t.startswith("--config.")]
        paths = [t.split("=", 1)[1] if "=" in t else (tokens[i + 1 :] or ["..."])[0]
                 for i, t in enumerate(tokens) if t == "--config" or t.startswith("--config=")]  # fmt: skip
        if not overrides:
            continue
        path = paths[0] if paths and paths[0] != "..." and not SAVED.fullmatch(paths[0]) else "configs/tiny.py"
        values = flags.FlagValues()
        argv = ["prog", f"--config={os.path.join(REPO, path)}", *overrides]
        define_config_flag(flag_values=values, sys_argv=argv)
        try:
            apply_flags(argv, values)
            applied += 1
        except Exception as e:  # noqa: BLE001 - any failure to apply is the finding
            wrong.append(f"{where}: {' '.join(overrides)}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    assert applied > 30 and not wrong, "\n".join(wrong)
