"""`draft`: speculative decoding's draft-model proposer. A small checkpoint with the target's
tokenizer (`speculative.model`) runs on the engine's own model code and attention backend, with a
paged KV cache of its own.

Per request it keeps the tokens its cache holds. Each call, for the requests asked:

    known   = prompt + output                       (the target's tokens so far)
    common  = the longest prefix of its cached tokens that `known` shares
              (drafts the target rejected since fall away here)
    pass 0:   one forward pass over every request's known[common:] (a new request: its whole
              prompt); the choice at each one's last position is its first draft
    chain:    passes 1 .. k - 1 of one token per request, each feeding the choice of the pass
              before on the device (_Chain); a request asked for fewer drafts stops early
    the host reads all the drafts at once. The cache then holds known + drafts[:-1].

Both parts replay CUDA graphs when the engine captures its own (`capture_graphs`). In steady state
a request's catch-up is the tokens its last check kept and the one after them (at most k + 1):
then pass 0 (as a verify step of StepGraphs: b sequences over b * (k + 1) rows), its choices and
the chain are one graph per batch size (argmaxes, or draws with their distributions), so a
proposal is one replay and one read. Otherwise (a new request's prompt) pass 0 replays the
decode, verify or mixed graph that fits and the chain its own. A small draft is bound by its
launches, so eagerly its proposals cost several of the target's steps.

A choice is the draft model's argmax (`propose`, and requests with temperature 0), or for a
request that samples freely a draw from q = softmax(logits / T) at the stream the engine gives it
(`propose_sampled`), q kept for the check (llmserve/speculative.py): both through the backend's
sample_rows (its T = 0 rows take the argmax). A request whose blocks do not fit in the draft's
cache gets no drafts (and gives its cache back); the cache holds `max_num_seqs` requests of
max_model_len tokens, capped at DRAFT_CACHE_TOKENS.
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
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(config, name) is not None:
                raise ValueError(f"speculative.{name} is not used by method 'draft' (it is the n-gram lookup's, method 'ngram')")
        spec = ModelSpec.from_dir(config.model)
        if spec.vocab_size != context.vocab_size:
            raise ValueError(f"speculative.model {config.model!r} has a vocabulary of {spec.vocab_size} tokens, the "
                             f"model {context.vocab_size}: the draft must share the model's tokenizer")
        self.device, self.block_size, self.backend = context.device, context.block_size, context.backend
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
        self.chain = _Chain(self.model, self.staging, context.backend, self.block_size, self.graph_batch, self.k - 1,
                            self.max_blocks, spec.vocab_size)

    def capture_graphs(self, emulate: bool = False) -> None:
        """Capture pass 0's decode, verify and mixed graphs (up to k + 1 tokens a request) and the
        chain's (the fused ones beginning with pass 0's verify step), for batches up to the
        speculating limit. emulate: the padded buffers run eagerly (tests)."""
        self.graphs = StepGraphs(self.model, self.staging, self.graph_batch, self.graph_batch * (self.k + 1),
                                 self.max_blocks, emulate=emulate, verify_queries=self.k + 1,
                                 verify_batch=self.graph_batch)
        self.graphs.capture()
        self.chain.capture(self.graph_batch, emulate, self.graphs)

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if (cached := self.cached.pop(req_id, None)) is not None:
                self.pool.free(cached.blocks)

    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]], limits: list[int]) -> list[list[int]]:
        return self.propose_sampled(req_ids, sequences, limits, [0.0] * len(req_ids), [None] * len(req_ids))[0]

    @torch.inference_mode()
    def propose_sampled(self, req_ids: list[str], sequences: list[tuple[array, list[int]]], limits: list[int],
                        temperatures: list[float], keys: list[np.ndarray | None],
                        ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        probs: list[torch.Tensor | None] = [None] * len(req_ids)
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
            return drafts, probs
        blocks = [self.cached[req_ids[i]].blocks for i in rows]
        tables = np.zeros((len(rows), max(map(len, blocks))), dtype=np.int32)
        for row, ids in enumerate(blocks):
            tables[row, :len(ids)] = ids
        temps = np.array([temperatures[i] for i in rows], dtype=np.float32)
        sampled = bool(temps.any())
        streams = np.zeros((len(rows), self.k), dtype=np.int64)  # each draft's random stream (sampled rows)
        for row, i in enumerate(rows):
            if temperatures[i] > 0:
                streams[row, :wants[row]] = keys[i][:wants[row]]
        inputs = StepInputs.build(np.concatenate(feeds), np.array([len(f) for f in feeds], dtype=np.int32),
                                  np.array(starts, dtype=np.int32), tables, self.block_size)
        # chained passes a request makes; draft p (p >= 2) is fed at the position after its known tokens' p - 2
        counts, ends = np.array(wants, dtype=np.int32) - 1, inputs.seq_lens.astype(np.int64)
        q = None
        if self.chain.fused(inputs):
            draws = (temps, streams) if sampled else (None, None)
            out, q = self.chain.run_fused(inputs, ends, counts, *draws)
        else:
            temps_dev = self.staging.to_device(temps)
            logits = self._first(inputs)
            first = self.backend.sample_rows(logits, temps_dev, self.staging.to_device(np.ascontiguousarray(streams[:, 0])))
            out = first[:, None]
            if sampled:
                q = _distribution(logits, temps_dev)[:, None]
            if max(wants) > 1:
                more, more_q = self.chain.run(first, ends, counts, tables, temps if sampled else None, streams[:, 1:])
                out = torch.cat([out, more], dim=1)
                if sampled:
                    q = torch.cat([q, more_q], dim=1)
        for row, (i, tokens, want) in enumerate(zip(rows, out.tolist(), wants)):  # the host waits here, once
            drafts[i] = tokens[:want]
            self.cached[req_ids[i]].tokens.extend(drafts[i][:-1])  # its cache holds all drafts but the last
            if temperatures[i] > 0:
                probs[i] = q[row, :want]
        return drafts, probs

    def _first(self, inputs: StepInputs) -> torch.Tensor:
        """Pass 0 alone: each request's feed, through a captured graph where one fits; the logits
        at each one's last position ([requests, V], on the device)."""
        graphs, S, T = self.graphs, inputs.num_reqs, inputs.num_tokens
        if graphs is not None and inputs.max_query_len == 1 and graphs.fits(S):
            hidden = graphs.run(inputs)
        elif graphs is not None and graphs.fits_tokens(T, S, inputs.max_query_len):
            hidden = graphs.run_tokens(inputs)
        else:
            hidden = self.model(*self.staging.forward_inputs(inputs))
        last = self.staging.to_device((inputs.query_start_loc[1:] - 1).astype(np.int64))
        return self.model.compute_logits(hidden[last])


