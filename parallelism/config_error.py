"""The one exception type for input the user must fix.

It lives here, in the lower of the two packages, because both raise it:
parallelism/ refuses meshes and rules that cannot work, trainer/ everything
else. trainer/config/errors.py imports it from here; parallelism/ imports nothing
from trainer/.
"""


class ConfigError(ValueError):
    """A config, mesh, dataset or checkpoint that cannot work; the message says how to fix it."""
