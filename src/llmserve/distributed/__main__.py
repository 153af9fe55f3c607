"""A tensor-parallel rank's process: `python -m llmserve.distributed FD`, as ProcessRanks starts it
(FD: its end of the socket to the engine)."""

import sys
from multiprocessing.connection import Connection

from llmserve.distributed.workers import rank_main

rank_main(Connection(int(sys.argv[1])))
