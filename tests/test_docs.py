"""The README and docs/ cannot drift from the code: every command line they show names a script that exists,
flags that script defines, config files that exist and config keys that trainer/config.py declares."""

import glob
import os
import re
import shlex

from conftest import REPO

from trainer.config import defaults, flatten

PAGES = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
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
    """The flags a script defines, with those of the modules it takes them from (trainer/cli.py, and the
    benchmarks' shared helpers)."""
    sources = [script]
    text = open(os.path.join(REPO, script)).read()
    if "from trainer import cli" in text:
        sources.append("trainer/cli.py")
    sources += [f"benchmarks/{name}.py" for name in re.findall(r"^from (\w+) import", text, re.M)
                if os.path.exists(os.path.join(REPO, "benchmarks", f"{name}.py"))]  # fmt: skip
    names = set(ABSL)
    for source in sources:
        names.update(DEFINED.findall(open(os.path.join(REPO, source)).read()))
    if "define_config_flag" in text:
        names.add("config")
    return names


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
        rest = rest.replace("[", " ").replace("]", " ")
        tokens = shlex.split(rest if rest.count('"') % 2 == 0 else rest.replace('"', " "))  # the end of a quoted one
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
                if path != "..." and not os.path.exists(os.path.join(REPO, path)):  # "...": any config
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
