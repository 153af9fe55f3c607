"""A tensor-parallel rank's process: `python -m llmserve.distributed FD ENGINE`, as ProcessRanks
starts it (FD: its end of the socket to the engine; ENGINE: the engine process's pid)."""

import os
import subprocess
import sys
from multiprocessing.connection import Connection

from llmserve.distributed.workers import rank_main

WATCH = """
import os, select, signal, sys
rank, engine = int(sys.argv[1]), int(sys.argv[2])
handle = os.pidfd_open(rank)  # (the rank is alive, and this one's parent: the handle is the rank's)
def parent():
    try:
        with open(f"/proc/{rank}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
while not select.select([handle], [], [], 0.2)[0]:  # readable: the rank exited
    if parent() != engine:
        try:
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
"""
"""The rank's watcher, a bare interpreter of its own (not a fork: this one already runs torch's
threads): it kills the rank once the engine process that started it is gone (the rank is then
another's child), however the engine ended: killed, or ended while the ranks started, when a rank
reads its socket only between calls, and one may wait in gloo's or NCCL's rendezvous for a peer
gone with it, for half an hour, holding its interpreter lock. It ends when the rank does; it holds
the rank by a pidfd, so that a pid used again is never killed. Linux (/proc, pidfd); elsewhere
there is none."""

engine = int(sys.argv[2])
if os.getppid() != engine:  # gone during the imports, which take seconds
    sys.exit("tensor-parallel rank: its engine process ended while it started")
if os.path.exists(f"/proc/{os.getpid()}/stat") and hasattr(os, "pidfd_open"):
    try:
        subprocess.Popen([sys.executable, "-S", "-I", "-c", WATCH, str(os.getpid()), str(engine)],
                         stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:  # (a safeguard: the rank serves without it)
        print(f"tensor-parallel rank: no watcher process ({exc})", file=sys.stderr)
rank_main(Connection(int(sys.argv[1])))
