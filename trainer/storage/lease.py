"""A workdir is one run: the launch that trains in it holds its lease, and a second launch of the same run
(a command typed twice, a scheduler that restarts a job whose first copy still runs) is refused in one
sentence instead of writing every record twice.

A local workdir is locked with flock(2) on the directory itself (no file is added to it): the kernel lets go
when the process ends, however it ends, so a killed run never leaves it held. A bucket has no locks: the
lease is the object `lease.json`, created only where none exists (GCS's ifGenerationMatch=0), renewed every
RENEW_S seconds by a thread, and deleted at the end. A killed run's lease lapses LAPSE_S seconds after its
last renewal; a launch that finds a lapsed lease takes it over, and so does one on the holder's own host where
the holder's process is gone (a job killed and relaunched on the same VM need not wait). Process 0 holds it
for every process of a multi-process run.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time

from trainer.config.errors import ConfigError
from trainer.storage.workdir import is_remote, path

BUCKET_FILE = "lease.json"
RENEW_S, LAPSE_S = 30.0, 120.0


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "renewed": time.time()}


def _gone(holder: dict) -> bool:
    """The holder ran on this host and its process has ended."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _said(holder: dict) -> str:
    since = datetime.datetime.fromtimestamp(holder.get("since", 0)).strftime("%Y-%m-%d %H:%M:%S")
    return f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since}"


def _refusal(workdir: str, holder: str) -> ConfigError:
    return ConfigError(f"{workdir} is in use by another launch of this run ({holder}): wait for it to end, or give "
                       "this run another --workdir.")  # fmt: skip


class Lease:
    """Held from take() until release(); release() is safe to call more than once."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._fd: int | None = None  # local: the workdir, open and locked
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @classmethod
    def take(cls, workdir: str) -> Lease:
        lease = cls(workdir)
        lease._take_bucket() if is_remote(workdir) else lease._take_local()
        return lease

    def _take_local(self) -> None:
        import fcntl

        fd = os.open(str(path(self.workdir)), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(self.workdir, "another process holds its lock") from None
        self._fd = fd

    def _take_bucket(self) -> None:
        import fsspec

        fs, name = fsspec.filesystem("gcs"), f"{self.workdir.rstrip('/')}/{BUCKET_FILE}"
        for _ in range(2):
            try:
                fs.pipe_file(
                    name, json.dumps(_holder()).encode(), mode="create"
                )  # only where none is (ifGenerationMatch=0)
                break
            except FileExistsError:
                try:
                    holder = json.loads(fs.cat_file(name))
                except (FileNotFoundError, ValueError):
                    holder = {}  # ended meanwhile, or unreadable: tried once more, then taken over
                left = LAPSE_S - (time.time() - holder.get("renewed", 0))
                if left > 0 and not _gone(holder):
                    raise _refusal(self.workdir, f"{_said(holder)}; its lease renewed {LAPSE_S - left:.0f} s ago, "
                                   f"and a killed launch's lapses after {LAPSE_S:.0f} s") from None  # fmt: skip
                fs.rm_file(name)  # lapsed: its launch is gone
        else:
            raise ConfigError(f"{self.workdir}: two launches took its lease at once; run one of them again.")
        fs.invalidate_cache()
        self._name, self._fs = name, fs
        self._renewer = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        holder = json.loads(self._fs.cat_file(self._name))
        while not self._stop.wait(RENEW_S):
            holder["renewed"] = time.time()
            try:
                self._fs.pipe_file(self._name, json.dumps(holder).encode())
            except Exception:  # noqa: BLE001 - a missed renewal is retried; the run's own writes say the trouble
                pass

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing lets go of the flock
            self._fd = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
            try:
                self._fs.rm_file(self._name)
            except FileNotFoundError:
                pass
