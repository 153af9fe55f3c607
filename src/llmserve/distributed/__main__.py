"""A tensor-parallel rank's process: `python -m llmserve.distributed FD ENGINE`, as ProcessRanks
starts it (FD: its end of the socket to the engine; ENGINE: the engine process's pid)."""

import os
import subprocess
import sys
from multiprocessing.connection import Connection

from llmserve.distributed.workers import rank_main

WATCH = """
import os, signal, sys, time
rank, engine = int(sys.argv[1]), int(sys.argv[2])
def parent():
    try:
        with open(f"/proc/{rank}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
while (p := parent()) == engine:
    time.sleep(0.2)
if p is not None:
    os.kill(rank, signal.SIGKILL)
"""
"""The rank's watcher, a bare interpreter of its own (not a fork: this one already runs torch's
threads): it kills the rank once the engine process that started it is gone (the rank is then
another's child), however the engine ended: killed, or ended while the ranks started, when a rank
reads its socket only between calls, and one may wait in gloo's or NCCL's rendezvous for a peer
gone with it, for half an hour, holding its interpreter lock. It ends when the rank does. Linux
(/proc); elsewhere there is none."""

engine = int(sys.argv[2])
if os.getppid() != engine:  # gone during the imports, which take seconds
    sys.exit(1)
if os.path.exists(f"/proc/{os.getpid()}/stat"):
    subprocess.Popen([sys.executable, "-S", "-I", "-c", WATCH, str(os.getpid()), str(engine)],
                     stdin=subprocess.DEVNULL, start_new_session=True)
rank_main(Connection(int(sys.argv[1])))
