"""Online serving benchmark: a client process streaming requests to a running server's
/v1/completions with Poisson arrivals, reporting vLLM's `bench serve` metrics.

    llmserve bench serve --url http://127.0.0.1:8000 --workload w-small --rate inf [--json out.json]

Definitions (client side, as vLLM defines them): TTFT = send -> first streamed chunk with text;
ITL = gaps between consecutive chunks; TPOT per request = (E2E - TTFT) / (output tokens - 1);
E2E = send -> last chunk. Output tokens are the server's usage counts. client_cpu_share: the
busiest client process's CPU time over its wall time (near 1: the client, not the server, may
have set the pace; --client-processes N spreads the streams over N processes).

The client is aiohttp, as vLLM's `bench serve` has it: its streaming read is several times
faster than httpx's, and a client that reads fewer chunks a second than the server sends would
measure itself, not the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import random
import time
from dataclasses import dataclass, field

import numpy as np

from llmserve.bench.report import report
from llmserve.bench.workloads import WORKLOADS


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


CLIENT_BUSY = 0.8
"""The client's CPU time over the run's wall time above which `bench serve` warns that the client
may have been the bound (its one interpreter reads every stream)."""


def random_workload(num: int, input_len: int, output_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num)], [output_len] * num


async def _one(session, url: str, model: str | None, prompt: list[int], max_tokens: int, temperature: float) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            pending = b""
            async for data in r.content.iter_any():  # events end with a blank line; reads split them anywhere
                pending += data
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        res.e2e = (last or time.perf_counter()) - start
        res.ok = True
    except Exception as exc:  # a failed request is counted, not fatal
        res.error = repr(exc)
    return res


def _stats(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


@dataclass(slots=True)
class _Part:
    """One client process's share of a run: its requests' results, when it started and ended
    (perf_counter: one monotonic clock for every process of the machine), and its CPU time."""
    results: list[Result]
    start: float
    end: float
    cpu: float


async def _drive(url: str, prompts: list[list[int]], max_tokens: list[int], *, rate: float, model: str | None,
                 temperature: float, seed: int, max_concurrency: int | None) -> _Part:
    import aiohttp

    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency or max(len(prompts), 1))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def launch(i: int) -> Result:
            async with limit:
                return await _one(session, url, model, prompts[i], max_tokens[i], temperature)

        tasks = []
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(launch(i)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return _Part(results, start, time.perf_counter(), time.process_time() - cpu)


def _drive_in_process(index: int, share: dict, ready, go, out) -> None:
    """A client process: announce itself, wait for the others, drive its share, send its part."""
    ready.put(index)
    go.wait()
    out.put((index, asyncio.run(_drive(**share))))


def _in_processes(processes: int, kwargs: dict) -> list[_Part]:
    """The requests dealt round-robin to `processes` client processes, each at rate / processes
    (independent Poisson arrivals add up to one Poisson stream of the whole rate) and a share of
    max_concurrency, started together once all of them are ready."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # (a fork would copy this process's event loop and threads)
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    limit = kwargs["max_concurrency"]
    procs = []
    for i in range(processes):
        share = dict(kwargs, prompts=kwargs["prompts"][i::processes], max_tokens=kwargs["max_tokens"][i::processes],
                     rate=kwargs["rate"] / processes, seed=kwargs["seed"] + i,
                     max_concurrency=None if limit is None else -(-limit // processes))
        procs.append(ctx.Process(target=_drive_in_process, args=(i, share, ready, go, out), daemon=True))
        procs[-1].start()
    parts: dict[int, _Part] = {}
    try:
        for _ in procs:
            ready.get(timeout=300)
        go.set()
        while len(parts) < processes:
            try:
                index, part = out.get(timeout=1.0)
                parts[index] = part
            except queue.Empty:
                dead = [p.exitcode for i, p in enumerate(procs) if i not in parts and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"a client process exited with code {dead[0]} before its results came")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [parts[i] for i in range(processes)]


async def run(url: str, prompts: list[list[int]], max_tokens: list[int], *, rate: float, model: str | None = None,
              temperature: float = 1.0, seed: int = 0, max_concurrency: int | None = None, processes: int = 1) -> dict:
    """The workload through the server; processes > 1: through that many client processes
    (`_in_processes`), for a server faster than one client process can read."""
    processes = max(1, min(processes, len(prompts)))
    kwargs = dict(url=url, prompts=prompts, max_tokens=max_tokens, rate=rate, model=model, temperature=temperature,
                  seed=seed, max_concurrency=max_concurrency)
    parts = [await _drive(**kwargs)] if processes == 1 else await asyncio.to_thread(_in_processes, processes, kwargs)
    results = [r for part in parts for r in part.results]
    duration = max(p.end for p in parts) - min(p.start for p in parts)
    done = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "rate": rate, "requests": len(prompts), "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens, "ttft_ms": _stats([r.ttft for r in done]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in done for x in r.itl]), "e2e_ms": _stats([r.e2e for r in done]),
        "client_processes": processes,
        "client_cpu_share": max(p.cpu / (p.end - p.start) for p in parts),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="llmserve bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model name to send (the server's default when omitted)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS) + ["random"], default="w-small")
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson); inf = all at once")
    ap.add_argument("--num-requests", type=int, help="first N requests of the workload")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-vocab", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--client-processes", type=int, default=1,
                    help="client processes the requests are dealt to, for a server that streams faster than one reads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.client_processes < 1:
        ap.error(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.workload == "random":
        prompts, max_tokens = random_workload(args.num_requests or 100, args.random_input_len, args.random_output_len,
                                              args.random_vocab, args.seed)
        temperature = 1.0
    else:
        w = WORKLOADS[args.workload]()
        prompts, max_tokens = w.prompts, [p.max_tokens for p in w.params]
        temperature = w.params[0].temperature
        if args.num_requests:
            prompts, max_tokens = prompts[:args.num_requests], max_tokens[:args.num_requests]
    result = asyncio.run(run(args.url, prompts, max_tokens, rate=args.rate, model=args.model, temperature=temperature,
                             seed=args.seed, max_concurrency=args.max_concurrency, processes=args.client_processes))
    result["workload"] = args.workload
    print(f"{'requests':<22}{result['completed']}/{result['requests']} in {result['duration_s']:.2f} s")
    print(f"{'output tok/s':<22}{result['output_throughput']:.1f}   requests/s {result['request_throughput']:.2f}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = result[name]
        print(f"{name:<22}mean {s['mean']:9.2f}  median {s['median']:9.2f}  p99 {s['p99']:9.2f}")
    if result["client_cpu_share"] > CLIENT_BUSY:  # one interpreter: past this it may be what was measured
        print(f"warning: a client process was busy {result['client_cpu_share']:.0%} of the run; the figures may be "
              "the client's limit, not the server's (--client-processes)")
    report(result, args.json, echo=False)


if __name__ == "__main__":
    main()