def _distribution(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 softmax(logits / T) per row (rows of T = 0: of the logits, never read)."""
    return torch.softmax(logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None], dim=-1)


class _Chain:
    """The draft's passes 1 .. P, one token per request each, chained on the device: pass p feeds
    the choice of pass p - 1 and derives its positions, KV slots and context lengths from static
    buffers, so no pass waits for the host and all P replay as one CUDA graph per batch size
    (graph_sizes up to the speculating limit), in four variants: argmaxes; draws (each row's own
    temperature, 0 for an argmax) with their distributions kept; and each of those fused after pass
    0 itself ("fused", "fused_draw": `first`, the StepGraphs whose verify step it runs over that
    one's static buffers; the chain then reads that one's block tables), so that a whole proposal
    is one replay.

    static buffer   rows 0 .. n - 1 (this call)                 rows n .. b - 1 (padding)
    ids             each request's first draft (pass 0's)      stale
    positions       the first draft's position                 0
    counts          passes the request makes (its drafts - 1)  0
    last            (fused) its last row of pass 0's           0
    block_tables    its blocks                                 stale (never read through)
    temperatures    its temperature (draws)                    0
    keys [1 + P, .] its drafts' random streams (draws; row 0   0
                    pass 0's, fused)
    probs [1 + P, ., V] the distributions drawn from (draws;   ignored
                    row 0 pass 0's, fused)

    A row past its count (and every padding row) writes no KV (slot -1), attends one key and is
    fed position 0: its choices are computed and ignored.
    """

    def __init__(self, model, staging: Staging, backend, block_size: int, capacity: int, passes: int,
                 max_blocks: int, vocab: int) -> None:
        self.model, self.staging, self.backend, self.block_size, self.passes = model, staging, backend, block_size, passes
        self.capacity = capacity
        device, i32, i64 = staging.device, torch.int32, torch.int64
        self.ids = torch.zeros(capacity, dtype=i64, device=device)
        self.positions = torch.zeros(capacity, dtype=i64, device=device)
        self.last = torch.zeros(capacity, dtype=i64, device=device)
        self.counts = torch.zeros(capacity, dtype=i32, device=device)
        self.seq_order = torch.arange(capacity, dtype=i32, device=device)
        self.block_tables = torch.zeros(capacity, max_blocks, dtype=i32, device=device)
        self.qsl = torch.arange(capacity + 1, dtype=i32, device=device)
        self.rows = torch.arange(capacity, dtype=i64, device=device)
        self.temperatures = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.keys = torch.zeros(1 + passes, capacity, dtype=i64, device=device)
        self.probs = torch.zeros(1 + passes, capacity, vocab, dtype=torch.float32, device=device)
        self.first: StepGraphs | None = None
        self.sizes: list[int] = []
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}

    def _forward(self, b: int, variant: str = "argmax") -> torch.Tensor:
        """All passes over the static buffers' first b rows: the choices, int64 [b, passes]
        ("argmax"; "draw": draws, and their distributions in `probs[1:]`; "fused", "fused_draw":
        pass 0's choices first, [b, 1 + passes], its distributions in `probs[0]`)."""
        draw = variant in ("draw", "fused_draw")
        temperatures = self.temperatures[:b]
        if variant.startswith("fused"):
            hidden = self.first.forward("verify", b)
            logits = self.model.compute_logits(hidden[self.last[:b]])
            if draw:
                self.probs[0, :b] = _distribution(logits, temperatures)
                ids = self.backend.sample_rows(logits, temperatures, self.keys[0, :b])
            else:
                ids = logits.argmax(-1)
            out, tables = [ids], self.first.block_tables[:b]
        else:
            ids, out, tables = self.ids[:b], [], self.block_tables[:b]
        start = self.positions[:b]
        last_block = tables.shape[1] - 1
        for p in range(self.passes):
            live = self.counts[:b] > p
            pos = start + p
            block = tables[self.rows[:b], torch.clamp(pos // self.block_size, max=last_block)]
            slots = torch.where(live, block.to(torch.int64) * self.block_size + pos % self.block_size, -1)
            seq_lens = torch.where(live, pos + 1, 1).to(torch.int32)
            meta = AttentionMetadata(slots, tables, self.qsl[:b + 1], seq_lens, max_query_len=1,
                                     seq_order=self.seq_order[:b])
            hidden = self.model(ids, torch.where(live, pos, 0), meta)
            logits = self.model.compute_logits(hidden)
            if draw:
                self.probs[1 + p, :b] = _distribution(logits, temperatures)
                ids = self.backend.sample_rows(logits, temperatures, self.keys[1 + p, :b])
            else:
                ids = logits.argmax(-1)
            out.append(ids)
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def capture(self, max_batch: int, emulate: bool, first: StepGraphs | None = None) -> None:
        """Graphs of every variant per batch size (emulate: none, the variants run eagerly);
        `first`: the StepGraphs with verify graphs that the fused variant begins with."""
        self.sizes, self.first = graph_sizes(max_batch), first
        variants = [(b, v) for b in reversed(self.sizes) for v in ("argmax", "draw") if self.passes]
        if first is not None:
            variants += [(b, v) for b in reversed(first.verify_sizes) for v in ("fused", "fused_draw")]
        if emulate or not variants:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (Triton compiles, cuBLAS handles)
            for key in variants:
                self._forward(*key)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for key in variants:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs[key] = self._forward(*key)
            self.graphs[key] = graph

    def fused(self, inputs: StepInputs) -> bool:
        """Whether pass 0 over `inputs` and the chain can run as one (a verify step of `first`'s)."""
        return self.first is not None and self.first.fits_verify(inputs.num_reqs, inputs.max_query_len)

    def run_fused(self, inputs: StepInputs, positions: np.ndarray, counts: np.ndarray,
                  temperatures: np.ndarray | None = None, keys: np.ndarray | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All drafts of n requests in one replay: pass 0 over `inputs` (fused()), then the chain
        from `positions` (where each one's first draft is fed: int64 [n]) for `counts` passes
        (int32 [n]); with `temperatures` (float32 [n]) and `keys` (int64 [n, 1 + P]: each pass's
        random stream, pass 0's first), draws. Returns int64 [n, 1 + P] on the device (row i's
        first 1 + counts[i]) and, for draws, their distributions (float32 [n, 1 + P, V], a copy)."""
        n = inputs.num_reqs
        b = self.first.stage_verify(inputs)
        last = inputs.query_start_loc[1:] - 1
        self._stage(b, positions, counts, last)
        if temperatures is None:
            return self._replay(b, "fused")[:n], None
        self._stage_draws(b, temperatures, keys, 0)
        out = self._replay(b, "fused_draw")[:n]
        return out, self.probs[:, :n].transpose(0, 1).clone()

    def run(self, first: torch.Tensor, positions: np.ndarray, counts: np.ndarray, tables: np.ndarray,
            temperatures: np.ndarray | None = None, keys: np.ndarray | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts 2 .. for n requests: `first` their first drafts (int64 [n], on the device),
        `positions` where each is fed (int64 [n]), `counts` passes each makes (int32 [n], at most
        P), `tables` their block tables (int32 [n, width]); with `temperatures` (float32 [n]) and
        `keys` (int64 [n, P]: each pass's random stream), draws. Returns int64 [n, P] on the device
        (row i's first counts[i] entries are its drafts) and, for draws, the distributions they
        were drawn from (float32 [n, P, V], a copy)."""
        n, width = tables.shape
        b = next((s for s in self.sizes if s >= n), n)
        sampled = temperatures is not None
        if sampled:
            self._stage_draws(b, temperatures, keys, 1)
        self._stage(b, positions, counts)
        self.block_tables[:n, :width].copy_(self.staging.stage(tables), non_blocking=True)
        self.ids[:n].copy_(first)
        out = self._replay(b, "draw" if sampled else "argmax")[:n]
        return out, self.probs[1:, :n].transpose(0, 1).clone() if sampled else None

    def _stage_draws(self, b: int, temperatures: np.ndarray, keys: np.ndarray, first_pass: int) -> None:
        """Temperatures (float32 [n]) and random streams (int64 [n, passes], from pass
        `first_pass` on) into the static buffers, padded to b."""
        n = len(temperatures)
        temps, staged = self.staging.empty((b,), np.float32)
        temps[:n], temps[n:] = temperatures, 0.0
        self.temperatures[:b].copy_(staged, non_blocking=True)
        passes = keys.shape[1]
        streams, staged = self.staging.empty((passes, b), np.int64)
        streams[:, :n], streams[:, n:] = keys.T, 0
        self.keys[first_pass:first_pass + passes, :b].copy_(staged, non_blocking=True)

    def _stage(self, b: int, positions: np.ndarray, counts: np.ndarray, last: np.ndarray | None = None) -> None:
        """positions (and the fused variant's last rows), counts and the order of the longest
        contexts first into the static buffers, padded to b."""
        n = len(positions)
        host, staged = self.staging.empty((2, b), np.int64)  # [positions | last]
        host[0, :n], host[:, n:] = positions, 0
        if last is not None:
            host[1, :n] = last
        self.positions[:b].copy_(staged[0], non_blocking=True)
        if last is not None:
            self.last[:b].copy_(staged[1], non_blocking=True)
        counts_order, staged = self.staging.empty((2, b), np.int32)  # [counts | seq_order], padded
        counts_order[0, :n], counts_order[0, n:] = counts, 0
        counts_order[1] = np.argsort(-host[0] - counts_order[0], kind="stable")  # longest context first
        self.counts[:b].copy_(staged[0], non_blocking=True)
        self.seq_order[:b].copy_(staged[1], non_blocking=True)

    def _replay(self, b: int, variant: str) -> torch.Tensor:
        if (b, variant) in self.graphs:
            self.graphs[b, variant].replay()
            return self.outputs[b, variant]
        with torch.inference_mode():
            return self._forward(b, variant)


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.frombuffer(a[:n], dtype=np.int64) != np.frombuffer(b[:n], dtype=np.int64))
    return int(diff[0])


@hookimpl
def llmserve_register_proposers(register) -> None:
    register("draft", DraftModelProposer)
