"""Run a command as N cooperating JAX processes on this machine, each standing for a host:

    python scripts/launch_local.py -n 2 [--devices_per_process 4] -- python scripts/train.py --config configs/tiny.py

Each process gets the coordinator address, the process count and its id
through the environment (parallelism/distributed.py) and, with
--devices_per_process, that many simulated CPU devices. If any process fails,
the others end with its sentence and the launcher exits with its status.

With --elastic DIR the run goes on without a lost host: a host is down while
DIR/<host> exists (writing it ends that host's process, as a machine's end
would); a run that loses a process to a signal is launched again on the hosts
that answer, and taken back to every host at a checkpoint when one answers
again (parallelism/launcher.py; docs/resuming.md).
"""

import argparse
import os
import sys

from parallelism import launcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=0, help="simulated CPU devices per process")
    parser.add_argument("--elastic", metavar="DIR", help="go on with the hosts that answer: DIR/<host> marks one down")
    parser.add_argument("--max_restarts", type=int, default=8, help="elastic relaunches after a lost host, at most")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.num_processes < 1:
        parser.error("give -n N and, after --, the command to run")
    if args.elastic and not os.path.isdir(args.elastic):
        parser.error(f"--elastic {args.elastic} is not a directory; make it (an empty one: every host answers)")
    return launcher.run(command, args.num_processes, args.devices_per_process, args.elastic, args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
