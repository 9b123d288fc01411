"""Other stacks' formats and tools, both ways: Hugging Face checkpoints and tokenizers (huggingface.py, one
module per model family in families/), and EleutherAI's lm-evaluation-harness run on our model
(harness/, with scoring.py's log-likelihoods)."""
