"""Processes of one run on this machine, each standing for a host (scripts/launch_local.py).

Each process gets the coordinator address (a free local port), the process count
and its id through the environment (parallelism/distributed.py), its host's
index (TRAINER_HOST, for a host's own paths such as checkpoint.local_dir) and,
if asked, simulated CPU devices. Output is forwarded line by line with a [host]
prefix (less Gloo's "connected" lines). If any process fails, the others end
with its sentence (or are stopped after a grace period).

Elastic (`down_dir`): a host is down while `<down_dir>/<host>` exists, the
stand-in for a machine that fails its health check; the file's appearance also
ends that host's process, as the machine's end would. When a process of the
run ends by a signal (a lost host, or one killed), the command is launched
again on the hosts that answer, each process told how many of how many and
why (trainer/run/elastic.py keeps the global batch); the run resumes from its
newest complete checkpoint. When a down host answers again, the run is asked
to save and stop (SIGTERM: every process stops at the same step,
trainer/run/preemption.py) and is launched again on every host that answers.
Waiting for the run's next scheduled checkpoint instead would leave the host
idle for up to checkpoint.every_steps steps; the extra save costs seconds. A
process that fails on an error of its own ends the launch with its status:
launching again would fail again.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from parallelism import accelerators

GRACE_SECONDS = 30  # a failed process's peers end by themselves with its sentence (parallelism/distributed.py)
ENV_HOST = "TRAINER_HOST"
ENV_HOSTS, ENV_CAUSE = "TRAINER_ELASTIC_HOSTS", "TRAINER_ELASTIC_CAUSE"  # read by trainer/run/elastic.py

# Gloo (XLA:CPU's collectives between processes) says so each time a group of processes connects, from C++
# threads with no setting to quiet them (two at once can cut into each other's line anywhere, seen:
# "7 peer ranks. Expected number of connected peer ranks is : 7[Gloo] Rank 6 is connected ..."): nothing
# a user acts on, and it comes by the dozen. A rank that is NOT connected is kept.
GLOO_CONNECTED = re.compile(r"^(?!.*NOT connected).*(\[Gloo\] Rank|connected peer ranks)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def say(line: str) -> None:
    print(f"launch_local: {line}", flush=True)


class Group:
    """The command running as one process per host of `hosts` (indices of the `total` hosts)."""

    def __init__(self, command: list[str], hosts: list[int], total: int, devices: int, elastic: bool, cause: str):
        coordinator = f"localhost:{free_port()}"
        self.hosts, self.procs = hosts, []
        for i, host in enumerate(hosts):
            env = dict(os.environ)
            env.update({"TRAINER_COORDINATOR": coordinator, "TRAINER_NUM_PROCESSES": str(len(hosts)),
                        "TRAINER_PROCESS_ID": str(i), ENV_HOST: str(host), "PYTHONUNBUFFERED": "1"})  # fmt: skip
            if elastic:
                env[ENV_HOSTS] = f"{len(hosts)}/{total}"
                env[ENV_CAUSE] = cause
            if devices:
                env["JAX_PLATFORMS"] = "cpu"
                # See tests/conftest.py: XLA:CPU's concurrency-optimised schedule can deadlock simulated devices.
                env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
                accelerators.simulate_devices(devices, env)  # a test suite's other flags kept
            self.procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True))  # fmt: skip
        self.threads = [threading.Thread(target=_forward, args=(p, h), daemon=True)
                        for p, h in zip(self.procs, hosts, strict=True)]  # fmt: skip
        for t in self.threads:
            t.start()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def end(self) -> dict[int, int]:
        """Wait for every process (stopping any still running after the grace period); host -> exit status."""
        deadline = time.monotonic() + GRACE_SECONDS
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(timeout=5)
        return {h: p.returncode for h, p in zip(self.hosts, self.procs, strict=True)}


def _forward(proc: subprocess.Popen, host: int) -> None:
    for line in proc.stdout:
        if GLOO_CONNECTED.search(line):
            continue
        sys.stdout.write(f"[{host}] {line}")
        sys.stdout.flush()


def down(down_dir: str | None, total: int) -> set[int]:
    return {h for h in range(total) if down_dir and os.path.exists(os.path.join(down_dir, str(h)))}


def run(command: list[str], total: int, devices: int = 0, down_dir: str | None = None, max_restarts: int = 8) -> int:
    """Launch `command` on `total` hosts; elastic with `down_dir` (see above). Returns the exit status."""
    cause, restarts = "", 0
    while True:
        hosts = [h for h in range(total) if h not in down(down_dir, total)]
        if not hosts:
            say(f"no host answers (every host is marked down in {down_dir}); nothing to launch")
            return 1
        group = Group(command, hosts, total, devices, down_dir is not None, cause)
        asked_to_stop, first = _watch(group, down_dir, total)
        codes = group.end()
        signalled = sorted(h for h, code in codes.items() if code < 0)
        if not any(codes.values()) and not asked_to_stop:
            return 0
        failed_itself = any(code > 0 for code in codes.values()) and not signalled  # its own error: not a host
        if down_dir is None or not (signalled or asked_to_stop) or failed_itself:
            return first or next((code for code in codes.values() if code), 0)
        if asked_to_stop:
            back = sorted(set(range(total)) - set(hosts) - down(down_dir, total))
            cause = f"host{'s' * (len(back) > 1)} {', '.join(map(str, back))} answer{'s' * (len(back) == 1)} again"
        else:
            restarts += 1
            if restarts > max_restarts:
                say(f"{max_restarts} relaunches already (--max_restarts); stopping")
                return first or next(code for code in codes.values() if code)
            lost = sorted(down(down_dir, total) & set(hosts)) or signalled
            how = ", ".join(f"{h} ({_signal_name(codes[h])})" for h in lost)
            cause = f"host{'s' * (len(lost) > 1)} {how} lost"
        answering = [h for h in range(total) if h not in down(down_dir, total)]
        say(f"{cause}: relaunching on {len(answering)} of {total} hosts ({', '.join(map(str, answering))})")


def _watch(group: Group, down_dir: str | None, total: int) -> tuple[bool, int]:
    """Until the group ends or one process fails: end the process of a host marked down, and ask the run to
    save and stop when a host outside it answers again. Returns whether it was asked, and the status of the
    process that failed first (0: none)."""
    asked = False
    while group.running():
        gone = down(down_dir, total)
        for host, p in zip(group.hosts, group.procs, strict=True):
            if host in gone and p.poll() is None:
                p.kill()  # the machine is gone, and its process with it
        if not asked and down_dir is not None and set(range(total)) - gone - set(group.hosts):
            say("a host that was down answers again: the run saves a checkpoint and stops, to go on with it")
            group.procs[0].send_signal(signal.SIGTERM)
            asked = True
        failed = [p.returncode for p in group.procs if p.poll() not in (None, 0)]
        if failed:
            return asked, failed[0]
        time.sleep(0.2)
    return asked, 0


def _signal_name(code: int) -> str:
    if code is None or code >= 0:
        return f"exit status {code}"
    try:
        return f"its process ended by {signal.Signals(-code).name}"
    except ValueError:
        return f"its process ended by signal {-code}"
