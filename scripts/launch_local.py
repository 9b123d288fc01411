"""Run a command as N cooperating JAX processes on this machine:

    python scripts/launch_local.py -n 2 [--devices_per_process 4] -- python scripts/train.py --config configs/tiny.py

Each process gets the coordinator address (a free local port), the process
count and its id through the environment (see parallelism/distributed.py), and,
with --devices_per_process, that many simulated CPU devices. Output is
forwarded line by line with a [process] prefix (less Gloo's "connected" lines). If
any process fails, the others end with its sentence (or are stopped after 30 s)
and the launcher exits with that process's status.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time

from parallelism import accelerators


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# Gloo (XLA:CPU's collectives between processes) says so each time a group of processes connects, from C++
# threads with no setting to quiet them (two at once can cut into each other's line anywhere, seen:
# "7 peer ranks. Expected number of connected peer ranks is : 7[Gloo] Rank 6 is connected ..."): nothing
# a user acts on, and it comes by the dozen. A rank that is NOT connected is kept.
GLOO_CONNECTED = re.compile(r"^(?!.*NOT connected).*(\[Gloo\] Rank|connected peer ranks)")
GRACE_SECONDS = 30  # a failed process's peers end by themselves with its sentence (parallelism/distributed.py)


def forward(proc: subprocess.Popen, index: int) -> None:
    for line in proc.stdout:
        if GLOO_CONNECTED.search(line):
            continue
        sys.stdout.write(f"[{index}] {line}")
        sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=0, help="simulated CPU devices per process")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.num_processes < 1:
        parser.error("give -n N and, after --, the command to run")

    coordinator = f"localhost:{free_port()}"
    procs = []
    for i in range(args.num_processes):
        env = dict(os.environ)
        env.update(
            TRAINER_COORDINATOR=coordinator,
            TRAINER_NUM_PROCESSES=str(args.num_processes),
            TRAINER_PROCESS_ID=str(i),
            PYTHONUNBUFFERED="1",
        )
        if args.devices_per_process:
            env["JAX_PLATFORMS"] = "cpu"
            # See tests/conftest.py: XLA:CPU's concurrency-optimised schedule can deadlock simulated devices.
            env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
            accelerators.simulate_devices(args.devices_per_process, env)  # a test suite's other flags kept
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    threads = [threading.Thread(target=forward, args=(p, i), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()

    # The first failure stops the rest: a collective run cannot go on without one of its processes. They are
    # told so by the failed one and end with its sentence; any still running after a grace period are ended.
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            status = failed[0].returncode
            deadline = time.monotonic() + GRACE_SECONDS
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            break
        time.sleep(0.2)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in threads:
        t.join(timeout=5)
    return status or next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
