"""`draft`: speculative decoding's draft-model proposer. A small checkpoint with the target's
tokenizer (`speculative.model`) runs on the engine's own model code and attention backend, with a
paged KV cache of its own.

Per request it keeps the tokens its cache holds. Each call, for the requests asked:

    known   = prompt + output                       (the target's tokens so far)
    common  = the longest prefix of its cached tokens that `known` shares
              (drafts the target rejected since fall away here)
    pass 0:   one forward pass over every request's known[common:] (a new request: its whole
              prompt); the argmax at each one's last position is its first draft
    chain:    passes 1 .. k - 1 of one token per request, each feeding the argmax of the pass
              before on the device (_Chain); a request asked for fewer drafts stops early
    the host reads all the drafts at once. The cache then holds known + drafts[:-1].

Both parts replay CUDA graphs when the engine captures its own (`capture_graphs`): pass 0 the
StepGraphs of a decode or mixed step (the catch-up is one or two tokens a request in steady
state), the chain one graph per batch size for all k - 1 passes. A small draft is bound by its
launches, so eagerly its proposals cost several of the target's steps.

Drafts are the draft model's greedy choices: a deterministic proposal, which the engine checks
exactly (llmserve/speculative.py) for greedy and sampled requests alike. A request whose blocks do
not fit in the draft's cache gets no drafts (and gives its cache back); the cache holds
`max_num_seqs` requests of max_model_len tokens, capped at DRAFT_CACHE_TOKENS.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.attention import AttentionMetadata
from llmserve.config import SpeculativeConfig
from llmserve.core.block_pool import BlockPool
from llmserve.hookspecs import hookimpl
from llmserve.model.cuda_graphs import StepGraphs, graph_sizes
from llmserve.model.kv_cache import KVCacheLayout
from llmserve.model.loader import load_model
from llmserve.model.spec import ModelSpec
from llmserve.model.step_inputs import Staging, StepInputs
from llmserve.speculative import ProposerContext

DRAFT_CACHE_TOKENS = 1 << 20
"""Most tokens the draft model's KV cache holds."""


