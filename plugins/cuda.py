"""CUDA backend: the Triton kernels (paged attention, KV write, fused norm/rotary/activation, fused
mixture-of-experts, sampling)."""

from __future__ import annotations

import torch

from llmserve.attention import AttentionBackend, AttentionMetadata, KVCache
from llmserve.hookspecs import hookimpl


class CUDABackend(AttentionBackend):
    name = "cuda"
    supports_cascade = True

    def __init__(self) -> None:
        # Imported here: Triton's CUDA driver is only needed when this backend is chosen.
        from llmserve.kernels import cascade, fused, moe
        from llmserve.kernels.cache_write import write_kv
        from llmserve.kernels.paged_attention import paged_attention
        from llmserve.kernels.rejection import check_drafts
        from llmserve.kernels.sampling import sample_filtered_rows, sample_rows
        from llmserve.kernels.token_mask import apply_token_mask
        self._write_kv = write_kv
        self._paged_attention = paged_attention
        self._cascade = cascade
        self._sample_rows = sample_rows
        self._sample_filtered_rows = sample_filtered_rows
        self._fused = fused
        self._moe = moe
        self._apply_token_mask = apply_token_mask
        self._check_drafts = check_drafts

    def write_kv(self, key, value, cache: KVCache, slot_mapping) -> None:
        self._write_kv(key, value, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale)

    def attention(self, query, cache: KVCache, meta: AttentionMetadata, scale: float, window=None,
                  softcap=None) -> torch.Tensor:
        if meta.cascade is not None:  # (the runner gives none to a model with windows or soft-capping)
            return self._cascade.cascade_attention(query, cache.k, cache.v, meta.block_tables, meta.query_start_loc,
                                                   meta.seq_lens, scale, meta.max_query_len, meta.cascade,
                                                   k_scale=cache.k_scale, v_scale=cache.v_scale,
                                                   seq_order=meta.seq_order)
        return self._paged_attention(query, cache.k, cache.v, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, scale, meta.max_query_len, k_scale=cache.k_scale,
                                     v_scale=cache.v_scale, seq_order=meta.seq_order, window=window,
                                     softcap=softcap)

    def cascade_pays(self, sizes, lengths, num_heads, num_kv_heads, head_dim, device, eager_ns=0.0) -> bool:
        from llmserve.kernels.hardware import sm_count
        return self._cascade.worth_it(sizes, lengths, num_heads, num_kv_heads, head_dim, sm_count(device),
                                      extra_ns=eager_ns)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._fused.rms_norm(x, weight, eps, residual)

    def rotary(self, q, k, positions, cos, sin, q_weight=None, k_weight=None, eps=0.0) -> None:
        self._fused.rotary(q, k, positions, cos, sin, q_weight, k_weight, eps)

    def rotary_and_write_kv(self, q, k, v, positions, cos, sin, cache: KVCache, slot_mapping, q_weight=None,
                            k_weight=None, eps=0.0) -> None:
        self._fused.rotary_and_write_kv(q, k, v, positions, cos, sin, cache.k, cache.v, slot_mapping, cache.k_scale,
                                        cache.v_scale, q_weight, k_weight, eps)

    def silu_and_mul(self, x) -> torch.Tensor:
        return self._fused.silu_and_mul(x)

    def fused_moe(self, x, logits, top_k, renormalize, w13, w2, scale13=None, scale2=None) -> torch.Tensor:
        return self._moe.fused_moe(x, logits, top_k, renormalize, w13, w2, scale13, scale2)

    def sample_rows(self, logits, temperature, key) -> torch.Tensor:
        return self._sample_rows(logits, temperature, key)

    def sample_filtered_rows(self, logits, temperature, top_k, top_p, min_p, key, rows, out) -> torch.Tensor:
        return self._sample_filtered_rows(logits, temperature, top_k, top_p, min_p, key, rows, out)

    def check_drafts(self, logits, temperature, keys, drafts, q) -> torch.Tensor:
        return self._check_drafts(logits, temperature, keys, drafts, q)

    def apply_token_mask(self, logits, rows, masks) -> None:
        self._apply_token_mask(logits, rows, masks)

    def memory_available(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)


@hookimpl
def llmserve_select_backend(device: torch.device, config) -> AttentionBackend | None:
    return CUDABackend() if device.type == "cuda" else None
