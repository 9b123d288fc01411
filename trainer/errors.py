"""The one exception type for input the user must fix."""


class ConfigError(ValueError):
    """A config, mesh, dataset or checkpoint that cannot work; the message says how to fix it."""
