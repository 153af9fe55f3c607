"""Offline throughput of a workload through LLM.generate, with its roofline.

    python -m llmserve.bench.throughput --workload w-small [--peer hf,vllm] [--json out.json] [engine options]

Roofline, as WORKLOADS.md computes it (all requests assumed running at once): each decode step
reads the weights once plus the KV cache of every request still running; a token costs 2 * params
FLOPs plus its attention. A bandwidth-bound workload (W-small) takes its prompts' FLOPs, then its
decode steps' reads; a compute-bound one (W-large) takes every token's FLOPs, its decode reads
beneath them. The device's copy bandwidth and bf16 matmul rate are measured in the same run.

Peers, run after our engine has finished and given its memory back, compared in the same run:
hf (transformers `generate` in this process, on the first --peer-requests requests) and vllm (the
whole workload through vLLM's offline LLM in a process of its own: vllm_peer.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import numpy as np
import torch

from llmserve.bench.report import report
from llmserve.bench.stalls import watch_stalls
from llmserve.bench.vllm_peer import SITE_ENV, VllmPeerError, find_vllm, llm_settings, run_vllm_peer
from llmserve.bench.workloads import WORKLOADS, Workload
from llmserve.model.spec import ModelSpec


def measure_device(sustained: bool = False) -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul
    FLOP/s (a burst of ten products: the roofline's rate). sustained: also the matmul rate once the
    board has settled at its power limit (~1 s of products, then ~1.5 s timed), the rate a
    compute-bound run can keep."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def timed(fn, reps):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    bw = 2 * x.numel() / timed(lambda: y.copy_(x), 20)
    flops = 2 * 8192**3 / timed(lambda: a @ b, 10)
    result = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "bf16_flop_per_s": flops}
    if sustained:
        for _ in range(800):
            a @ b
        result["bf16_flop_per_s_sustained"] = 2 * 8192**3 / timed(lambda: a @ b, 1000)
    if torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones(1, device="cuda")
        result["fp8_flop_per_s"] = 2 * 8192**3 / timed(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10)
    return result


def layer_params(spec: ModelSpec) -> tuple[np.ndarray, float, int, object]:
    """The decoder layers' parameters: per layer, those a token multiplies by ([layers]: attention
    and the dense MLP, or the router, its top_k experts and the shared expert); those every step
    reads (all but the experts); one expert's; and active(b), the experts of all sparse layers a
    step of b tokens reads when each token picks top_k of E uniformly, E * (1 - (1 - k/E)^b) a layer."""
    h = spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = np.full(spec.num_layers, h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size, dtype=np.float64)
    moe = spec.moe
    if moe is None:
        return per_layer, float(per_layer.sum()), 0, lambda b: 0.0
    expert = 3 * h * moe.intermediate_size
    sparse = np.array(moe.sparse_layers)
    per_layer[sparse] = (h * (q + 2 * kv) + q * h + h * moe.num_experts + moe.top_k * expert
                         + (3 * h * moe.shared_intermediate_size + h if moe.shared_intermediate_size else 0))
    e, k, n = moe.num_experts, moe.top_k, int(sparse.sum())
    return per_layer, float(per_layer.sum()) - n * k * expert, expert, lambda b: n * e * (1 - (1 - k / e) ** b)


def roofline_seconds(w: Workload, spec: ModelSpec, bandwidth: float, flops: float, *,
                     weight_itemsize: int = 2, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """weight_itemsize: bytes per decoder-layer weight (1 for int8/fp8; embeddings and lm_head stay
    bf16); flops: the matmul rate of the weights' format. prefill_s: the prompts' FLOPs; decode_s:
    the decode steps' reads; compute_s: every token's FLOPs; roofline_s: by the workload's bound."""
    per_layer, resident, expert, active = layer_params(spec)
    outer = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)  # kept in bf16
    params = per_layer.sum() + outer  # a token's
    kv_token = spec.kv_bytes_per_token(kv_dtype)
    prompt = np.array([len(p) for p in w.prompts], dtype=np.float64)
    out = np.array([p.max_tokens for p in w.params], dtype=np.float64)
    # Decode: step t reads the weights and the KV of requests with out > t (context prompt + t).
    steps = int(out.max())
    t = np.arange(steps, dtype=np.float64)[:, None]
    running = out[None, :] > t
    context = float(((prompt[None, :] + t) * running).sum())
    # FLOPs: 2 * params a token, plus attention (QK^T and PV) over the keys up to and including its own.
    attn = 4 * spec.num_layers * spec.num_heads * spec.head_dim
    # a step reads every weight but the experts, and the experts its batch picks
    experts_read = sum(active(b) for b in running.sum(axis=1))
    weight_reads = steps * (resident * weight_itemsize + outer * 2) + experts_read * expert * weight_itemsize
    prompt_flops = 2 * params * prompt.sum() + attn * float((prompt * (prompt + 1) / 2).sum())
    decode_flops = 2 * params * out.sum() + attn * (context + running.sum())
    read = context
    if w.shared_prefix:  # each prefix computed once and read once a step; the rest per request
        groups, length = w.shared_prefix
        own = prompt - length
        prompt_flops = (2 * params * (groups * length + own.sum()) + attn * groups * length * (length + 1) / 2
                        + attn * float((own * (own + 1) / 2 + own * length).sum()))
        read = float(((own[None, :] + t) * running).sum()) + groups * length * steps
    decode = (weight_reads + read * kv_token) / bandwidth
    prefill, compute = prompt_flops / flops, (prompt_flops + decode_flops) / flops
    roofline = prefill + decode if w.bound == "bandwidth" else max(compute, decode)
    return {"roofline_s": float(roofline), "bound": w.bound, "decode_s": float(decode), "prefill_s": float(prefill),
            "compute_s": float(compute)}


