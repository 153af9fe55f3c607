"""Benchmark workloads (as ../shared/WORKLOADS.md defines them) and their runners."""
