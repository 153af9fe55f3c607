"""The KV cache on the device: its layout, its allocation, and how many blocks fit.

Per layer, K and V are [num_blocks, block_size, num_kv_heads, head_dim] in the cache dtype (the
model's, or FP8-e4m3 with a float32 scale per token and head, [num_blocks, block_size,
num_kv_heads]); num_kv_heads are this tensor-parallel rank's. On CUDA the number of blocks is what `gpu_memory_utilization` leaves of the
device's memory after the weights and the activation peak of the largest step the scheduler can
build, measured by running that step once (its K/V written to a cache just large enough).
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from llmserve.attention import AttentionBackend, KVCache
from llmserve.config import EngineConfig
from llmserve.distributed.parallel_state import tp
from llmserve.model.sampler import SamplingBatch, sample
from llmserve.model.spec import ModelSpec
from llmserve.model.step_inputs import Staging, StepInputs

log = structlog.get_logger("llmserve.runner")


class KVCacheLayout:
    def __init__(self, spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.spec, self.block_size, self.dtype, self.device = spec, block_size, dtype, device
        self.kv_heads = tp().kv_heads(spec.num_kv_heads)  # this tensor-parallel rank's

    def block_bytes(self) -> int:
        return self.block_size * self.spec.kv_bytes_per_token(self.dtype) * self.kv_heads // self.spec.num_kv_heads

    def allocate(self, num_blocks: int) -> list[KVCache]:
        """One zeroed cache per layer."""
        shape = (num_blocks, self.block_size, self.kv_heads, self.spec.head_dim)

        def layer_cache() -> KVCache:
            cache = KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device))
            if self.dtype == torch.float8_e4m3fn:
                cache.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
                cache.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
            return cache

        return [layer_cache() for _ in range(self.spec.num_layers)]

    def num_blocks(self, config: EngineConfig, model, backend: AttentionBackend, staging: Staging,
                   max_model_len: int) -> int:
        """KV blocks that fit: fixed by config, from cpu_kv_cache_gib on CPU, or on CUDA what
        gpu_memory_utilization leaves after weights and the peak of a profiling step."""
        cache = config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type != "cuda":
            return int(cache.cpu_kv_cache_gib * 2**30) // self.block_bytes()
        peak_activations = self._profile_step(config, model, backend, staging, max_model_len)
        free, total = backend.memory_available(self.device)
        budget = total * cache.gpu_memory_utilization - (total - free) - peak_activations
        log.info("kv cache sizing", total_gib=round(total / 2**30, 2), used_gib=round((total - free) / 2**30, 2),
                 activation_peak_gib=round(peak_activations / 2**30, 2), kv_budget_gib=round(budget / 2**30, 2))
        return max(0, int(budget) // self.block_bytes())

    @torch.inference_mode()
    def _profile_step(self, config: EngineConfig, model, backend: AttentionBackend, staging: Staging,
                      max_model_len: int) -> int:
        """Run the largest step the scheduler can build, sampling included; return its peak memory
        beyond the weights."""
        sched = config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_model_len)
        num_seqs = min(sched.max_num_seqs, num_tokens)
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
        lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-int(lens.max()) // self.block_size)
        model.set_kv_caches(self.allocate(num_seqs * blocks_per_seq))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = np.random.default_rng(0).integers(0, self.spec.vocab_size, num_tokens, dtype=np.int64)
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        inputs = StepInputs.build(ids, lens, np.zeros(num_seqs, np.int32), tables, self.block_size)
        input_ids, positions, meta = staging.forward_inputs(inputs)
        hidden = model(input_ids, positions, meta)
        logits = model.compute_logits(hidden[:num_seqs])
        dev, rows = self.device, num_seqs
        batch = SamplingBatch(temperature=torch.ones(rows, device=dev), top_k=torch.full((rows,), 50, device=dev),
                              top_p=torch.full((rows,), 0.9, device=dev), min_p=torch.zeros(rows, device=dev),
                              keys=torch.zeros(rows, dtype=torch.int64, device=dev),
                              filtered_rows=torch.arange(rows, device=dev), max_logprobs=min(20, self.spec.vocab_size))
        sample(logits, batch, backend.sample_rows, backend.sample_filtered_rows, backend.apply_token_mask)
        torch.log_softmax(logits, -1, dtype=torch.float32).topk(batch.max_logprobs, -1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        model.set_kv_caches([None] * self.spec.num_layers)
        del hidden, logits, input_ids
        torch.cuda.empty_cache()
        return peak
