"""The collectives of one tensor-parallel decode step, timed as the engine runs them (inside a CUDA
graph, through llmserve.distributed.parallel_state), with NCCL alone and with the one-shot kernel.

    python scripts/allreduce_bench.py [--ranks 2] [--model w-large] [--rows 1,16,64,256] [--json OUT]

A step of a model split over P ranks makes, per decoder layer, two all-reduces of [rows, hidden]
in the model's dtype (after o_proj and after down_proj), one more for the embeddings, and one
all-gather of the logits ([rows, vocab / P] a rank). This script makes exactly those in one graph
per row count and reports the graph's time a step, one all-reduce's time (graphed, and NCCL's
eager), the logits' all-gather, and whether the one-shot sums equal NCCL's (and how far each is
from the float32 sum of the ranks' parts: above two ranks they add in different orders). Then the
step with each layer's all-reduce followed by its RMSNorm, as the model runs them: the one-shot
kernel and the norm kernel apart (apart_norm_step_graph_ms), and all_reduce_rms_norm's one kernel
(fused_norm_step_graph_ms).
One process a rank (torch.multiprocessing); NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmserve.bench.workloads import WORKLOADS
from llmserve.distributed import parallel_state
from llmserve.kernels.fused import rms_norm
from graph_timing import events_us

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def graphed(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # NCCL sets up the communicator's buffers outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local, as the engine captures: NCCL's watchdog thread queries events meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph


def rank_main(rank: int, size: int, store: str, config: dict, rows_list: list[int], out: str) -> None:
    torch.cuda.set_device(rank)
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    parallel_state.init_tensor_parallel(rank, size, "nccl", f"file://{store}", 600.0)
    tp = parallel_state.tp()
    why = parallel_state.enable_one_shot(device, dtype)
    one_shot = tp.one_shot
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    vocab_part = -(-config["vocab_size"] // size)
    results = []
    for rows in rows_list:
        x = torch.zeros(rows, hidden, device=device, dtype=dtype)
        logits = torch.zeros(rows, vocab_part, device=device, dtype=dtype)

        def step() -> None:  # the engine's path: one-shot where it is set up and x small enough
            parallel_state.all_reduce(x, opens_pass=True)  # the embeddings'
            for _ in range(2 * layers):
                parallel_state.all_reduce(x)
            parallel_state.all_gather_columns(logits)

        row = {"rows": rows, "all_reduce_bytes": x.numel() * x.element_size(), "step_collectives": 2 * layers + 2}
        for path in ("nccl", "one_shot"):
            if path == "one_shot" and one_shot is None:
                continue
            tp.one_shot = one_shot if path == "one_shot" else None
            if path == "one_shot":  # the sums against NCCL's, and both against float32's
                probe = torch.randn(rows, hidden, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(rank))
                nccl = probe.clone()
                dist.all_reduce(nccl)
                parts = [torch.empty_like(probe) for _ in range(size)]
                dist.all_gather(parts, probe)
                exact = torch.stack(parts).float().sum(0)
                mine = parallel_state.all_reduce(probe.clone())
                # two ranks add a + b either way: equal bits; more add in another order than NCCL's
                # ring, so each may round differently: both must stay within a rounding of the exact sum
                row["one_shot_equals_nccl"] = bool(torch.equal(mine, nccl))
                row["one_shot_max_err"] = (mine.float() - exact).abs().max().item()
                row["nccl_max_err"] = (nccl.float() - exact).abs().max().item()
            one, whole = graphed(lambda: parallel_state.all_reduce(x)), graphed(step)
            row[f"{path}_all_reduce_graph_us"] = events_us(one.replay, 200)
            row[f"{path}_step_graph_ms"] = events_us(whole.replay, 50) / 1e3
            torch.cuda.synchronize()
            del one, whole
        if tp.norm_reduce is not None:  # each layer's all-reduce with the norm after it: apart, then one kernel
            weight, residual = torch.ones(hidden, device=device, dtype=dtype), torch.zeros_like(x)

            def normed_step(fused: bool) -> None:
                parallel_state.all_reduce(x, opens_pass=True)
                for _ in range(2 * layers):
                    if fused:
                        parallel_state.all_reduce_rms_norm(x, residual, weight, 1e-5, rms_norm)
                    else:
                        rms_norm(parallel_state.all_reduce(x), weight, 1e-5, residual)
                parallel_state.all_gather_columns(logits)

            for fused in (False, True):
                # (whole passes only: a graph of one call would put successive calls in one slot)
                whole = graphed(lambda: normed_step(fused))
                row[f"{'fused' if fused else 'apart'}_norm_step_graph_ms"] = events_us(whole.replay, 50) / 1e3
                torch.cuda.synchronize()
                del whole
        tp.one_shot = None
        row["nccl_all_reduce_eager_us"] = events_us(lambda: dist.all_reduce(x), 200)
        gather = graphed(lambda: parallel_state.all_gather_columns(logits))
        row["all_gather_logits_graph_us"] = events_us(gather.replay, 200)
        torch.cuda.synchronize()
        del gather
        tp.one_shot = one_shot
        results.append(row)
        if rank == 0:  # as each row comes: a run cut short keeps what it measured
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "ranks": size, "hidden": hidden, "layers": layers,
                           "vocab": config["vocab_size"], "one_shot": why or "ready", "rows": results}, f, indent=1)
            print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="w-large", choices=sorted(WORKLOADS), help="the workload whose model shape to use")
    ap.add_argument("--rows", default="1,16,64,256", help="tokens a step")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"needs {args.ranks} CUDA devices, found {torch.cuda.device_count()}")
    config = WORKLOADS[args.model]().model_config
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json or os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(args.ranks, os.path.join(tmp, "store"), config, rows, out), nprocs=args.ranks)


if __name__ == "__main__":
    main()
