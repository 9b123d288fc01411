"""Rewards a program can check, for reinforcement learning (rl.reward): each is called as
f(prompt, completion, answer) -> float on one completion, and several add, with rl.reward_weights.

    exact    1 if the completion's final answer equals the row's answer after normalisation, else 0.
             The final answer is the text after the completion's last "ANSWER:" (any case), or its last
             non-empty line where it has none. Normalised: surrounding whitespace and quotes and a final
             period dropped, inner whitespace made single spaces, lower case. A number (the answer, or a
             final answer that reads as one, commas between thousands allowed) equals another within 1e-6
             of it; a list answer is a list of accepted answers.
    similar  partial credit for a string answer: 1 - (the edit distance between the normalised final answer
             and the answer's) / (the longer's length); 1 where exact is. A list answer: the best of them.
    format   1 if the completion matches rl.format_regex (Python's re.search), else 0.
    module:function   a function of the user's, imported from a module on the Python path.

A reward that cannot be imported is refused before anything compiles; one that raises, or returns what is not
a finite number, stops the run with a sentence naming the prompt's row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable

from trainer.config.errors import ConfigError

BUILT_IN = ("exact", "similar", "format")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)


def final_answer(completion: str) -> str:
    """The part of a completion the exact reward compares (see the module's docstring)."""
    found = list(_ANSWER.finditer(completion))
    if found:
        return completion[found[-1].end() :]
    lines = [line for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalised(text) -> str:
    text = " ".join(str(text).split()).strip("\"'` ")
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text.lower()


def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def exact(prompt, completion: str, answer) -> float:
    said = normalised(final_answer(completion))
    for accepted in answer if isinstance(answer, list) else [answer]:
        want = normalised(accepted)
        if want == said:
            return 1.0
        a, b = _number(said), _number(want)
        if a is not None and b is not None and abs(a - b) <= 1e-6:
            return 1.0
    return 0.0


def similar(prompt, completion: str, answer) -> float:
    said = normalised(final_answer(completion))
    return max(_similarity(said, normalised(a)) for a in (answer if isinstance(answer, list) else [answer]))


def _similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    row = list(range(len(b) + 1))  # Levenshtein's, one row at a time
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return 1.0 - row[-1] / max(len(a), len(b))


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    weight: float
    fn: Callable


def load(rl) -> list[Reward]:
    """rl.reward and rl.reward_weights as callables, or one sentence for a reward that cannot be had."""
    names = [n.strip() for n in rl.reward.split(",") if n.strip()]
    if not names:
        raise ConfigError("rl.reward names no reward; give exact, format, or module:function (a comma list adds).")
    weights = [w.strip() for w in rl.reward_weights.split(",") if w.strip()] if rl.reward_weights else []
    if weights and len(weights) != len(names):
        raise ConfigError(f"rl.reward_weights gives {len(weights)} weights for {len(names)} rewards "
                          f"({','.join(names)}); give one each, or none for weights of 1.")  # fmt: skip
    try:
        weights = [float(w) for w in weights] or [1.0] * len(names)
    except ValueError:
        raise ConfigError(f"rl.reward_weights={rl.reward_weights!r} is not a comma list of numbers.") from None
    out = []
    for name, weight in zip(names, weights, strict=True):
        if name in ("exact", "similar"):
            fn = exact if name == "exact" else similar
        elif name == "format":
            fn = _format(rl.format_regex)
        elif ":" in name:
            fn = _imported(name)
        else:
            raise ConfigError(f"rl.reward names {name!r}, which is neither a built-in reward ({', '.join(BUILT_IN)}) "
                              "nor module:function.")  # fmt: skip
        out.append(Reward(name, weight, fn))
    return out


def _format(regex: str) -> Callable:
    if not regex:
        raise ConfigError("rl.reward names format, which needs the pattern a completion must match: give "
                          "--config.rl.format_regex=PATTERN.")  # fmt: skip
    try:
        pattern = re.compile(regex)
    except re.error as e:
        raise ConfigError(f"rl.format_regex={regex!r} is not a regular expression ({e}).") from None
    return lambda prompt, completion, answer: float(pattern.search(completion) is not None)


def _imported(name: str) -> Callable:
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:
        raise ConfigError(
            f"rl.reward names {name}, which cannot be imported ({type(e).__name__}: {e}); put its "
            "module on the Python path (PYTHONPATH) and check the function's name."
        ) from None
    if not callable(fn):
        raise ConfigError(f"rl.reward names {name}, which is not a function.")
    return fn


def score(rewards: list[Reward], prompt, completion: str, answer, where: str) -> list[float]:
    """Each reward of one completion (unweighted), or one sentence naming the row (`where`) for a reward that
    raises or returns what is not a finite number."""
    out = []
    for r in rewards:
        try:
            value = r.fn(prompt, completion, answer)
        except Exception as e:
            raise ConfigError(f"the reward {r.name} raised {type(e).__name__} ({e}) on {where}; fix the function, "
                              "or the row.") from None  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"the reward {r.name} returned {value!r} on {where}, not a finite number.")
        out.append(float(value))
    return out
