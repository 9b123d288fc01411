"""Input the user must fix (ConfigError) and runs that cannot go on by themselves (TrainingError)."""

from parallelism.errors import ConfigError

__all__ = ["ConfigError", "TrainingError"]


class TrainingError(RuntimeError):
    """A run that cannot go on by itself (e.g. it keeps diverging); the message says what to change."""
