"""The run directory: where its checkpoints live, its resolved config, whether it is writable, and the
files that grow while it runs.

A workdir is a local path or a bucket (`gs://bucket/run`): every path in it
goes through `etils.epath`, Orbax's own path type (gcsfs underneath for
`gs://`), and the checkpoints' arrays through TensorStore. What may change
when a run resumes is decided in trainer/training/resume.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

from etils import epath

from trainer.config.errors import ConfigError
from trainer.config.forms import to_json
from trainer.storage import faults

CONFIG_FILE = "config.json"
RUN_FILE = "run.json"  # the run's identity: what its local checkpoints are recorded as belonging to
CHECKPOINT_DIR = "checkpoints"
BUCKET = "gs://"


def is_remote(location) -> bool:
    return str(location).startswith(BUCKET)


def shared_mode(local_file: str) -> None:
    """Give a file that a library made private (a temporary file's or safetensors' 0600) the mode that the
    user's umask gives every other file: a team's shared corpus or model directory must be readable."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(local_file, 0o666 & ~mask)


def path(location) -> epath.Path:
    """A location as a path: a bucket's as given, a local one made absolute (Orbax wants it so)."""
    location = str(location)
    if "://" in location and not is_remote(location):
        raise ConfigError(f"{location}: only local paths and {BUCKET} buckets are supported as run directories.")
    return epath.Path(location if is_remote(location) else os.path.abspath(location))


def wait_for_storage(location: str, seconds: float, say, setting: str = "--workdir") -> None:
    """That a bucket's storage answers, before anything else is read or written there: a bucket that
    answers 429 or 5xx is waited for (with backoff, for up to `seconds`); one that refuses, or does not
    exist, stops the run in one sentence naming the `setting` that gave it."""
    if not is_remote(location):
        return
    bucket = path(BUCKET + str(location)[len(BUCKET) :].split("/")[0])
    try:
        faults.retrying(f"reading {bucket}", lambda: next(iter(bucket.iterdir()), None), seconds, say)
    except FileNotFoundError as e:
        raise ConfigError(f"the bucket {bucket} does not exist; create it, or choose another {setting}.") from e


def at_step(text: str, key: str) -> tuple[str, int | None]:
    """A config value naming a run's checkpoint, 'DIR' or 'DIR@STEP', as (DIR, STEP or None); `key` is the
    config key it came from, for the sentence that refuses another form."""
    path, _, step = text.rpartition("@") if "@" in text else (text, "", "")
    if step and not step.isdigit():
        raise ConfigError(f"{key}={text!r} must be DIR or DIR@STEP with STEP a number.")
    return path, int(step) if step else None


def checkpoint_dir(workdir: str) -> str:
    return str(path(workdir) / CHECKPOINT_DIR)


def saved_steps(workdir: str) -> list[int]:
    """Steps of the complete checkpoints under the workdir, from the directory listing alone.

    Orbax marks a checkpoint complete by renaming its temporary directory to the
    step number (local disks) or by writing commit_success.txt last (buckets,
    which cannot rename); its own listing knows both. No Orbax manager is made
    here: its constructor synchronises all processes, and each process decides
    for itself whether to look.
    """
    import orbax.checkpoint as ocp

    return sorted(ocp.step.checkpoint_steps(checkpoint_dir(workdir)))


def saved_config(workdir: str) -> dict | None:
    import json

    file = path(workdir) / CONFIG_FILE
    return json.loads(file.read_text()) if file.exists() else None


def run_id(workdir: str) -> str | None:
    """The identity of the run that lives in `workdir`, given at its first start; None before that (a new
    run, or a workdir deleted and made again, which is a new run too)."""
    import json

    file = path(workdir) / RUN_FILE
    return json.loads(file.read_text())["id"] if file.exists() else None


def write_run_id(workdir: str, run: str) -> None:
    import json

    write_file(path(workdir) / RUN_FILE, json.dumps({"id": run}))


def try_writing(directory) -> None:
    """Write and remove a small file in `directory` (made if need be); raises OSError where that fails.
    One probe per process: several processes check the same shared directory at once."""
    import jax

    probe = path(directory) / f".write_probe_{jax.process_index()}"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()


def check_writable(workdir: str) -> None:
    """Create the workdir and its checkpoint directory now, so a bad path fails before training, not after."""
    try:
        try_writing(checkpoint_dir(workdir))
    except OSError as e:
        raise ConfigError(
            f"cannot write checkpoints under {workdir} ({e.strerror or e}); choose a writable --workdir."
        ) from e