@dataclass(slots=True)
class _Cached:
    tokens: array = field(default_factory=lambda: array("q"))  # what its cache holds, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        if not config.model:
            raise ValueError("speculative.model must name the draft checkpoint's directory for method 'draft'")
        spec = ModelSpec.from_dir(config.model)
        if spec.vocab_size != context.vocab_size:
            raise ValueError(f"speculative.model {config.model!r} has a vocabulary of {spec.vocab_size} tokens, the "
                             f"model {context.vocab_size}: the draft must share the model's tokenizer")
        self.device, self.block_size = context.device, context.block_size
        self.k = config.num_speculative_tokens
        self.model = load_model(config.model, spec, context.backend, dtype=context.dtype, device=context.device,
                                max_positions=context.max_model_len)
        tokens = min(context.max_num_seqs * context.max_model_len, DRAFT_CACHE_TOKENS)
        num_blocks = -(-tokens // self.block_size)
        self.model.set_kv_caches(KVCacheLayout(spec, self.block_size, context.dtype, context.device).allocate(num_blocks))
        self.pool = BlockPool(num_blocks)
        self.staging = Staging(context.device)
        self.cached: dict[str, _Cached] = {}
        self.max_blocks = -(-(context.max_model_len + self.k) // self.block_size)  # a request's table, drafts included
        # nobody speculates above disable_by_batch_size running requests: graphs up to that
        self.graph_batch = min(context.max_num_seqs, config.disable_by_batch_size)
        self.graphs: StepGraphs | None = None  # pass 0's
        self.chain = _Chain(self.model, self.staging, self.block_size, context.max_num_seqs, self.k - 1,
                            self.max_blocks)

    def capture_graphs(self, emulate: bool = False) -> None:
        """Capture pass 0's decode and mixed graphs (up to k + 1 tokens a request) and the chain's,
        for batches up to the speculating limit. emulate: the padded buffers run eagerly (tests)."""
        self.graphs = StepGraphs(self.model, self.staging, self.graph_batch, self.graph_batch * (self.k + 1),
                                 self.max_blocks, emulate=emulate)
        self.graphs.capture()
        self.chain.capture(self.graph_batch, emulate)

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if (cached := self.cached.pop(req_id, None)) is not None:
                self.pool.free(cached.blocks)

    @torch.inference_mode()
    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        rows, feeds, starts, wants = [], [], [], []  # requests drafted for, the tokens each feeds first, where they start, drafts
        for i, (req_id, (prompt, output), limit) in enumerate(zip(req_ids, sequences, limits)):
            limit = min(limit, self.k)
            if limit <= 0:
                continue
            known = prompt + array("q", output)
            cached = self.cached.setdefault(req_id, _Cached())
            common = _common_prefix(cached.tokens, known)
            if common == len(known):  # (never: the last token is always new) keep one to feed
                common -= 1
            need = -(-(len(known) + limit) // self.block_size) - len(cached.blocks)
            if need > 0:
                more = self.pool.allocate(need)
                if more is None:  # the draft's cache is full: no drafts, and its blocks go back
                    self.forget([req_id])
                    continue
                cached.blocks += more
            cached.tokens = known
            rows.append(i)
            feeds.append(np.frombuffer(known[common:], dtype=np.int64))  # (a copy: `known` grows later)
            starts.append(common)
            wants.append(limit)
        if not rows:
            return drafts
        blocks = [self.cached[req_ids[i]].blocks for i in rows]
        tables = np.zeros((len(rows), max(map(len, blocks))), dtype=np.int32)
        for row, ids in enumerate(blocks):
            tables[row, :len(ids)] = ids
        first = self._first(feeds, np.array(starts, dtype=np.int32), tables)
        out = first[:, None]
        if max(wants) > 1:  # draft p (p >= 2) is fed at the position after the known tokens' p - 2
            ends = np.array([s + len(f) for s, f in zip(starts, feeds)], dtype=np.int64)
            out = torch.cat([out, self.chain.run(first, ends, np.array(wants, dtype=np.int32) - 1, tables)], dim=1)
        for i, row, want in zip(rows, out.tolist(), wants):  # the host waits here, once
            drafts[i] = row[:want]
            self.cached[req_ids[i]].tokens.extend(drafts[i][:-1])  # its cache holds all drafts but the last
        return drafts

    def _first(self, feeds: list[np.ndarray], starts: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Pass 0: each request's `feeds` from position `starts`, through a captured graph where
        one fits; the argmax token after each one's last (int64 [requests], on the device)."""
        query_lens = np.array([len(f) for f in feeds], dtype=np.int32)
        inputs = StepInputs.build(np.concatenate(feeds), query_lens, starts, tables, self.block_size)
        graphs, S, T = self.graphs, inputs.num_reqs, inputs.num_tokens
        if graphs is not None and inputs.max_query_len == 1 and graphs.fits(S):
            hidden = graphs.run(inputs)
        elif graphs is not None and graphs.fits_mixed(T, S):
            hidden = graphs.run_mixed(inputs)
        else:
            hidden = self.model(*self.staging.forward_inputs(inputs))
        last = self.staging.to_device((inputs.query_start_loc[1:] - 1).astype(np.int64))
        return self.model.compute_logits(hidden[last]).argmax(-1)


class _Chain:
    """The draft's passes 1 .. P, one token per request each, chained on the device: pass p feeds
    the argmax of pass p - 1 and derives its positions, KV slots and context lengths from static
    buffers, so no pass waits for the host and all P replay as one CUDA graph per batch size
    (graph_sizes up to the speculating limit; larger batches run the same code eagerly).

    static buffer   rows 0 .. n - 1 (this call)                 rows n .. b - 1 (padding)
    ids             each request's first draft (pass 0's)      stale
    positions       the first draft's position                 0
    counts          passes the request makes (its drafts - 1)  0
    block_tables    its blocks                                 stale (never read through)

    A row past its count (and every padding row) writes no KV (slot -1), attends one key and is
    fed position 0: its argmaxes are computed and ignored.
    """

    def __init__(self, model, staging: Staging, block_size: int, capacity: int, passes: int, max_blocks: int) -> None:
        self.model, self.staging, self.block_size, self.passes = model, staging, block_size, passes
        device, i32, i64 = staging.device, torch.int32, torch.int64
        self.ids = torch.zeros(capacity, dtype=i64, device=device)
        self.positions = torch.zeros(capacity, dtype=i64, device=device)
        self.counts = torch.zeros(capacity, dtype=i32, device=device)
        self.seq_order = torch.arange(capacity, dtype=i32, device=device)
        self.block_tables = torch.zeros(capacity, max_blocks, dtype=i32, device=device)
        self.qsl = torch.arange(capacity + 1, dtype=i32, device=device)
        self.rows = torch.arange(capacity, dtype=i64, device=device)
        self.sizes: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        """All passes over the static buffers' first b rows: the argmaxes, int64 [b, passes]."""
        ids, start, tables = self.ids[:b], self.positions[:b], self.block_tables[:b]
        last_block = tables.shape[1] - 1
        out = []
        for p in range(self.passes):
            live = self.counts[:b] > p
            pos = start + p
            block = tables[self.rows[:b], torch.clamp(pos // self.block_size, max=last_block)]
            slots = torch.where(live, block.to(torch.int64) * self.block_size + pos % self.block_size, -1)
            seq_lens = torch.where(live, pos + 1, 1).to(torch.int32)
            meta = AttentionMetadata(slots, tables, self.qsl[:b + 1], seq_lens, max_query_len=1,
                                     seq_order=self.seq_order[:b])
            hidden = self.model(ids, torch.where(live, pos, 0), meta)
            ids = self.model.compute_logits(hidden).argmax(-1)
            out.append(ids)
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def capture(self, max_batch: int, emulate: bool) -> None:
        self.sizes = graph_sizes(max_batch)
        if emulate or self.passes == 0:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (Triton compiles, cuBLAS handles)
            for b in self.sizes:
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph

    def run(self, first: torch.Tensor, positions: np.ndarray, counts: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Drafts 2 .. for n requests: `first` their first drafts (int64 [n], on the device),
        `positions` where each is fed (int64 [n]), `counts` passes each makes (int32 [n], at most
        P), `tables` their block tables (int32 [n, width]). Returns int64 [n, P] on the device
        (row i's first counts[i] entries are its drafts)."""
        n, width = tables.shape
        b = next((s for s in self.sizes if s >= n), n)
        host, staged = self.staging.empty((b,), np.int64)
        host[:n], host[n:] = positions, 0
        self.positions[:b].copy_(staged, non_blocking=True)
        counts_order, staged = self.staging.empty((2, b), np.int32)  # [counts | seq_order], padded
        counts_order[0, :n], counts_order[0, n:] = counts, 0
        counts_order[1] = np.argsort(-host - counts_order[0], kind="stable")  # longest context first
        self.counts[:b].copy_(staged[0], non_blocking=True)
        self.seq_order[:b].copy_(staged[1], non_blocking=True)
        self.block_tables[:n, :width].copy_(self.staging.stage(tables), non_blocking=True)
        self.ids[:n].copy_(first)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        with torch.inference_mode():
            return self._forward(b)[:n]


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.frombuffer(a[:n], dtype=np.int64) != np.frombuffer(b[:n], dtype=np.int64))
    return int(diff[0])


@hookimpl
def llmserve_register_proposers(register) -> None:
    register("draft", DraftModelProposer)
