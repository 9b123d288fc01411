"""A config's other forms: flat ("section.key": value), JSON, a recipe file, a run's saved config.json; and
a copy with some keys changed."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping

import ml_collections

from trainer.config import BEFORE, RENAMED, defaults


def _walk(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, Mapping)):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def to_json(cfg: ml_collections.ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def flatten(cfg) -> dict[str, object]:
    """{"section.key": value} for every key (nested dicts such as mesh.rules flattened too)."""
    return dict(_walk(cfg))


def with_changes(cfg: ml_collections.ConfigDict, changes: Mapping[str, object], in_place: bool = False):
    """`cfg` (a copy, unless `in_place`) with dotted keys changed: with_changes(cfg, {"optim.lr": 1e-3})."""
    out = cfg if in_place else copy.deepcopy(cfg)
    for key, value in changes.items():
        *parents, name = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node[name] = value
    return out


def from_file(path: str) -> ml_collections.ConfigDict:
    """The config a file under configs/ (or any of its form) returns from get_config()."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def from_dict(saved: Mapping) -> ml_collections.ConfigDict:
    """A config from a saved config.json: today's defaults, overwritten by every key the file knows.

    Renamed keys are read under their new names; keys an older trainer wrote
    and this one no longer has are dropped; keys it did not have yet keep their
    defaults, or what its runs did before them (BEFORE); JSON's lists become the
    tuples they were.
    """
    known = flatten(defaults())
    values = {**BEFORE, **{new: v for k, v in _walk(saved) for new in RENAMED.get(k, (k,))}}
    values = {k: _as_tuple(v) if isinstance(known[k], tuple) else v for k, v in values.items() if k in known}
    # A flag that became a label (checkpoint.reset_optimizer): true is the label "true".
    values = {k: ("true" if v else "") if isinstance(known[k], str) and isinstance(v, bool) else v
              for k, v in values.items()}  # fmt: skip
    return with_changes(defaults(), values)


def _as_tuple(value) -> tuple:
    """A list from JSON, or the comma-separated string an older trainer kept a list in."""
    if not isinstance(value, str):
        return tuple(value)

    def parsed(part):
        for kind in (int, float):
            try:
                return kind(part)
            except ValueError:
                pass
        return part

    return tuple(parsed(p.strip()) for p in value.split(",") if p.strip())
