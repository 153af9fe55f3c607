"""CUDA graphs of whole forward passes: decode steps by batch size, mixed steps by token count.

A decode step (every request computes exactly one token) has a shape fixed by its batch size alone,
so the forward pass for each size in a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs) is
captured once. A step of B requests replays the smallest captured size b >= B; rows B..b-1 are
padding:

    static buffer      rows 0 .. B-1 (this step)        rows B .. b-1 (padding)
    input_ids          the step's tokens                 0
    positions          context length of each request    0
    slot_mapping       the new token's KV slot           -1: the KV write skips it
    seq_lens           context + 1                       1: attention reads one (stale) slot
    block_tables       the requests' tables              whatever was there: only column 0 is read
    seq_order          longest context first             b - 1 .. B: the padding rows last

A mixed step (prefill chunks, with or without decodes) of T tokens over S requests replays the
graph of the smallest captured token count t >= T (every 512 up to max_num_batched_tokens, and
128 and 256 below: a step pads at most 511 tokens). Attention finds its work from
query_start_loc on the device (kernels/paged_attention.py), so the graph holds for any S up to
max_num_seqs:

    static buffer      this step                          padding
    input_ids, positions, slot_mapping   rows 0 .. T-1    rows T .. t-1: 0, 0, -1
    query_start_loc    entries 0 .. S                     entries S+1 .. max_num_seqs: T (empty queries)
    seq_lens, block_tables               rows 0 .. S-1    rows S .. : never read

With cascade attention on, each decode size b >= 2 has a second graph whose attention reads the
shared prefixes once per group (kernels/cascade.py); its groups reach it through one more static
buffer, laid out for capacities (MAX groups, 2b group rows, b sequences, b rows) as
attention.CascadeMetadata packs them (padding groups have no rows). A decode step replays it when
the runner chose cascade for the step. Mixed steps replay their plain graphs; one whose decode
rows attend their groups through cascade runs eagerly, over kernel variants no capture compiled
(the attention kernels specialize on the step's sequence count by powers of two and on its group
count, the GEMMs on token counts not a multiple of 16; the packed metadata keeps every pointer
16-byte aligned, so its layout adds none). So that a fresh machine does not compile them, for
seconds, when its first such step comes, capture ends with eager passes over
`eager_cascade_layouts()`: one per power of two of sequences, groups of two up to the most a step
has, token counts odd, and the largest step's token count less one.

A large mixed step launches ~250 operations from Python, which can take longer than it runs:
replaying one graph takes one launch.

All graphs share one memory pool. Each one is warmed up first (Triton compiles, cuBLAS loads its
kernels), the warm-up's memory is returned, then they are captured largest first. A mixed graph
copies its hidden states into one buffer shared by all token counts, so the pool holds one step's
intermediates, not one set per graph. A replay's inputs reach the static buffers through the
step's staging (model/step_inputs.py: a pinned ring, one non-blocking copy per array, stream
ordered after the step before, which still reads them). The lm_head runs eagerly on the padded
output (rows past the batch are ignored; a mixed step's sampled rows are padded to a captured batch
size too), so cuBLAS meets one shape per captured size, all of them first at capture time.

`emulate=True` runs the same padded buffers through the model eagerly instead of replaying
(the padding logic on machines without CUDA: tests).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.attention import AttentionMetadata, CascadeMetadata
from llmserve.messages import PrefixGroups
from llmserve.model.step_inputs import StepInputs, Staging


def graph_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def token_sizes(max_tokens: int) -> list[int]:
    """Mixed-step token counts to capture."""
    sizes = [s for s in (128, 256) if s < max_tokens] + list(range(512, max_tokens, 512))
    return sorted(set(sizes + [max_tokens]))


def eager_cascade_layouts(max_batch: int, max_tokens: int, block_size: int, num_blocks: int, max_groups: int,
                          max_query: int, max_len: int) -> list[tuple[StepInputs, PrefixGroups]]:
    """Steps with prompt rows whose one-token rows attend shared prefixes (cascade), for warming up
    their eager kernels: for S = 4, 8, ... up to max_batch sequences, S - 1 one-token rows in
    groups of two or more (as many groups as fit up to max_groups), each group sharing one block,
    and a prompt row of a few more than max_query tokens (it joins no group) making the token count
    odd; then the same at max_batch with the prompt row filling max_tokens - 1 tokens (or
    max_len, the longest sequence). Token ids are 0; blocks 1.. are written (0 stays as the
    graphs' padding rows left it). Layouts the KV cache has too few blocks for are left out."""
    def odd(seqs: int, query: int) -> int:  # the query that makes seqs - 1 + query tokens odd
        return query - 1 if (seqs - 1 + query) % 2 == 0 else query

    sizes = sorted({min(1 << k, max_batch) for k in range(2, max(2, (max_batch - 1).bit_length()) + 1)})
    runs = [(seqs, odd(seqs, max_query + 2)) for seqs in sizes]
    largest = odd(max_batch, min(max_tokens - (max_batch - 1) - 1, max_len))  # the largest step, less a token or two
    if largest > max_query + 2:
        runs.append((max_batch, largest))
    layouts = []
    for seqs, query in runs:
        rows, prompt_blocks = seqs - 1, -(-query // block_size)
        groups = min(max_groups, rows // 2)
        if groups < 1 or 1 + groups + rows + prompt_blocks > num_blocks or max(query, block_size + 1) > max_len:
            continue
        shared = np.arange(1, groups + 1, dtype=np.int32)
        own = groups + 1 + np.arange(rows, dtype=np.int32)
        tables = np.zeros((seqs, max(2, prompt_blocks)), dtype=np.int32)
        member_group = np.minimum(np.arange(rows) // 2, groups - 1)  # pairs; the last group takes the rest
        tables[:rows, 0], tables[:rows, 1] = shared[member_group], own
        tables[rows, :prompt_blocks] = groups + 1 + rows + np.arange(prompt_blocks, dtype=np.int32)
        query_lens = np.array([1] * rows + [query], dtype=np.int32)
        context_lens = np.array([block_size] * rows + [0], dtype=np.int32)
        inputs = StepInputs.build(np.zeros(int(query_lens.sum()), dtype=np.int64), query_lens, context_lens, tables,
                                  block_size)
        starts = np.zeros(groups + 1, dtype=np.int32)
        np.cumsum(np.bincount(member_group, minlength=groups), out=starts[1:])
        layouts.append((inputs, PrefixGroups(starts, np.arange(rows, dtype=np.int32), np.zeros(groups, np.int32),
                                             np.full(groups, block_size, np.int32), np.zeros(groups, np.int32))))
    return layouts


class StepGraphs:
    def __init__(self, model, staging: Staging, max_batch: int, max_tokens: int, max_blocks_per_seq: int,
                 emulate: bool = False, cascade_groups: int = 0, verify_queries: int = 0,
                 verify_batch: int = 0) -> None:
        self.model = model
        self.staging = staging
        self.emulate = emulate
        device = staging.device
        self.sizes = graph_sizes(max_batch)
        self.token_sizes = token_sizes(max_tokens)
        self.max_batch, self.max_tokens = max_batch, max_tokens
        # Steps checking drafts: up to verify_batch sequences of at most verify_queries tokens each
        # (k + 1), captured per decode size b over b * verify_queries token rows, so that their
        # attention runs a program per sequence (kernels/paged_attention.py) and their GEMMs take
        # the step's own few rows, not a mixed step's 128 or more.
        self.verify_queries = verify_queries
        rows = max(max_batch, max_tokens)
        self.verify_sizes = ([b for b in self.sizes if b <= verify_batch and b * verify_queries <= rows]
                             if verify_queries > 1 else [])
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.seq_order = torch.arange(max_batch, dtype=i32, device=device)
        self.decode_qsl = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.mixed_qsl = torch.zeros(max_batch + 1, dtype=i32, device=device)
        self.verify_qsl = torch.zeros(max_batch + 1, dtype=i32, device=device)
        self.cascade_groups = cascade_groups  # group capacity of the cascade graphs (0: none captured)
        self.cascade_sizes = [b for b in self.sizes if b >= 2] if cascade_groups else []
        self.cascade_packed = torch.zeros(CascadeMetadata.size(*self._cascade_capacity(max_batch)), dtype=i32,
                                          device=device) if cascade_groups else None
        self.hidden = None  # the mixed graphs' output rows, [max_tokens, hidden]
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def _cascade_capacity(self, b: int) -> tuple[int, int, int, int]:
        """(groups, group rows, sequences, rows) of the cascade graph of decode size b: a row lies
        in at most two groups (a group and one nested in it)."""
        return self.cascade_groups, 2 * b, b, b

    def forward(self, kind: str, b: int) -> torch.Tensor:
        """The forward pass over the static buffers for `b` rows (decode, cascade), tokens (mixed) or
        sequences (verify): what a graph captures (and a graph of another's may begin with)."""
        if kind in ("decode", "cascade"):
            meta = AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.decode_qsl[:b + 1],
                                     self.seq_lens[:b], max_query_len=1, seq_order=self.seq_order[:b])
            if kind == "cascade":
                capacity = self._cascade_capacity(b)
                meta.cascade = CascadeMetadata.view(self.cascade_packed[:CascadeMetadata.size(*capacity)], capacity)
            return self.model(self.input_ids[:b], self.positions[:b], meta)
        if kind == "verify":  # b sequences over b * verify_queries token rows
            t = b * self.verify_queries
            meta = AttentionMetadata(self.slot_mapping[:t], self.block_tables[:b], self.verify_qsl[:b + 1],
                                     self.seq_lens[:b], max_query_len=self.verify_queries)
            return self.model(self.input_ids[:t], self.positions[:t], meta)
        meta = AttentionMetadata(self.slot_mapping[:b], self.block_tables, self.mixed_qsl, self.seq_lens,
                                 max_query_len=b)
        hidden = self.model(self.input_ids[:b], self.positions[:b], meta)
        if self.hidden is None:
            self.hidden = torch.empty(self.max_tokens, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        out = self.hidden[:b]
        out.copy_(hidden)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every shape up, then capture them all into one pool, largest first. (Emulated: no-op.)"""
        if self.emulate:
            return
        shapes = [("mixed", t) for t in reversed(self.token_sizes)] + [("decode", b) for b in reversed(self.sizes)]
        shapes += [("cascade", b) for b in reversed(self.cascade_sizes)]
        shapes += [("verify", b) for b in reversed(self.verify_sizes)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # off the capture: kernel compilation, cuBLAS handles and kernels
            for kind, b in shapes:
                self.forward(kind, b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's activations: the pool below needs the room
        pool = torch.cuda.graph_pool_handle()
        for kind, b in shapes:
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls meanwhile (the tokenizer loading) are not
            # this capture's business; our stream, on this device (torch's default capture stream
            # is made once per process, on the device current then: another engine's)
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs[kind, b] = self.forward(kind, b)
            self.graphs[kind, b] = graph
        for b in self.sizes:  # cuBLAS picks (and lazily loads) a kernel per shape on first use
            self.model.compute_logits(self.outputs["decode", b])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # those logits' blocks (~8 GiB cached at 1,024 rows of a 128k vocabulary)

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.max_batch

    def batch_size(self, num_reqs: int) -> int:
        """The captured decode batch size that `num_reqs` rows pad to."""
        return next(s for s in self.sizes if s >= num_reqs)

    def fits_mixed(self, num_tokens: int, num_reqs: int) -> bool:
        return num_tokens <= self.max_tokens and num_reqs <= self.max_batch

    def fits_verify(self, num_reqs: int, max_query_len: int) -> bool:
        return bool(self.verify_sizes) and max_query_len <= self.verify_queries and num_reqs <= self.verify_sizes[-1]

    def fits_tokens(self, num_tokens: int, num_reqs: int, max_query_len: int) -> bool:
        """A step with queries longer than one token: a verify graph or a mixed one serves it (run_tokens)."""
        return self.fits_verify(num_reqs, max_query_len) or self.fits_mixed(num_tokens, num_reqs)

    def run_tokens(self, inputs: StepInputs,
                   from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """run_verify where its graphs fit the step, else run_mixed."""
        if self.fits_verify(inputs.num_reqs, inputs.max_query_len):
            return self.run_verify(inputs, from_device)
        return self.run_mixed(inputs, from_device)

    def fits_cascade(self, num_reqs: int, groups: PrefixGroups) -> bool:
        return (bool(self.cascade_sizes) and 2 <= num_reqs <= self.max_batch
                and groups.num_groups <= self.cascade_groups)

    def run(self, inputs: StepInputs, from_device: tuple[torch.Tensor, torch.Tensor] | None = None,
            cascade: PrefixGroups | None = None) -> torch.Tensor:
        """Replay for B decoding requests; returns hidden states [b, hidden] for the captured size
        b >= B (rows B.. are padding).
        from_device: (rows, token ids) already on the device that overwrite those rows of the ids.
        cascade: the step's prefix groups (fits_cascade): the cascade graph replays."""
        B = inputs.num_reqs
        b = self.batch_size(B)
        if cascade is not None:
            capacity = self._cascade_capacity(b)
            size = CascadeMetadata.size(*capacity)
            host, staged = self.staging.empty((size,), np.int32)
            CascadeMetadata.pack(cascade, inputs.query_start_loc, host, capacity)
            self.cascade_packed[:size].copy_(staged, non_blocking=True)
        self._copy_tokens(inputs, b, from_device)
        lens_order, staged = self.staging.empty((2, b), np.int32)  # [seq_lens | seq_order], padded
        lens_order[0, :B], lens_order[0, B:] = inputs.seq_lens, 1
        lens_order[1, :B] = np.argsort(-inputs.seq_lens, kind="stable")
        lens_order[1, B:] = np.arange(B, b)
        self.seq_lens[:b].copy_(staged[0], non_blocking=True)
        self.seq_order[:b].copy_(staged[1], non_blocking=True)
        self._copy_tables(inputs)
        return self._replay("decode" if cascade is None else "cascade", b)

    def run_mixed(self, inputs: StepInputs,
                  from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay for a mixed step of T tokens over S requests; returns hidden states [t, hidden]
        for the captured token count t >= T (rows T.. are padding)."""
        T, S = inputs.num_tokens, inputs.num_reqs
        t = next(s for s in self.token_sizes if s >= T)
        self._copy_tokens(inputs, t, from_device)
        lens_qsl, staged = self.staging.empty((S + self.max_batch + 1,), np.int32)  # [seq_lens | query_start_loc]
        lens_qsl[:S] = inputs.seq_lens
        lens_qsl[S:2 * S + 1], lens_qsl[2 * S + 1:] = inputs.query_start_loc, T
        self.seq_lens[:S].copy_(staged[:S], non_blocking=True)
        self.mixed_qsl.copy_(staged[S:], non_blocking=True)
        self._copy_tables(inputs)
        return self._replay("mixed", t)

    def run_verify(self, inputs: StepInputs,
                   from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay for S sequences of at most verify_queries tokens each (fits_verify), padded to the
        captured size b >= S; returns hidden states [b * verify_queries, hidden] (rows T.. are padding)."""
        return self._replay("verify", self.stage_verify(inputs, from_device))

    def stage_verify(self, inputs: StepInputs,
                     from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """The static buffers of the verify graph for S sequences, padded to its captured size b >= S
        (returned): for run_verify, or a graph of its own that runs this one's pass first."""
        T, S = inputs.num_tokens, inputs.num_reqs
        b = next(s for s in self.verify_sizes if s >= S)
        self._copy_tokens(inputs, b * self.verify_queries, from_device)
        lens_qsl, staged = self.staging.empty((2 * b + 1,), np.int32)  # [seq_lens | query_start_loc], padded
        lens_qsl[:S], lens_qsl[S:b] = inputs.seq_lens, 1  # (padding sequences: no query, so never read)
        lens_qsl[b:b + S + 1], lens_qsl[b + S + 1:] = inputs.query_start_loc, T
        self.seq_lens[:b].copy_(staged[:b], non_blocking=True)
        self.verify_qsl[:b + 1].copy_(staged[b:], non_blocking=True)
        self._copy_tables(inputs)
        return b

    def _copy_tokens(self, inputs: StepInputs, rows: int,
                     from_device: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """ids, positions and slots into the static buffers, padded to `rows` with 0, 0 and -1
        (the KV write skips slot -1)."""
        n = inputs.num_tokens
        host, staged = self.staging.empty((3, rows), np.int64)
        host[0, :n], host[1, :n], host[2, :n] = inputs.token_ids, inputs.positions, inputs.slots
        host[:2, n:], host[2, n:] = 0, -1
        self.input_ids[:rows].copy_(staged[0], non_blocking=True)
        if from_device is not None:
            self.input_ids[from_device[0]] = from_device[1]
        self.positions[:rows].copy_(staged[1], non_blocking=True)
        self.slot_mapping[:rows].copy_(staged[2], non_blocking=True)

    def _copy_tables(self, inputs: StepInputs) -> None:
        S, width = inputs.block_tables.shape
        self.block_tables[:S, :width].copy_(self.staging.stage(inputs.block_tables), non_blocking=True)

    def _replay(self, kind: str, b: int) -> torch.Tensor:
        if self.emulate:
            with torch.inference_mode():
                return self.forward(kind, b)
        self.graphs[kind, b].replay()
        return self.outputs[kind, b]
