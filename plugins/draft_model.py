"""`draft`: speculative decoding's draft-model proposer. A small checkpoint with the target's
tokenizer (`speculative.model`) runs on the engine's own model code and attention backend, with a
paged KV cache of its own.

Per request it keeps the tokens its cache holds. Each call, for the requests asked:

    known   = prompt + output                       (the target's tokens so far)
    common  = the longest prefix of its cached tokens that `known` shares
              (drafts the target rejected since fall away here)
    one forward pass over every request's known[common:] (a new request: its whole prompt), the
    argmax at each one's last position is its first draft; then limit - 1 passes of one token
    per request, each feeding the draft before from the device (the host reads all the drafts at
    once, at the end). The cache then holds known + drafts[:-1].

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

from llmserve.config import SpeculativeConfig
from llmserve.core.block_pool import BlockPool
from llmserve.hookspecs import hookimpl
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
        self.model = load_model(config.model, spec, context.backend, dtype=context.dtype, device=context.device,
                                max_positions=context.max_model_len)
        tokens = min(context.max_num_seqs * context.max_model_len, DRAFT_CACHE_TOKENS)
        num_blocks = -(-tokens // self.block_size)
        self.model.set_kv_caches(KVCacheLayout(spec, self.block_size, context.dtype, context.device).allocate(num_blocks))
        self.pool = BlockPool(num_blocks)
        self.staging = Staging(context.device)
        self.cached: dict[str, _Cached] = {}

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if (cached := self.cached.pop(req_id, None)) is not None:
                self.pool.free(cached.blocks)

    @torch.inference_mode()
    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        rows, feeds, starts = [], [], []  # requests drafted for, the tokens each feeds first, where they start
        for i, (req_id, (prompt, output), limit) in enumerate(zip(req_ids, sequences, limits)):
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
        if not rows:
            return drafts
        # pass 0 feeds what each request lacks; pass p > 0 its draft p - 1, straight from the
        # device: the host waits once, for all the drafts
        ends = [s + len(f) for s, f in zip(starts, feeds)]
        lives = [list(range(len(rows)))]
        outs = [self._step([req_ids[i] for i in rows], feeds, starts)]
        for p in range(1, max(limits[i] for i in rows)):
            live = [j for j in lives[-1] if limits[rows[j]] > p]
            if not live:
                break
            at = {j: n for n, j in enumerate(lives[-1])}
            fed = outs[-1][self.staging.to_device(np.array([at[j] for j in live], dtype=np.int64))]
            outs.append(self._step([req_ids[rows[j]] for j in live], [np.zeros(1, dtype=np.int64)] * len(live),
                                   [ends[j] + p - 1 for j in live], fed))
            lives.append(live)
        host = torch.cat(outs).tolist()
        n = 0
        for live in lives:
            for j in live:
                drafts[rows[j]].append(host[n])
                n += 1
        for i in rows:  # its cache now holds its known tokens and all drafts but the last
            self.cached[req_ids[i]].tokens.extend(drafts[i][:-1])
        return drafts

    def _step(self, req_ids: list[str], feeds: list[np.ndarray], starts: list[int],
              fed: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass of the draft model: each request's `feeds` from position `starts`
        (`fed`: one token each, already on the device, in place of `feeds`); returns the argmax
        token after each one's last (int64 [len(req_ids)], on the device)."""
        query_lens = np.array([len(f) for f in feeds], dtype=np.int32)
        blocks = [self.cached[r].blocks for r in req_ids]
        tables = np.zeros((len(blocks), max(map(len, blocks))), dtype=np.int32)
        for row, ids in enumerate(blocks):
            tables[row, :len(ids)] = ids
        inputs = StepInputs.build(np.concatenate(feeds), query_lens, np.array(starts, dtype=np.int32), tables,
                                  self.block_size)
        input_ids, positions, meta = self.staging.forward_inputs(inputs)
        hidden = self.model(input_ids if fed is None else fed, positions, meta)
        last = self.staging.to_device((inputs.query_start_loc[1:] - 1).astype(np.int64))
        return self.model.compute_logits(hidden[last]).argmax(-1)


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.frombuffer(a[:n], dtype=np.int64) != np.frombuffer(b[:n], dtype=np.int64))
    return int(diff[0])


@hookimpl
def llmserve_register_proposers(register) -> None:
    register("draft", DraftModelProposer)
