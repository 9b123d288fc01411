"""A prepared corpus on disk: a TFDS dataset in array_record shards, read back by `tfds.data_source`.

The corpus `name` lives at <data_dir>/text_files/<name>/1.0.0 (documents' text) and its tokenised store at
<data_dir>/text_files/<name>-tokens/1.0.0 (each document's token ids, begin and end marks included). Each
split has one shard per unit of the preparation (trainer/data/preparation/work.py), named as TFDS
names them (`text_files-train.array_record-00003-of-00016`), so the number of shards is known before any
is written and no shard is ever renamed; a unit with nothing for a split writes an empty shard. Examples
are serialised with TFDS's own serializer for the dataset's features, and `dataset_info.json`, written
last, makes the directory a prepared dataset: TFDS takes a directory without it for an unprepared one.
A text corpus's store also has each shard's ids flat beside it (`<shard>.ids`, trainer/data/readers/store.py),
which training reads by memory map.

ArrayRecord writes local files only: a shard is written to a local temporary file, then moved (or, to a
bucket, copied) to its place.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trainer.storage.workdir import is_remote, shared_mode

TOKENS_SUFFIX = "-tokens"  # the tokenised store of corpus <name> is dataset <name>-tokens
SPLITS = ("train", "validation")
FORMAT = "array_record"


# A store's token features by the corpus's data.format: a conversation's tokens carry their codes
# (trainer/data/chat.py), a preference row's also the prompt with the rejected reply and its codes; a prompts
# row's are its prompt's, rendered up to the reply (its answer stays in the text store).
TOKEN_FEATURES = {"text": ("tokens",), "chat": ("tokens", "turns"),
                  "preference": ("tokens", "turns", "rejected", "rejected_turns"), "prompts": ("tokens",)}  # fmt: skip


@dataclasses.dataclass(eq=False)
class CorpusConfig(tfds.core.BuilderConfig):
    format: str = "text"  # data.format: which token features a tokenised store has


class TextFiles(tfds.core.GeneratorBasedBuilder):
    """Local text files as a TFDS dataset; the builder config name is the corpus name. Its examples are
    written by the preparation pipeline, never by TFDS: the builder gives the dataset its name, place and
    features."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        if self.builder_config.name.endswith(TOKENS_SUFFIX):
            fields = TOKEN_FEATURES[getattr(self.builder_config, "format", "text")]
            ids = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32, encoding=tfds.features.Encoding.ZLIB)
            features = tfds.features.FeaturesDict({**{f: ids() for f in fields}, "source": tfds.features.Text()})
        else:
            features = tfds.features.FeaturesDict({"text": tfds.features.Text(), "source": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        raise NotImplementedError("prepared by trainer/data/preparation/work.py")

    def _generate_examples(self):
        raise NotImplementedError("prepared by trainer/data/preparation/work.py")


def builder(config_name: str, data_dir: str, format: str = "text") -> TextFiles:
    config = CorpusConfig(name=config_name, description="text files", format=format)
    return TextFiles(config=config, data_dir=data_dir, file_format=FORMAT)


@functools.cache
def _features(tokens: bool, format: str) -> tfds.features.FeaturesDict:
    return builder("features" + TOKENS_SUFFIX * tokens, tempfile.gettempdir(), format).info.features


def version_dir(data_dir: str, config_name: str) -> epath.Path:
    return epath.Path(data_dir) / "text_files" / config_name / str(TextFiles.VERSION)


def _template(directory: str, split: str) -> tfds.core.ShardedFileTemplate:
    return tfds.core.ShardedFileTemplate(data_dir=epath.Path(directory), dataset_name="text_files", split=split,
                                         filetype_suffix=FORMAT)  # fmt: skip


class ShardWriter:
    """One unit's shard of one split of one dataset: examples appended, then `close()` puts it in place. A text
    corpus's tokenised store also gets the shard's ids flat beside it (readers/store.py)."""

    def __init__(self, config_name: str, directory: str, split: str, unit: int, units: int, format: str = "text"):
        from array_record.python.array_record_module import ArrayRecordWriter
        from tensorflow_datasets.core import example_serializer

        from trainer.data.readers.store import FLAT_SUFFIX, FlatWriter

        self.features = _features(config_name.endswith(TOKENS_SUFFIX), format)
        self._serializer = example_serializer.ExampleSerializer(self.features.get_serialized_info())
        self.target = os.fspath(_template(directory, split).sharded_filepath(shard_index=unit, num_shards=units))
        self._local = tempfile.NamedTemporaryFile(prefix="trainer-shard-", delete=False)  # noqa: SIM115
        self._local.close()
        self._writer = ArrayRecordWriter(self._local.name, "group_size:1")  # random access by index
        self.count = self.bytes = 0
        self._places, self._flat = [(self._local.name, self.target)], None
        if config_name.endswith(TOKENS_SUFFIX) and format == "text":
            self._flat = FlatWriter(self._local.name + FLAT_SUFFIX)
            self._places.append((self._local.name + FLAT_SUFFIX, self.target + FLAT_SUFFIX))

    def write(self, example: dict) -> None:
        record = self._serializer.serialize_example(self.features.encode_example(example))
        self._writer.write(record)
        if self._flat is not None:
            self._flat.write(example["tokens"])
        self.count, self.bytes = self.count + 1, self.bytes + len(record)

    def close(self) -> None:
        self._writer.close()
        if self._flat is not None:
            self._flat.close()
        for local, target in self._places:
            shared_mode(local)  # made by NamedTemporaryFile (0600); moved or copied with its mode
            if is_remote(target):
                import fsspec

                fsspec.filesystem("gcs").put_file(local, target)
                os.remove(local)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.move(local, target)

    def discard(self) -> None:
        self._writer.close()
        if self._flat is not None:
            self._flat.close()
        for local, _ in self._places:
            os.remove(local)


def write_info(config_name: str, directory: str, lengths: dict[str, list[int]], sizes: dict[str, int],
               format: str = "text") -> None:  # fmt: skip
    """dataset_info.json (and features.json) for the shards written to `directory`: what makes it a prepared
    dataset, so it is written last."""
    info = builder(config_name, tempfile.gettempdir(), format).info
    splits = [tfds.core.SplitInfo(name=split, shard_lengths=lengths[split], num_bytes=sizes[split],
                                  filename_template=_template(directory, split)) for split in SPLITS]  # fmt: skip
    info.set_splits(tfds.core.SplitDict(splits))
    info.write_to_directory(epath.Path(directory))
