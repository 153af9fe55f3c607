"""Experiment: silu_and_mul (one program a row vs a 2-D grid) and greedy argmax (torch vs sample_rows at T = 0)."""
import json, sys, torch, triton, triton.language as tl
from triton.testing import do_bench_cudagraph
from llmserve.kernels.fused import silu_and_mul
from llmserve.kernels.sampling import sample_rows

@triton.jit
def _old(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

def old_silu(x):
    rows, two_n = x.shape; n = two_n // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _old[(rows,)](x, out, x.stride(0), out.stride(0), n, BLOCK=min(triton.next_power_of_2(n), 2048))
    return out

res = []
for n in (14336, 7168, 3072):
    for rows in (1, 16, 256, 8192):
        x = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(old_silu(x), silu_and_mul(x))
        a = do_bench_cudagraph(lambda: old_silu(x)) * 1e3; b = do_bench_cudagraph(lambda: silu_and_mul(x)) * 1e3
        res.append({"op": "silu_and_mul", "n": n, "rows": rows, "old_us": a, "new_us": b}); print(res[-1], flush=True)
for V in (128256, 151936):
    for B in (1, 4, 16, 64, 256):
        x = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
        t = torch.zeros(B, device="cuda"); k = torch.arange(B, device="cuda", dtype=torch.int64)
        assert torch.equal(x.argmax(-1), sample_rows(x, t, k))
        a = do_bench_cudagraph(lambda: x.argmax(-1)) * 1e3; b = do_bench_cudagraph(lambda: sample_rows(x, t, k)) * 1e3
        res.append({"op": "greedy", "V": V, "B": B, "argmax_us": a, "sample_rows_us": b}); print(res[-1], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
