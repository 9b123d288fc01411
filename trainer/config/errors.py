"""Input the user must fix (ConfigError) and runs that cannot go on by themselves (TrainingError)."""

from parallelism.config_error import ConfigError

__all__ = ["ConfigError", "StorageError", "TrainingError"]


class TrainingError(RuntimeError):
    """A run that cannot go on by itself (e.g. it keeps diverging); the message says what to change."""


class StorageError(TrainingError):
    """The storage (or memory) around a run failed, not its files: nothing was moved; rerun once it works."""
