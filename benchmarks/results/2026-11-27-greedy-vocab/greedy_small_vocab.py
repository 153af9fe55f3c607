import json, sys, torch
from triton.testing import do_bench_cudagraph
from llmserve.kernels.sampling import sample_rows
res = []
for V in (4096, 32000, 256000):
    for B in (1, 16, 256):
        x = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
        t = torch.zeros(B, device="cuda"); k = torch.arange(B, device="cuda", dtype=torch.int64)
        assert torch.equal(x.argmax(-1), sample_rows(x, t, k))
        a = do_bench_cudagraph(lambda: x.argmax(-1)) * 1e3; b = do_bench_cudagraph(lambda: sample_rows(x, t, k)) * 1e3
        res.append({"V": V, "B": B, "argmax_us": round(a, 2), "sample_rows_us": round(b, 2)}); print(res[-1], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
