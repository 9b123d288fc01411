"""Text in, packed token batches out: tokenizers, the TFDS corpus builder, the Grain pipeline."""
