"""Where a small step's time goes on the host: the moments each step passes through the engine's
actors, relative to the moment the step before's tokens reached the host, medians over a run.

    python scripts/step_trace.py [--model DIR] [--batch 1] [--tokens 512] [--sync]
                                 [--speculative JSON] [--temperature T --seed S] [--dtype bfloat16]
                                 [--shape decode-b1] [--profile PREFIX] [--kernels PATH] [--json out.json]

B requests of 64 random prompt tokens each generate --tokens tokens (ignore_eos; greedy unless
--temperature, each request seeded S + i with --seed) on the model (the built-in one by default).
Each step's path is timed where it crosses a boundary: the executor's thread has the tokens
(`ready`: their copy to the host waited for), the scheduler takes the result and plans, the KV
manager fits the plan, the runner builds the inputs and launches (`replay`: the CUDA graph is
started: the device works from here), the sampler is queued, the request actor publishes. With
--sync (async scheduling off, as a speculating engine runs) the next step is planned only once the
tokens are back, so `ready` to `replay` is the host time the device idles; without it, the same
moments show what overlaps the device.

--speculative '{"method": "draft", "model": "builtin", "num_speculative_tokens": 4}': the engine
speculates (held on, whatever it keeps; "builtin" names the built-in model), so each step is a
verify step and its stretch also shows the proposal (`propose`) and the verify graph's replay; ms
a step counts steps, not tokens.

--shape decode-b1 | w-small: the model of that workload (dummy weights) instead of --model; w-small's
with a tokenizer of its whole vocabulary (structured_bench.py's).

--constrained: every request held inside a JSON string (structured_bench.py's tpot constraint,
jump-forward as the engine's default; --no-jump: off, so no step checks for a jump), so the stretch
also shows the mask thread's fill (`fill`) and the sampler waiting for it (`send`, at the next
step's launch). With async scheduling the forward pass queued by `replay` runs from the `ready`
before it: a `queued` later than that pass's device time, or a `replay` later than the step's
whole device time, is what the device waits for.

--profile PREFIX: cProfile of the runner's forward passes, samplings and finishes
(PREFIX.runner.txt) and of the actors' handlers on the event loop (PREFIX.loop.txt), by
cumulative time.

--kernels PATH: the device's own timeline of the measured run (torch.profiler; its host-side
recording slows the host a little), each step's stretch starting where the copy of the step
before's tokens to the host ended: its busy stretches (gaps over 20 us split them), medians over
the run, with their kernels' names, as JSON (what keeps the device idle, and how long the sampler
itself takes there); and three steps from the middle whole, the host's marked calls and CUDA
runtime calls beside the device's work.
"""

import argparse
import collections
import contextlib
import cProfile
import functools
import inspect
import io
import json
import pstats
import random
import tempfile
import time
from pathlib import Path

import llmserve
from llmserve import LLM, SamplingParams
from llmserve.actors import request_actor
from llmserve.bench.report import report
from llmserve.bench.workloads import JSON_STRING_REGEX, decode_b1, w_small
from llmserve.core import kv_cache_manager, scheduler
from llmserve.model import cuda_graphs, drafting, runner, sampling_state, step_inputs
from llmserve.sampling_params import StructuredOutputsParams

EVENTS: list[tuple[str, float]] = []
PROFILES = {"runner": cProfile.Profile(), "loop": cProfile.Profile()}
PROFILING = False
ANNOTATE = False  # --kernels: each marked call also a range on the profiler's timeline


def mark(cls, name: str, tag: str, profile: str | None = None) -> None:
    """Record `tag>` and `tag<` around cls.name (a method, or a coroutine function)."""
    fn = getattr(cls, name)
    prof = PROFILES[profile] if profile else None

    if inspect.isgeneratorfunction(fn):  # a runner call the executor drives (its waits inside)
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            EVENTS.append((tag + ">", time.perf_counter()))
            result = yield from fn(*args, **kwargs)
            EVENTS.append((tag + "<", time.perf_counter()))
            return result
    elif inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*args, **kwargs):
            EVENTS.append((tag + ">", time.perf_counter()))
            result = await fn(*args, **kwargs)
            EVENTS.append((tag + "<", time.perf_counter()))
            return result
    else:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            EVENTS.append((tag + ">", time.perf_counter()))
            if ANNOTATE:
                import torch
                with torch.profiler.record_function(tag):
                    result = fn(*args, **kwargs)
            elif PROFILING and prof is not None:
                result = prof.runcall(fn, *args, **kwargs)
            else:
                result = fn(*args, **kwargs)
            EVENTS.append((tag + "<", time.perf_counter()))
            return result
    setattr(cls, name, wrapped)


class _Ready:
    """A step's event, noting when waiting for it returned (or polling it first found it done)."""

    def __init__(self, event) -> None:
        self.event, self.noted = event, False

    def synchronize(self) -> None:
        self.event.synchronize()
        self._note()

    def query(self) -> bool:
        done = self.event.query()
        if done:
            self._note()
        return done

    def _note(self) -> None:
        if not self.noted:
            self.noted = True
            EVENTS.append(("ready", time.perf_counter()))