def write_file(location, content: str | bytes) -> None:
    """Write a whole file that no reader sees half-written: a bucket replaces an object whole; a local file
    is written beside its name and renamed over it."""
    file = path(location)
    file.parent.mkdir(parents=True, exist_ok=True)
    target = file if is_remote(location) else file.parent / (file.name + ".tmp")
    target.write_bytes(content.encode() if isinstance(content, str) else content)
    if target != file:
        target.replace(file)


def move(source: epath.Path, target: epath.Path) -> None:
    """Move a checkpoint's directory so that an interruption at any point leaves one whole copy that nothing
    cleans away. A local directory is renamed (atomic). A bucket has no directories and no rename: every
    object is copied, each copy checked against its original (size and CRC32C), then the original's
    commit markers are deleted first, taking it out of Orbax's listing, and its other objects last."""
    if not is_remote(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return
    import fsspec

    fs = fsspec.filesystem("gcs")
    fs.invalidate_cache()
    src, dst = str(source).removeprefix(BUCKET).rstrip("/"), str(target).removeprefix(BUCKET).rstrip("/")
    names = sorted(fs.find(src))
    for name in names:
        fs.cp_file(name, dst + name[len(src) :])
    fs.invalidate_cache()
    for name in names:
        have, copy = fs.info(name), fs.info(dst + name[len(src) :])
        if (have["size"], have.get("crc32c")) != (copy["size"], copy.get("crc32c")):
            raise OSError(f"the copy of {BUCKET}{name} in {target} differs from it; {source} is left in place")
    markers = [n for n in names if n.endswith("/commit_success.txt")]
    for name in sorted(markers, key=len) + [n for n in names if n not in markers]:  # the checkpoint's own first
        fs.rm_file(name)


def forget_listings(location) -> None:
    """Drop the bucket listings this process holds. gcsfs keeps every listing it made (for etils.epath,
    so for Orbax too) and never learns what other processes changed: after a checkpoint is moved away,
    Orbax would still find it and refuse to save that step again ("Checkpoint for step 3 already exists")."""
    if is_remote(location):
        import fsspec

        fsspec.filesystem("gcs", finalize_on_close=True).invalidate_cache()  # the instance epath uses


def write_config(workdir: str, cfg) -> None:
    write_file(path(workdir) / CONFIG_FILE, to_json(cfg))


class GrowingFiles:
    """Where the files that grow during a run are written: metrics.jsonl, TensorBoard's events, a profile.

    A local workdir takes them in place. A bucket cannot append to an object,
    and TensorBoard's writer, given a `gs://` directory, replaces its event file
    at each flush (tried: only the newest record survived). So for a bucket they
    are written into a local directory, and a background thread copies each file
    that changed whole into the workdir every `every` seconds, when `sync()` is
    called (at each checkpoint) and at `close()`. A process killed loses at most
    what it wrote since the last copy; what was copied is always whole files.
    """

    def __init__(self, workdir: str, every: float = 30.0):
        self.remote = path(workdir) if is_remote(workdir) else None
        self.dir = tempfile.mkdtemp(prefix="trainer-run-") if self.remote else str(path(workdir))
        os.makedirs(self.dir, exist_ok=True)
        self._copied: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) when it was last copied
        self._now, self._closing = threading.Event(), False
        self._thread = None
        if self.remote:
            self._thread = threading.Thread(target=self._copy_every, args=(every,), daemon=True)
            self._thread.start()

    def fetch(self, name: str) -> str:
        """The local path of the workdir's file `name`, brought down first from a bucket if it is there."""
        local = os.path.join(self.dir, name)
        if self.remote and (self.remote / name).exists() and not os.path.exists(local):
            with open(local, "wb") as f:
                f.write((self.remote / name).read_bytes())
            st = os.stat(local)
            self._copied[name] = (st.st_size, st.st_mtime_ns)
        return local

    def sync(self) -> None:
        """Copy what changed now (in the background), e.g. when a checkpoint is saved."""
        self._now.set()

    def close(self) -> None:
        if self.remote:
            self._closing = True
            self._now.set()
            self._thread.join()
            self._copy_changed()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _copy_every(self, every: float) -> None:
        while not self._closing:
            self._now.wait(every)
            self._now.clear()
            try:
                self._copy_changed()
            except Exception as e:  # a failed copy is retried at the next one; training goes on
                print(f"warning: copying run files to {self.remote} failed ({e}); retrying", flush=True)

    def _copy_changed(self) -> None:
        for root, _, names in os.walk(self.dir):
            for name in names:
                local = os.path.join(root, name)
                relative = os.path.relpath(local, self.dir)
                st = os.stat(local)
                if self._copied.get(relative) == (st.st_size, st.st_mtime_ns):
                    continue
                with open(local, "rb") as f:
                    data = f.read()
                target = self.remote / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                self._copied[relative] = (st.st_size, st.st_mtime_ns)
