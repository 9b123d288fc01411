"""Our tokenised store's documents, decoded here rather than by TFDS's generic feature decoding.

A text corpus's store (trainer/data/preparation/shards.py) holds, for each document, a tf.Example whose
`tokens` feature is the int32 ids' bytes, zlib-compressed (TFDS's Tensor with Encoding.ZLIB). TFDS's
`deserialize_example_np` walks every feature through its generic machinery: ~110 us a document here, most
of a batch's reading. Taking the raw record (TFDS's own `DeserializeMethod.RAW_BYTES`), parsing it with
TFDS's Example proto and decompressing the one field costs ~60 us, and gives the same array
(tests/test_data.py compares every document of a store with TFDS's decoding).
"""

from __future__ import annotations

import zlib

import numpy as np
from tensorflow_datasets.proto import tf_example_pb2

IDS = np.dtype("<i4")  # TFDS writes an int32 Tensor's bytes as numpy holds them: little-endian on our hosts


class Tokens:
    """One split of a text corpus's tokenised store: `len()` and `[i]` -> {"tokens": int32[n] (read-only),
    "source": bytes (the document's file, as TFDS gives a Text feature)}."""

    def __init__(self, records):
        self._records = records  # tfds.data_source(..., deserialize_method=RAW_BYTES): the serialised Examples

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        features = tf_example_pb2.Example.FromString(self._records[index]).features.feature
        return {
            "tokens": np.frombuffer(zlib.decompress(features["tokens"].bytes_list.value[0]), IDS),
            "source": features["source"].bytes_list.value[0],
        }
