"""CPU backend: the plain-torch reference kernels."""

from __future__ import annotations

import os

import torch

from llmserve.attention import AttentionBackend, AttentionMetadata, KVCache
from llmserve.hookspecs import hookimpl
from llmserve.kernels.reference import cascade_attention_reference, paged_attention_reference, write_kv_reference
from llmserve.kernels.fused import rms_norm_reference, rotary_reference, silu_and_mul_reference
from llmserve.kernels.sampling_reference import sample_filtered_rows_reference, sample_rows_reference


class CPUBackend(AttentionBackend):
    name = "cpu"
    supports_cascade = True  # the reference; its cost model never picks it (plain torch gains nothing)

    def write_kv(self, key, value, cache: KVCache, slot_mapping) -> None:
        write_kv_reference(key, value, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale)

    def attention(self, query, cache: KVCache, meta: AttentionMetadata, scale: float, window=None,
                  softcap=None) -> torch.Tensor:
        if meta.cascade is not None:
            return cascade_attention_reference(query, cache.k, cache.v, meta.block_tables, meta.query_start_loc,
                                               meta.seq_lens, scale, meta.cascade, cache.k_scale, cache.v_scale)
        return paged_attention_reference(query, cache.k, cache.v, meta.block_tables, meta.query_start_loc,
                                         meta.seq_lens, scale, cache.k_scale, cache.v_scale, window, softcap)

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm_reference(x, weight, eps, residual)

    def rotary(self, q, k, positions, cos, sin, q_weight=None, k_weight=None, eps=0.0) -> None:
        rotary_reference(q, k, positions, cos, sin, q_weight, k_weight, eps)

    def silu_and_mul(self, x) -> torch.Tensor:
        return silu_and_mul_reference(x)

    def sample_rows(self, logits, temperature, key) -> torch.Tensor:
        return sample_rows_reference(logits, temperature, key)

    def sample_filtered_rows(self, logits, temperature, top_k, top_p, min_p, key, rows, out) -> torch.Tensor:
        return sample_filtered_rows_reference(logits, temperature, top_k, top_p, min_p, key, rows, out)

    def memory_available(self, device: torch.device) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


@hookimpl
def llmserve_select_backend(device: torch.device, config) -> AttentionBackend | None:
    return CPUBackend() if device.type == "cpu" else None