def instrument() -> None:
    mark(runner.ModelRunner, "stepping", "step")
    mark(runner.ModelRunner, "flushing", "flush")
    mark(runner.ModelRunner, "_finish", "finish", "runner")
    mark(runner.ModelRunner, "_forward", "forward", "runner")
    mark(runner.ModelRunner, "_sample", "sample", "runner")
    mark(step_inputs.StepInputs, "build", "inputs")
    mark(cuda_graphs.StepGraphs, "run", "replay")
    mark(cuda_graphs.StepGraphs, "run_mixed", "replay_mixed")
    mark(cuda_graphs.StepGraphs, "run_verify", "replay_verify")
    mark(drafting.Drafting, "_propose", "propose")  # (within the runner's calls: profiled there)
    mark(scheduler.Scheduler, "on_result", "on_result", "loop")
    mark(scheduler.Scheduler, "schedule", "schedule", "loop")
    mark(scheduler.Scheduler, "on_feedback", "feedback", "loop")
    mark(kv_cache_manager.KVCacheManager, "process", "kv", "loop")
    mark(request_actor.RequestActor, "_on_outputs", "outputs")
    mark(sampling_state, "_fill_masks", "fill")
    mark(sampling_state.MaskFill, "send", "send")
    mark(sampling_state.SamplingState, "accept_masked", "accept")
    queue = runner.ModelRunner._queue

    def timed_queue(self, sampling):
        flight = queue(self, sampling)
        if flight.ready is not None:
            flight.ready = _Ready(flight.ready)
        else:  # (CPU: the tokens are on the host at once)
            EVENTS.append(("ready", time.perf_counter()))
        EVENTS.append(("queued", time.perf_counter()))
        return flight

    runner.ModelRunner._queue = timed_queue


