"""The one exception type for input the user must fix."""


class ConfigError(ValueError):
    """A config, mesh, dataset or checkpoint that cannot work; the message says how to fix it."""


class TrainingError(RuntimeError):
    """A run that cannot go on by itself (e.g. it keeps diverging); the message says what to change."""