def peer_hf(w: Workload, num_requests: int, batch_size: int) -> dict:
    """transformers `generate` (static, left-padded batches) on the first `num_requests` requests:
    same random bf16 weights' shapes, same sampling; each batch runs to its longest max_tokens,
    and only the tokens the requests asked for count."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.from_pretrained(w.write_model_dir(tmp))
    with torch.device("cuda"):  # initialise on the GPU: an 8B model's random init on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompts, params = w.prompts[:num_requests], w.params[:num_requests]
    p0 = params[0]

    def one_batch(lo: int, hi: int) -> None:
        batch = prompts[lo:hi]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(q.max_tokens for q in params[lo:hi])
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=p0.temperature,
                           top_p=p0.top_p, top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    one_batch(0, 1)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        one_batch(lo, min(lo + batch_size, len(prompts)))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(q.max_tokens for q in params)
    model = None  # the closure's reference too: free the peer's weights before our engine runs again
    torch.cuda.empty_cache()
    return {"requests": len(prompts), "batch_size": batch_size, "wall_s": wall, "output_tokens": tokens,
            "output_tok_s": tokens / wall}


PEERS = ("hf", "vllm")


def run(workload: str, *, peers: tuple[str, ...] = (), peer_requests: int = 64, vllm_site: str | None = None,
        vllm_timeout_s: float = 900.0, profile: str | None = None, detokenize: bool = False,
        **engine_kwargs) -> dict:
    """Our engine on `workload`, then each of `peers` (PEERS) on it; result["peers"][name] holds a
    peer's figures beside ours ("speedup": our output tok/s over the peer's on the same requests)."""
    from llmserve import LLM, SamplingParams
    w = WORKLOADS[workload]()
    device = measure_device(sustained=w.bound == "compute") if torch.cuda.is_available() else {"device": "cpu"}

    def timed_generate(llm, prompts, params) -> tuple[float, list, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, outs, start

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with watch_stalls() as startup_stalls:  # the Triton kernels compiled (or read from disk) at start-up
            model_dir = w.write_model_dir(tmp)
            if detokenize:
                w.write_tokenizer(model_dir)
            llm = LLM(model_dir, load_format="dummy", **engine_kwargs)
        startup = time.perf_counter() - start  # weights, profiling step, KV cache, graph capture
        startup_info = startup_summary(llm.engine.startup_phases, startup_stalls["kernels"])
        llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        timing = llm.engine.runner.timing
        timing.clear()
        ranks = engine_kwargs.get("tensor_parallel_size", 1)
        if ranks > 1:  # the ranks run in processes of their own: rank 0 times its steps there
            llm.engine.runner.rank_timing("time_device" if torch.cuda.is_available() else "clear")
        elif torch.cuda.is_available():
            timing.time_device()  # device busy/idle per step: two CUDA events a step
        if profile:
            # A prefill step, steady decode with all requests running, and the long tail's small batches.
            timing.profile_windows, timing.profile_out = [(2, 2), (200, 5), (650, 5), (850, 5), (980, 5)], profile
        allocator_before = _allocator_counts()
        with watch_stalls() as stalls:
            wall, outs, started = timed_generate(llm, w.prompts, w.params)
        # device memory the caching allocator had to get (or give back) mid-run: each is a driver call
        stalls["allocator"] = {k: v - allocator_before.get(k, 0) for k, v in _allocator_counts().items()}
        step_summary = timing.report()
        if ranks > 1:  # rank 0's own steps: its launches, its waits for the device, its device's idle time
            step_summary["rank0"] = llm.engine.runner.rank_timing("report")
        # host time from generate() to the first step's launch: handing the batch in and planning it
        first = next((r for r in timing.records if r.requests and r.start >= started), None)
        step_summary["first_step_ms"] = None if first is None else 1e3 * (first.start - started)
        if "device_busy_s" in step_summary:
            step_summary["device_busy_fraction"] = step_summary["device_busy_s"] / wall
        pauses = stalls.pop("gc_pauses")
        for row in step_summary["slowest"] + step_summary["most_idle"]:  # the collections inside each step's period
            lo, hi = timing.records[row["step"] - 1].end, timing.records[row["step"]].end
            row["gc_ms"] = sum(ms for t, ms in pauses if lo <= t < hi)
        if "hf" in peers:
            # The same subset through our engine, for a like-for-like ratio measured in this run.
            sub_wall, _, _ = timed_generate(llm, w.prompts[:peer_requests], w.params[:peer_requests])
        preemptions = llm.engine.scheduler.num_preemptions
        cascade_steps = llm.engine.runner.cascade_steps
        leaked = llm.engine.kv.pool.num_blocks - llm.engine.kv.num_free_blocks()
        llm.shutdown()
        llm = None
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    peer_results = {}
    if "hf" in peers:
        hf = peer_hf(w, peer_requests, batch_size=peer_requests)
        ours = hf["output_tokens"] / sub_wall
        peer_results["hf"] = {"peer": "hf-transformers-generate", **hf, "llmserve_wall_s": sub_wall,
                              "llmserve_output_tok_s": ours, "speedup": ours / hf["output_tok_s"]}
    if "vllm" in peers:
        peer_results["vllm"] = vllm_peer(w, vllm_site, vllm_timeout_s, engine_kwargs, wall=wall,
                                         generated=generated, startup=startup)
    result = {"workload": workload, **device, "startup_s": startup,
              "startup": startup_info,
              "wall_s": wall, "prompt_tokens": w.prompt_tokens,
              "output_tokens": generated, "expected_output_tokens": w.output_tokens,
              "output_tok_s": generated / wall, "preemptions": preemptions, "leaked_blocks": leaked,
              "cascade_steps": cascade_steps,
              "output_chars": sum(len(o.outputs[0].text) for o in outs), "detokenize": detokenize,
              "decode_steps": step_summary, "stalls": stalls,
              "date": time.strftime("%Y-%m-%d"), "engine_kwargs": engine_kwargs}
    spec = ModelSpec.from_dict(w.model_config)
    if "copy_bytes_per_s" in device:
        quant = engine_kwargs.get("quantization")
        fp8_kv = engine_kwargs.get("kv_cache_dtype", "auto") != "auto"
        flops = device.get("fp8_flop_per_s", device["bf16_flop_per_s"]) if quant == "fp8" else device["bf16_flop_per_s"]
        ranks = engine_kwargs.get("tensor_parallel_size", 1)  # the devices' bandwidths and rates add up
        flops, bw = flops * ranks, device["copy_bytes_per_s"] * ranks
        shape = {"weight_itemsize": 1 if quant in ("int8", "fp8") else 2,
                 "kv_dtype": torch.float8_e4m3fn if fp8_kv else torch.bfloat16}
        roof = roofline_seconds(w, spec, bw, flops, **shape)
        result.update(roof, roofline_fraction=roof["roofline_s"] / wall)
        if "bf16_flop_per_s_sustained" in device and quant != "fp8":
            held = roofline_seconds(w, spec, bw, device["bf16_flop_per_s_sustained"] * ranks, **shape)["roofline_s"]
            result.update(roofline_sustained_s=held, roofline_sustained_fraction=held / wall)
    if spec.moe is not None:
        from llmserve.model.moe import ROUTING_ENV  # random weights route unlike a trained model: say which ran
        result["moe_routing"] = os.environ.get(ROUTING_ENV, "model")
    if peer_results:
        result["peers"] = peer_results
    return result


def vllm_peer(w: Workload, site: str | None, timeout_s: float, engine_kwargs: dict, *, wall: float,
              generated: int, startup: float) -> dict:
    """vLLM on the whole workload in its own process, beside our figures for it (wall, output
    tokens, start-up s). A failed peer is recorded ({"error": ...}), not raised: our run stands."""
    gc.collect()
    free = None
    if torch.cuda.is_available():  # what the peer finds free: vLLM asks for gpu_memory_utilization of the total
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
    settings = llm_settings(engine_kwargs.get("max_num_seqs", 256), engine_kwargs.get("max_num_batched_tokens", 8192),
                            engine_kwargs.get("tensor_parallel_size", 1))
    try:
        peer = run_vllm_peer(w, site=site, settings=settings, timeout_s=timeout_s)
    except VllmPeerError as exc:
        return {"peer": "vllm", "error": str(exc), "free_bytes_at_start": free}
    ours = generated / wall
    return {"peer": "vllm", **peer, "free_bytes_at_start": free, "llmserve_wall_s": wall,
            "llmserve_output_tok_s": ours, "llmserve_startup_s": startup, "speedup": ours / peer["output_tok_s"]}


def peer_lines(result: dict) -> list[str]:
    """One line per peer: its figures and ours on the same requests."""
    lines = []
    for name, p in result.get("peers", {}).items():
        if "error" in p:
            lines.append(f"peer {name}: FAILED: {p['error'].splitlines()[0]}")
            continue
        line = (f"peer {name}: {p['wall_s']:.2f} s, {p['output_tok_s']:,.0f} output tok/s on {p['requests']} requests; "
                f"llmserve {p['llmserve_wall_s']:.2f} s, {p['llmserve_output_tok_s']:,.0f} tok/s: "
                f"llmserve/{name} {p['speedup']:.2f}x")
        if "startup_s" in p:
            line += (f"; start-up {p['startup_s']:.1f} s (+{p['import_s']:.1f} s import) vs "
                     f"llmserve {p['llmserve_startup_s']:.1f} s")
        lines.append(line)
    return lines


def startup_summary(phases: dict[str, float], kernels: list[dict] | None) -> dict:
    """The engine's start-up phases (s) and the Triton kernel variants it first used meanwhile: how
    many, their ms in all (compiles on a cold cache, disk reads on a warm one) and the slowest eight."""
    summary: dict = {"phases_s": phases}
    if kernels is not None:
        timed = [k for k in kernels if k["ms"] is not None]
        summary["kernels"] = {"count": len(kernels), "ms": sum(k["ms"] for k in timed),
                              "slowest": sorted(timed, key=lambda k: -k["ms"])[:8]}
    return summary


def _allocator_counts() -> dict:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def _peer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"peers are {', '.join(PEERS)} (comma-separated), got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; args.peers is the peers named (in PEERS order, each once)."""
    ap = argparse.ArgumentParser(prog="llmserve bench throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="w-small")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-reserve-growth", dest="reserve_growth", action="store_false",
                    help="scheduler.reserve_growth = false: admit whatever fits the KV cache now")
    ap.add_argument("--peer", type=_peer_list, action="append", default=[], metavar="hf,vllm",
                    help="also run a peer on the same workload in this run (comma-separated or repeated): "
                         "hf (transformers generate, a subset, in this process), vllm (the whole workload, "
                         "offline LLM, in a subprocess)")
    ap.add_argument("--peer-requests", type=int, default=64, help="size of the hf peer's subset (its first requests)")
    ap.add_argument("--vllm-site", default=os.environ.get(SITE_ENV),
                    help=f"folder vLLM is installed in (an unpacked vsite.tar.xz), put first on the peer's "
                         f"PYTHONPATH; default ${SITE_ENV}, else this interpreter's vllm")
    ap.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds the vllm peer may take in all")
    ap.add_argument("--profile", metavar="PREFIX", help="torch profiler over prefill, steady decode and tail steps: PREFIX-stepN.txt, .trace.json")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                    help="cache.enable_prefix_caching = false")
    ap.add_argument("--cascade-attention", default="auto", choices=("auto", "always", "never"),
                    help="cache.cascade_attention")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for this run (seconds)")
    ap.add_argument("--quantization", help="model.quantization (int8, fp8, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="cache.kv_cache_dtype (auto, fp8)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="parallel.tensor_parallel_size (the roofline then adds up that many devices; the vllm peer "
                         "runs with the same)")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="parallel.disable_custom_all_reduce: NCCL for every all-reduce of the ranks")
    ap.add_argument("--detokenize", action="store_true",
                    help="a tokenizer covering the model's vocabulary in its directory: outputs become text, "
                         "as with a real checkpoint (WORKLOADS.md's runs have none)")
    args = ap.parse_args(argv)
    named = {n for group in args.peer for n in group}
    args.peers = tuple(n for n in PEERS if n in named)
    if "vllm" in args.peers:
        try:  # before our engine's minutes, not after them
            find_vllm(args.vllm_site)
        except VllmPeerError as exc:
            ap.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    result = run(args.workload, peers=args.peers, peer_requests=args.peer_requests, vllm_site=args.vllm_site,
                 vllm_timeout_s=args.vllm_timeout, profile=args.profile,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 reserve_growth=args.reserve_growth, enforce_eager=args.enforce_eager, log_interval_s=10.0,
                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, detokenize=args.detokenize,
                 enable_prefix_caching=args.enable_prefix_caching, cascade_attention=args.cascade_attention,
                 tensor_parallel_size=args.tensor_parallel_size,
                 **({"disable_custom_all_reduce": True} if args.disable_custom_all_reduce else {}))
    report(result, args.json)
    for line in peer_lines(result):
        print(line, file=sys.stderr)
    if any("error" in p for p in result.get("peers", {}).values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
