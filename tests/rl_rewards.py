"""User rewards for tests/test_grpo.py, imported by name (rl.reward=rl_rewards:NAME) as a user's are."""


def variety(prompt, completion, answer):
    """Graded, so that an untrained model's completions differ: the count of distinct characters, over 10."""
    return len(set(completion)) / 10


def raises(prompt, completion, answer):
    raise ValueError("no reward today")


def text(prompt, completion, answer):
    return "yes"
