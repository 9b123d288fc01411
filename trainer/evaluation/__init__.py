"""Evaluation: the held-out loss (in the loop and of a checkpoint), samples, a run's report."""
