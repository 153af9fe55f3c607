"""Plain-torch paged attention and KV-cache write: the CPU backend's implementation and the test oracle.

KV cache layout (shared with the Triton kernels), one pair per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s  ->  block s // block_size, row s % block_size

FP8 cache (kv_cache_dtype = "fp8"): k_cache/v_cache hold float8_e4m3fn and k_scale/v_scale
[num_blocks, block_size, num_kv_heads] float32 hold one scale per token and KV head:
stored = key / scale with scale = max|key over head_dim| / 448, so a token's keys use e4m3's whole
range whatever their magnitude; the attention reads stored * scale.

A step's batch is flattened: request i owns query rows [query_start_loc[i], query_start_loc[i+1])
and its sequence is seq_lens[i] tokens long, the last query_len of which are this step's queries
(positions seq_len - query_len .. seq_len - 1). Query t attends keys at positions <= its own.
"""

from __future__ import annotations

import torch


FP8_MAX = 448.0
_MIN_SCALE = 1e-12


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], float32 scale [...]) with one scale per vector."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(_MIN_SCALE * FP8_MAX) * (1.0 / FP8_MAX)
    return (x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Store key/value [T, Hkv, D] into the cache slots slot_mapping [T] (int64; < 0 skips the token);
    with scale tensors (an FP8 cache), quantize per token and head first."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = x[keep]
        if scales is not None:
            x, s = quantize_kv_reference(x)
            scales.view(-1, scales.shape[2])[slots] = s
        cache.view(-1, *cache.shape[2:])[slots] = x.to(cache.dtype)


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged cache; returns [T, Hq, D] in query's dtype.

    block_tables [B, max_blocks] int32, query_start_loc [B + 1] int32, seq_lens [B] int32.
    Scores and softmax in float32; an FP8 cache is dequantized with k_scale/v_scale. `window`:
    query at position i sees keys j with i - window < j <= i (sliding-window attention); `softcap`:
    scaled scores become softcap * tanh(score / softcap) before the mask (logit soft-capping).
    """
    out = torch.empty_like(query)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = sorted((i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1), key=lens.__getitem__)
    per_key = k_cache.shape[2] * k_cache.shape[3]
    while decode:  # shortest first, as many rows a pass as keep its gathered keys within _DECODE_GATHER
        n = 1
        while n < len(decode) and (n + 1) * lens[decode[n]] * per_key <= _DECODE_GATHER:
            n += 1
        _decode_rows(query, k_cache, v_cache, block_tables, starts, lens, decode[:n], scale, k_scale, v_scale,
                     window, softcap, out)
        decode = decode[n:]
    for i, seq_len in enumerate(lens):
        q = query[starts[i]:starts[i + 1]].float()
        q_len = q.shape[0]
        if q_len <= 1:  # none, or a decode row done above
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len].float()
        if k_scale is not None:
            k = k * k_scale[blocks].reshape(-1, num_kv_heads)[:seq_len, :, None]
            v = v * v_scale[blocks].reshape(-1, num_kv_heads)[:seq_len, :, None]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden = hidden | (k_pos[None, None, :] <= q_pos[None, :, None] - window)
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


_DECODE_GATHER = 1 << 24
"""Elements of the keys (and as many of the values) one batched decode pass gathers at most: 64 MB
each in float32, whatever the batch and its contexts."""


def _decode_rows(query, k_cache, v_cache, block_tables, starts, lens, rows, scale, k_scale, v_scale, window,
                 softcap, out) -> None:
    """The requests `rows`, one query each, in one batched pass: their keys gathered into
    [R, max_len] (a shorter sequence's tail masked), so a decode step costs a few torch calls
    instead of a few per request."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    idx = torch.tensor(rows, device=query.device)
    seq = torch.tensor([lens[i] for i in rows], device=query.device)
    max_len = max(lens[i] for i in rows)
    blocks = block_tables[idx, :-(-max_len // block_size)].long()
    k = k_cache[blocks].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len].float()
    v = v_cache[blocks].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len].float()
    if k_scale is not None:
        k = k * k_scale[blocks].reshape(len(rows), -1, num_kv_heads)[:, :max_len, :, None]
        v = v * v_scale[blocks].reshape(len(rows), -1, num_kv_heads)[:, :max_len, :, None]
    k_pos = torch.arange(max_len, device=query.device)
    hidden = k_pos[None, :] >= seq[:, None]
    if window is not None:
        hidden = hidden | (k_pos[None, :] <= seq[:, None] - 1 - window)
    v = v.masked_fill(hidden[:, :, None, None], 0.0)  # past a sequence's end the cache holds anything, NaN too
    rows_at = torch.tensor([starts[i] for i in rows], device=query.device)
    q = query[rows_at].float().view(len(rows), num_kv_heads, -1, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores.masked_fill(hidden[:, None, None, :], float("-inf")), dim=-1)
    out[rows_at] = torch.einsum("bhgk,bkhd->bhgd", probs, v).reshape(len(rows), -1, head_dim).to(query.dtype)


def cascade_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float, cascade, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention_reference's result computed the cascade way (attention.CascadeMetadata):
    each row attends its groups' prefix keys read through the group's own block table (seq[g]'s),
    then its sequence's keys from kv_start on, in one softmax. Equal to plain attention exactly
    when the groups are right (their members' tables do hold the same blocks there)."""
    out = torch.empty_like(query)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    row_start, rows = cascade.row_start.tolist(), cascade.rows.tolist()
    row_groups: dict[int, list[int]] = {}
    for g in range(len(cascade.seq)):
        for r in rows[row_start[g]:row_start[g + 1]]:
            row_groups.setdefault(r, []).append(g)

    def keys(seq: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi, device=block_tables.device)
        slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        if k_scale is not None:
            k = k * k_scale.reshape(-1, num_kv_heads)[slots][..., None]
            v = v * v_scale.reshape(-1, num_kv_heads)[slots][..., None]
        return k, v

    starts, lens, kv_start = query_start_loc.tolist(), seq_lens.tolist(), cascade.kv_start.tolist()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            t, pos = starts[i] + j, seq_len - q_len + j
            parts = [keys(int(cascade.seq[g]), int(cascade.lo[g]), int(cascade.hi[g])) for g in row_groups.get(t, [])]
            parts.append(keys(i, kv_start[i], pos + 1))
            k = torch.cat([p[0] for p in parts]).repeat_interleave(group, dim=1)
            v = torch.cat([p[1] for p in parts]).repeat_interleave(group, dim=1)
            probs = torch.softmax(torch.einsum("hd,khd->hk", query[t].float(), k) * scale, dim=-1)
            out[t] = torch.einsum("hk,khd->hd", probs, v).to(query.dtype)
    return out
