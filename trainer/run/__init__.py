"""A run's life: the command line, the checks before a step, the loop, and recovery from what stops it."""
