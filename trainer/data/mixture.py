"""data.mixture: which prepared corpora a run trains on, and by what weight (read in trainer/data/streams.py),
and the shares each gave (logged by the loop).

Kept apart from the streams so that checking a config does not import the data libraries.
"""

from __future__ import annotations

from trainer.config.errors import ConfigError


def parse_mixture(entries) -> tuple[tuple[str, float], ...]:
    """data.mixture ("corpus:weight", ...) as ((corpus, weight), ...), refusing what cannot be drawn from."""
    mixture = []
    for entry in entries:
        name, _, weight = str(entry).rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not name or not value >= 0:
            raise ConfigError(
                f"data.mixture entry {entry!r} must be 'corpus:weight' with a weight >= 0, e.g. "
                "--config.data.mixture=python_stdlib:0.7,docs:0.3."
            )
        mixture.append((name, value))
    if mixture and sum(w for _, w in mixture) <= 0:
        raise ConfigError(f"data.mixture={tuple(entries)!r}: the weights must sum to a positive number.")
    if len({name for name, _ in mixture}) < len(mixture):
        raise ConfigError(f"data.mixture={tuple(entries)!r} names a corpus twice; give each once, with its weight.")
    return tuple(mixture)


def mixture_shares(mixture: tuple[tuple[str, float], ...], taken) -> dict[str, float]:
    """`mixture/<corpus>`: each corpus's share of what was trained on since this launch (`taken`, summed from
    mixture_counts over this process's rows up to the step just dispatched), in the mixture's unit."""
    total = taken.sum()
    if not total:
        return {}
    return {f"mixture/{name}": float(n / total) for (name, _), n in zip(mixture, taken, strict=True)}