def timeline(events: list[tuple[str, float]]) -> list[dict]:
    """Each tag's median time after the `ready` before it (the n-th occurrence of a tag in a
    step's stretch as tag#n), in order of that median."""
    starts = [i for i, (tag, _) in enumerate(events) if tag == "ready"]
    times = collections.defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        t0, seen = events[a][1], collections.Counter()
        for tag, t in events[a + 1:b]:
            seen[tag] += 1
            times[f"{tag}#{seen[tag]}"].append((t - t0) * 1e6)
    rows = []
    for tag, us in times.items():
        us.sort()
        rows.append({"mark": tag, "steps": len(us), "median_us": us[len(us) // 2]})
    return sorted(rows, key=lambda r: r["median_us"])


def device_profiler():
    import torch
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])


def device_activities(prof) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """(the device's activities, the host's marked calls and CUDA runtime calls), each as
    (start us, end us, name) in order, on the profiler's one clock."""
    device, host = [], []
    for e in prof.profiler.kineto_results.events():
        start = e.start_ns() / 1e3
        act = (start, start + e.duration_ns() / 1e3, e.name())
        if e.device_type().name == "CUDA":
            device.append(act)
        elif e.is_user_annotation() or e.name().startswith("cuda"):
            host.append(act)
    return sorted(device), sorted(host)


def busy_runs(acts: list, gap_us: float, apart=lambda name: False) -> list[list]:
    """Device activities (start, end, name) in order, as runs [start, end, names] of activities
    closer than gap_us; an activity `apart` says so of stays a run of its own."""
    runs: list[list] = []
    for s0, s1, name in acts:
        if runs and s0 - runs[-1][1] <= gap_us and not apart(name) and not apart(runs[-1][2][-1]):
            runs[-1][1] = max(runs[-1][1], s1)
            runs[-1][2].append(name)
        else:
            runs.append([s0, s1, [name]])
    return runs


def some_cycles(device: list, host: list, count: int = 3, gap_us: float = 5.0) -> list[list]:
    """`count` steps from the middle of the run, each from the end of a copy to pinned host memory
    to the next: the host's events and the device's activities as (start, end, name) relative to
    that end, the device's runs of kernels without gaps over gap_us as one ("N kernels: first ..
    last"), each copy alone."""
    anchors = [end for start, end, name in device if "DtoH" in name]
    middle = len(anchors) // 2
    cycles = []
    for a, b in zip(anchors[middle:middle + count], anchors[middle + 1:middle + count + 1]):
        runs = busy_runs([act for act in device if a <= act[0] < b], gap_us, lambda name: "Memcpy" in name)
        rows = [[round(s0 - a, 1), round(s1 - a, 1),
                 "device: " + (names[0][:50] if len(names) == 1 else
                               f"{len(names)} kernels: {names[0][:40]} .. {names[-1][:40]}")]
                for s0, s1, names in runs]
        rows += [[round(s0 - a, 1), round(s1 - a, 1), "host: " + name[:60]] for s0, s1, name in host
                 if a - 2000 <= s0 < b and not name.startswith(("cudaGetDevice", "cudaPeekAtLastError"))]
        cycles.append(sorted(rows))
    return cycles


def device_stretches(acts: list[tuple[float, float, str]], gap_us: float = 20.0) -> dict:
    """The device's activities per step, from the end of each copy to pinned host memory (the
    step's tokens) to the next: busy stretches split at gaps over gap_us, the n-th stretch's median
    start, end and activity count, and the names it held."""
    anchors = [end for start, end, name in acts if "DtoH" in name]
    stretches = collections.defaultdict(list)
    names = collections.defaultdict(collections.Counter)
    busy = []
    i = 0
    for a, b in zip(anchors, anchors[1:]):
        while i < len(acts) and acts[i][0] < a:
            i += 1
        cycle, j = [], i
        while j < len(acts) and acts[j][0] < b:
            cycle.append(acts[j])
            j += 1
        runs = busy_runs(cycle, gap_us)
        busy.append(sum(r[1] - r[0] for r in runs))
        for n, (s0, s1, ns) in enumerate(runs):
            stretches[n].append((s0 - a, s1 - a, len(ns)))
            names[n].update(x[:60] for x in ns)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0
    rows = [{"stretch": n, "cycles": len(v), "start_us": med([x[0] for x in v]), "end_us": med([x[1] for x in v]),
             "activities": med([x[2] for x in v]), "names": dict(names[n].most_common(12))}
            for n, v in sorted(stretches.items())]
    return {"cycles": len(busy), "cycle_us": med([b - a for a, b in zip(anchors, anchors[1:])]),
            "busy_us": med(busy), "stretches": rows}


def main() -> None:
    global PROFILING
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path(llmserve.__file__).parent / "builtin_model"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--speculative", help="a speculative_config as JSON (its model 'builtin': the built-in model)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", choices=["decode-b1", "w-small"], help="a workload's model, dummy weights")
    ap.add_argument("--constrained", action="store_true", help="every request inside a JSON string")
    ap.add_argument("--no-jump", action="store_true", help="--constrained with jump-forward off")
    ap.add_argument("--profile")
    ap.add_argument("--kernels")
    ap.add_argument("--json")
    args = ap.parse_args()
    instrument()
    builtin = str(Path(llmserve.__file__).parent / "builtin_model")
    speculative = json.loads(args.speculative) if args.speculative else None
    if speculative and speculative.get("model") == "builtin":
        speculative["model"] = builtin
    model, extra = args.model, {}
    if args.shape:
        workload = {"decode-b1": decode_b1, "w-small": w_small}[args.shape]()
        model, extra = workload.write_model_dir(tempfile.mkdtemp()), {"load_format": "dummy"}
        if args.shape == "w-small":
            workload.write_tokenizer(model)
    llm = LLM(model, dtype=args.dtype, max_model_len=args.tokens + 64, max_num_seqs=max(args.batch, 8),
              enable_prefix_caching=False, async_scheduling=not args.sync, log_interval_s=0,
              speculative_config=speculative, **extra)
    sched = llm.engine.scheduler
    if speculative:  # held on: every step checks what was proposed
        sched.spec_control.active, sched.spec_control.record = True, lambda *a, **kw: None
    vocab = llm.engine.spec.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(64)]} for _ in range(args.batch)]
    params = [SamplingParams(max_tokens=args.tokens, temperature=args.temperature, ignore_eos=not args.constrained,
                             seed=None if args.seed is None else args.seed + i,
                             structured_outputs=StructuredOutputsParams(regex=JSON_STRING_REGEX, jump_forward=not args.no_jump)
                             if args.constrained else None)
              for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    EVENTS.clear()
    PROFILING = args.profile is not None
    steps = sum(sched.iteration_tokens)
    global ANNOTATE
    ANNOTATE = bool(args.kernels)
    device_trace = device_profiler() if args.kernels else contextlib.nullcontext()
    with device_trace as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    steps = sum(sched.iteration_tokens) - steps
    PROFILING = False
    llm.shutdown()
    rows = timeline(EVENTS)
    for r in rows:
        print(f"{r['mark']:16s} {r['median_us']:9.1f} us  ({r['steps']} steps)")
    print(f"{1e3 * wall / steps:.3f} ms a step ({steps} steps), batch {args.batch}, sync {args.sync}, "
          f"temperature {args.temperature}, seed {args.seed}, speculative {speculative}, constrained {args.constrained}")
    if args.profile:
        for name, prof in PROFILES.items():
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(60)
            Path(f"{args.profile}.{name}.txt").write_text(out.getvalue())
    if args.kernels:
        device, host = device_activities(prof)
        Path(args.kernels).write_text(json.dumps({**device_stretches(device), "some_steps": some_cycles(device, host)},
                                                 indent=1))
    report({"batch": args.batch, "sync": args.sync, "constrained": args.constrained, "jump": not args.no_jump, "tokens": args.tokens, "model": args.shape or args.model,
            "temperature": args.temperature, "seed": args.seed,
            "speculative": speculative, "steps": steps, "ms_per_step": 1e3 * wall / steps, "timeline": rows},
           args.json, echo=False)


if __name__ == "__main__":
    main()
