"""The decoder's work outside attention as the engine runs it, against the same model under torch.compile.

    python scripts/compile_bench.py [--model w-small|w-large] [--ms 1,16,64,128,256,2048,8192]
                                    [--layers N] [--autotune 64,256] [--json out.json]
    python scripts/compile_bench.py --check      # CPU: the torch path and its compiled form agree, no graph break

Issue 4 asks for torch.compile on the non-attention parts "if it measurably helps and does not blow
up start-up". One model with dummy weights (the engine's loader and layers; W-small's or W-large's
shape, its first --layers decoder layers, distinct weights each) runs a step of M tokens (embedding,
the layers, final norm, lm_head) four ways, each captured in one CUDA graph and timed as the engine
replays its steps (graph_timing.graph_us):

- engine: the CUDA backend's kernels (add + RMSNorm, q/k norm + rotary, the PDL decode GEMM with
  SiLU·mul up to its rows, the gated TMA GEMM at prefill sizes, cuBLAS otherwise);
- torch: the same layers on the CPU backend's torch code (RMSNorm, rotary, SiLU·mul as separate
  torch operations, as transformers runs them) with F.linear (cuBLAS) for every projection;
- compiled: that torch code under torch.compile (inductor, fullgraph), dynamic=True: one compile for
  every batch size, as a ladder of ~40 captured sizes needs;
- autotuned (--autotune sizes): mode "max-autotune-no-cudagraphs", dynamic=False, compiled for each
  size: Triton GEMM templates with fused epilogues searched against cuBLAS.

Attention is left out of all four (a stand-in returns q and writes no cache): it is the same Triton
kernel whichever way the rest runs, and compile cannot enter it. Each row: µs a step, the engine's
time over it, the first call's seconds (the compile, start-up's cost) and the logits' largest
difference from the torch path's.
"""

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from llmserve.bench.report import report
from llmserve.bench.workloads import LLAMA31_8B, QWEN3_0_6B
from llmserve.model.layers import Linear
from llmserve.model.loader import load_model
from llmserve.model.spec import ModelSpec
from llmserve.plugins.cpu import CPUBackend
from llmserve.quantization import Unquantized

MODELS = {"w-small": QWEN3_0_6B, "w-large": LLAMA31_8B}
TINY = {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
NO_CACHE = SimpleNamespace(slot_mapping=None)  # the stand-in attention reads no metadata


class StandIn:
    """Attention left out: its output is the rotated q, and no key or value is stored."""

    def attention(self, q, cache, meta, scale):
        return q

    def rotary_and_write_kv(self, q, k, v, positions, cos, sin, cache, slot_mapping, *norm) -> None:
        self.rotary(q, k, positions, cos, sin, *norm)


class TorchOps(StandIn, CPUBackend):
    pass


class CuBLAS(Unquantized):
    """Every projection through F.linear, SiLU·mul after it (the torch path)."""

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer, x, silu_and_mul):
        return silu_and_mul(F.linear(x, layer.weight, layer.bias))


def use(model, backend, quant) -> None:
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
        if isinstance(module, Linear):
            module.quant = quant


def build(config: dict, layers: int, device: str):
    spec = ModelSpec.from_dict({**config, "num_hidden_layers": layers})
    model = load_model("", spec, TorchOps(), dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                       device=torch.device(device), max_positions=4096, load_format="dummy")

    def step(ids, positions):
        return model.compute_logits(model(ids, positions, NO_CACHE))

    return model, spec, step


def inputs(spec: ModelSpec, m: int, device: str):
    gen = torch.Generator(device="cpu").manual_seed(m)
    ids = torch.randint(0, spec.vocab_size, (m,), generator=gen).to(device)
    positions = torch.randint(0, 4096, (m,), generator=gen).to(device)
    return ids, positions


def first_call_s(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def check() -> None:
    """CPU: the torch path compiles without a graph break and gives its eager logits."""
    model, spec, step = build(TINY, TINY["num_hidden_layers"], "cpu")
    use(model, TorchOps(), CuBLAS())
    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for m in (3, 16):
            ids, pos = inputs(spec, m, "cpu")
            torch.testing.assert_close(compiled(ids, pos), step(ids, pos), rtol=1e-4, atol=1e-4)
    print("compile_bench --check: the compiled torch path matches eager at 3 and 16 tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="w-small", choices=list(MODELS))
    ap.add_argument("--ms", default="1,16,64,128,256,2048,8192")
    ap.add_argument("--layers", type=int, help="decoder layers (default: all of the model's)")
    ap.add_argument("--autotune", default="64,256", help="sizes to compile with max-autotune ('' for none)")
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    from graph_timing import graph_us
    from llmserve.plugins.cuda import CUDABackend

    class EngineKernels(StandIn, CUDABackend):
        pass

    config = MODELS[args.model]
    model, spec, step = build(config, args.layers or config["num_hidden_layers"], "cuda")
    sizes = [int(m) for m in args.ms.split(",")]
    rows = {m: {"M": m} for m in sizes}
    reference = {}  # the torch path's logits

    def timed(name: str, fn, m: int) -> None:
        ids, pos = inputs(spec, m, "cuda")
        rows[m][f"{name}_first_call_s"] = first_call_s(fn, ids, pos)
        out = fn(ids, pos).float()
        rows[m][f"{name}_diff"] = (out - reference.setdefault(m, out)).abs().max().item()
        rows[m][f"{name}_us"] = graph_us(lambda i: fn(ids, pos))

    torch.set_grad_enabled(False)
    for name, backend, quant in (("torch", TorchOps(), CuBLAS()), ("engine", EngineKernels(), Unquantized())):
        use(model, backend, quant)
        for m in sizes:
            timed(name, step, m)
    use(model, TorchOps(), CuBLAS())
    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    for m in sizes:
        timed("compiled", compiled, m)
    for m in [int(s) for s in args.autotune.split(",") if s]:
        if m in rows:
            torch._dynamo.reset()
            timed("autotuned", torch.compile(step, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs"), m)
    for row in rows.values():
        for name in ("torch", "compiled", "autotuned"):
            if f"{name}_us" in row:
                row[f"engine_over_{name}"] = row["engine_us"] / row[f"{name}_us"]
    result = {"model": args.model, "layers": spec.num_layers, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": [
                  {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows.values()]}
    for r in result["rows"]:
        print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    report(result, args.json, echo=False)


if __name__ == "__main__":
    main()
