"""Tensor parallelism: this process's rank and its collectives (parallel_state.py), and the worker
processes that run one rank each, driven as one model runner (workers.py)."""
