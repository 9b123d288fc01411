"""Compiled programs kept between launches: JAX's persistent compilation cache in `train.compile_cache`.

A relaunch of the same command finds its train step, evaluation and decoding
programs there and loads them instead of compiling. JAX keys each entry by the
program (its canonical StableHLO, locations stripped), the compile options,
the devices, XLA's flags and the jax, jaxlib and backend versions; so two runs
of the same model in different workdirs share entries, and a cache written by
another jax or libtpu never matches. The default, `../compile_cache`, is beside
the workdir: every launch of a job finds it, local or in a bucket, and the runs
of one directory share it. JAX writes from process 0 only, so on a pod a bucket
(or the default beside a bucket workdir) warms every host; a host's own disk
warms host 0 alone.

JAX's own store (jax/_src/lru_cache.py, jax 0.10.2) writes an entry in place,
where a reader in another process can meet it half-written, and a damaged entry
gives a warning per program. Entries here are written whole (a temporary file
renamed, or one object in a bucket) with a digest in front: an entry that is
damaged, or not ours, or that this jax cannot load is compiled afresh and said
once. The cache never stops a run: if its storage fails, the run goes on without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import threading
import uuid
import warnings
import zlib
from collections.abc import Callable
from importlib import metadata

import jax
from jax._src import compilation_cache as jax_cache
from jax._src.compilation_cache_interface import CacheInterface

from trainer.storage import faults
from trainer.storage import workdir as wd

DEFAULT = "../compile_cache"
_MAGIC = b"trainer compiled program 1\n"
_DIGEST = 32
# Not JAX's own "-cache": its store and this one can share a directory without reading each other's entries.
_SUFFIX = "-kept"
# JAX warns for each program whose entry it could not load; Kept says it once instead.
_JAX_WARNINGS = r"Error (reading|writing) persistent compilation cache entry"


def place(setting: str, workdir: str | None) -> str | None:
    """The cache's directory for `train.compile_cache` ("" = none): a relative path is taken from the workdir
    (from the current directory where a command has none), `~` is the home directory. The default gives way
    to JAX's own variable, JAX_COMPILATION_CACHE_DIR, where the environment sets it."""
    if not setting:
        return None
    if setting == DEFAULT and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if wd.is_remote(setting) or os.path.isabs(os.path.expanduser(setting)):
        return os.path.expanduser(setting) if not wd.is_remote(setting) else setting
    base = workdir if workdir is not None else os.getcwd()
    if not wd.is_remote(base):
        return os.path.normpath(os.path.join(os.path.abspath(base), setting))
    bucket, _, inside = base[len(wd.BUCKET) :].partition("/")
    inside = posixpath.normpath(posixpath.join("/", inside, setting))  # ".." stops at the bucket's root
    return f"{wd.BUCKET}{bucket}{inside.rstrip('/')}"


def use(directory: str | None, say=print) -> Kept | None:
    """From now on this process's compiles read and write the cache in `directory` (None: no cache)."""
    jax_cache.reset_cache()
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # Every program is kept: the small ones (initialisation, counters) add up to seconds at a relaunch.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    warnings.filterwarnings("ignore", message=_JAX_WARNINGS)
    kept = Kept(directory, say)
    with jax_cache._cache_initialized_mutex:  # in place of the store JAX would make on its first compile
        jax_cache._cache, jax_cache._cache_initialized = kept, True
    return kept


def in_use() -> Kept | None:
    cache = jax_cache._cache
    return cache if isinstance(cache, Kept) else None


def remembered(kind: str, key_parts: list[str], compute: Callable[[], dict]) -> tuple[dict, bool]:
    """(`compute()`, whether it came from the cache): what a caller found from a compile it cannot keep as an
    executable (plan.py's compiles for a TPU or GPU target), kept as JSON under `<cache>/<kind>/`, keyed by
    `key_parts` and the installed jax, jaxlib, libtpu and plugin versions."""
    cache = in_use()
    if cache is None:
        return compute(), False
    key = hashlib.sha256("\n".join([*key_parts, *_versions()]).encode()).hexdigest()
    found = cache.get(f"{kind}/{key}")
    if found is not None:
        try:
            return json.loads(zlib.decompress(found)), True
        except (ValueError, zlib.error):
            cache.unloadable()
    value = compute()
    cache.put(f"{kind}/{key}", zlib.compress(json.dumps(value).encode()))
    return value, False


def _versions() -> list[str]:
    names = ("jax", "libtpu")
    return sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                  if (d.metadata["Name"] or "").lower().startswith(names))  # fmt: skip


@contextlib.contextmanager
def standing_aside():
    """No entry read or written meanwhile: compiles for a topology with no devices here (plan.py --target)
    make executables this process cannot load back."""
    cache = in_use()
    if cache is None:
        yield
        return
    cache.aside += 1
    try:
        yield
    finally:
        cache.aside -= 1


class Kept(CacheInterface):
    def __init__(self, directory: str, say):
        self.directory, self.say, self.remote = directory, say, wd.is_remote(directory)
        self._path = wd.path(directory)
        self.hits = 0  # entries handed to JAX (it may still fail to load one: see put)
        self.aside = 0
        self._handed: set[str] = set()
        self._said = False
        self._off = False
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        if self._off or self.aside:
            return None
        try:
            entry = self._path / f"{key}{_SUFFIX}"
            if not entry.exists():
                return None
            data = entry.read_bytes()
        except Exception as e:
            self._give_up("reading", e)
            return None
        n = len(_MAGIC)
        head, digest, value = data[:n], data[n : n + _DIGEST], data[n + _DIGEST :]
        if head != _MAGIC or hashlib.sha256(value).digest() != digest:
            self.unloadable()
            return None
        with self._lock:
            self.hits += 1
            self._handed.add(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        if self._off or self.aside:
            return
        with self._lock:
            if key in self._handed:  # handed over, yet compiled again: JAX could not load it
                self.hits -= 1
                self._handed.discard(key)
                self.unloadable()
        data = _MAGIC + hashlib.sha256(value).digest() + value
        try:
            if self.remote:  # an object appears whole or not at all
                (self._path / f"{key}{_SUFFIX}").write_bytes(data)
                return
            entry = os.path.join(self.directory, f"{key}{_SUFFIX}")
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            partial = f"{entry}.{uuid.uuid4().hex}.partial"
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, entry)
        except Exception as e:
            self._give_up("writing", e)

    def unloadable(self) -> None:
        if not self._said and jax.process_index() == 0:
            self._said = True
            self.say(
                f"the compile cache {self.directory} holds programs that cannot be loaded (damaged, or written by "
                "another program or jax); compiling them afresh and replacing them",
                flush=True,
            )

    def _give_up(self, doing: str, error: Exception) -> None:
        self._off = True
        if jax.process_index() == 0:
            self.say(
                f"the compile cache {self.directory} cannot be used ({doing} it: {faults.summary(error)}); compiling "
                "without it from now on",
                flush=True,
            )
