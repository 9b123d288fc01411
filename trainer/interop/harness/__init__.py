"""EleutherAI's lm-evaluation-harness on our checkpoints (trainer/interop/harness/evaluation.py), which needs the `eval`
extra: `load()` imports it, or says in one sentence how to install it."""

from trainer.config.errors import ConfigError


def load():
    """trainer/interop/harness/evaluation.py, imported only where the harness is asked for."""
    try:
        from trainer.interop.harness import evaluation
    except ImportError as e:
        raise ConfigError(
            f'lm-evaluation-harness is not installed ({e}): pip install -e ".[eval]" (scripts/lm_eval.py and '
            "train.harness_tasks need it)."
        ) from None
    return evaluation
