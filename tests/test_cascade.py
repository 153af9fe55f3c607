"""Cascade attention: prefix groups from the KV manager, the packed metadata, the Triton kernels
against plain attention (the interpreter on CPU, the GPU where there is one), and generation with
cascade forced on."""

import numpy as np
import pytest
import torch

from llmserve.attention import CascadeMetadata
from llmserve.core.kv_cache_manager import find_prefix_groups
from llmserve.kernels.cascade import cascade_attention
from llmserve.kernels.reference import cascade_attention_reference, paged_attention_reference
from llmserve.messages import PrefixGroups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def shared_batch(members, *, block_size, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, seed=0):
    """A batch whose block tables share prefixes. members: per sequence (prefix id or None,
    prefix blocks, own context tokens after the prefix, query tokens); sequences naming the same
    prefix id share its first `prefix blocks` blocks (the longest such prefix is built)."""
    g = torch.Generator().manual_seed(seed)
    next_block = iter(torch.randperm(4096, generator=g).tolist())
    prefixes: dict = {}
    for pid, blocks, _, _ in members:
        if pid is not None:
            prefixes[pid] = max(prefixes.get(pid, 0), blocks)
    prefix_blocks = {pid: [next(next_block) for _ in range(n)] for pid, n in prefixes.items()}
    tables, seq_lens, query_lens = [], [], []
    for pid, blocks, own, q in members:
        table = list(prefix_blocks[pid][:blocks]) if pid is not None else []
        start = len(table) * block_size
        total = start + own + q
        table += [next(next_block) for _ in range(-(-total // block_size) - len(table))]
        tables.append(table)
        seq_lens.append(total)
        query_lens.append(q)
    width = max(len(t) for t in tables)
    table_arr = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table_arr[i, :len(t)] = t
    shape = (4096, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    ctx_blocks = (np.array(seq_lens) - np.array(query_lens)) // block_size
    return q, k_cache, v_cache, table_arr, qsl, np.array(seq_lens, dtype=np.int32), ctx_blocks


def metadata(groups: PrefixGroups, qsl: np.ndarray, num_seqs: int, pad: int = 0) -> CascadeMetadata:
    counts = np.diff(qsl)
    rows = int(counts[groups.members].sum())
    capacity = (groups.num_groups + pad, rows + pad, num_seqs, int(qsl[-1]))
    packed = np.empty(CascadeMetadata.size(*capacity), dtype=np.int32)
    CascadeMetadata.pack(groups, qsl, packed, capacity)
    return CascadeMetadata.view(torch.from_numpy(packed).to(DEVICE), capacity)


def run_both(members, *, block_size, group, dtype=torch.float32, pad=0, head_dim=16, splits=None):
    q, kc, vc, tables, qsl, seq_lens, ctx_blocks = shared_batch(members, block_size=block_size, group=group,
                                                                dtype=dtype, head_dim=head_dim)
    groups = find_prefix_groups(tables, ctx_blocks, block_size)
    assert groups is not None
    to = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    args = (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), to(tables), to(qsl), to(seq_lens), 0.25)
    ref = paged_attention_reference(*args)
    meta = metadata(groups, qsl, len(seq_lens), pad)
    torch.testing.assert_close(cascade_attention_reference(*args, meta).float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    out = torch.full_like(args[0], float("nan"))
    cascade_attention(*args, int(np.diff(qsl).max()), meta, out=out, num_splits=splits)
    return out, ref, groups


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # (the interpreter's bf16 is wrong)


@pytest.mark.parametrize("splits", [None, 4])  # one key slice (merged in the suffix kernel) or several (merged apart)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_one_group_of_decodes(group, dtype, splits):
    members = [("a", 3, own, 1) for own in (1, 5, 16, 0)]
    out, ref, groups = run_both(members, block_size=4, group=group, dtype=dtype, splits=splits)
    assert groups.num_groups == 1 and groups.hi.tolist() == [12]
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_groups_nested_groups_and_loners_in_one_step(block_size, group):
    per_block = 16 // block_size  # prefixes of 16 and 32 tokens whatever the block size
    members = [("a", 2 * per_block, 3, 1), ("a", 2 * per_block, 0, 1), ("a", per_block, 7, 1),  # a, a longer one nested
               ("b", per_block, 2, 1), ("b", per_block, 19, 1),
               (None, 0, 9, 1), ("c", per_block, 4, 1)]  # no prefix; a prefix nobody else has
    out, ref, groups = run_both(members, block_size=block_size, group=group)
    assert sorted(zip(groups.level.tolist(), groups.lo.tolist(), groups.hi.tolist())) == \
        [(0, 0, 16), (0, 0, 16), (1, 16, 32)]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_many_groups_with_prefill_rows_past_their_prefix(group):
    members = []
    for i in range(20):  # 20 groups of two or three: decode rows and prefill chunks after a cache hit
        members += [(i, 1 + i % 3, i % 5, 1), (i, 1 + i % 3, 2, 1 + i % 7)] + ([(i, 1 + i % 3, 0, 9)] if i % 4 == 0 else [])
    members += [(None, 0, 0, 6)]  # a prompt from scratch
    out, ref, groups = run_both(members, block_size=4, group=group)
    assert groups.num_groups == 20
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_padded_capacity_like_a_cuda_graph():
    members = [("a", 5, own, 1) for own in (0, 3, 8)] + [(None, 0, 4, 1)]
    out, ref, _ = run_both(members, block_size=4, group=2, pad=7)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_step_with_prompt_rows_groups_its_short_rows_with_partials_for_them_alone(group, dtype):
    """A mixed step as the runner attends it: prompt chunks (past a cached prefix, or from scratch)
    beside decode rows and draft checks of the same prefixes; only rows of at most
    MAX_CASCADE_QUERY tokens stay in the groups, and only they get partial results."""
    from llmserve.model.runner import MAX_CASCADE_QUERY
    members = [("a", 3, own, 1) for own in (0, 5, 9)] + [("a", 3, 2, 5), ("a", 3, 0, 23)]  # decodes, drafts, a chunk
    members += [("b", 2, 1, 1), ("b", 2, 0, 17), (None, 0, 0, 12), ("c", 4, 3, 1), ("c", 4, 0, 30)]
    q, kc, vc, tables, qsl, seq_lens, ctx_blocks = shared_batch(members, block_size=4, group=group, dtype=dtype)
    everything = find_prefix_groups(tables, ctx_blocks, 4)
    groups = everything.only(np.diff(qsl) <= MAX_CASCADE_QUERY)
    assert groups.num_groups == 1 and sorted(groups.members.tolist()) == [0, 1, 2, 3]  # b and c: one row left each
    to = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    args = (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), to(tables), to(qsl), to(seq_lens), 0.25)
    meta = metadata(groups, qsl, len(seq_lens))
    part_rows = np.empty(int(qsl[-1]), dtype=np.int32)
    meta.num_part_rows = CascadeMetadata.pack_part_rows(meta.levels.cpu().numpy(), part_rows)
    meta.part_rows = to(part_rows)
    assert meta.num_part_rows == 3 + 5
    out = torch.full_like(args[0], float("nan"))
    cascade_attention(*args, int(np.diff(qsl).max()), meta, out=out)
    torch.testing.assert_close(out.float(), paged_attention_reference(*args).float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_groups_limited_to_some_rows():
    groups = PrefixGroups(np.array([0, 3, 5, 7], np.int32), np.array([0, 1, 2, 1, 2, 3, 4], np.int32),
                          np.array([0, 8, 0], np.int32), np.array([8, 16, 8], np.int32), np.array([0, 1, 0], np.int32))
    kept = groups.only(np.array([True, True, True, True, False]))
    assert kept.starts.tolist() == [0, 3, 5] and kept.members.tolist() == [0, 1, 2, 1, 2]
    assert kept.lo.tolist() == [0, 8] and kept.level.tolist() == [0, 1]  # the group left with one row is gone
    nested = groups.only(np.array([True, True, False, True, True]))
    assert nested.members.tolist() == [0, 1, 3, 4] and nested.level.tolist() == [0, 0]
    assert groups.only(np.array([True, False, False, False, True])) is None


def test_a_group_of_one_and_long_prefixes_in_slices():
    """Groups the KV manager never makes (one member) still compute right; prefixes longer than
    the prefix kernel's slices span several key tiles each."""
    q, kc, vc, tables, qsl, seq_lens, _ = shared_batch([("a", 40, 3, 1), ("b", 2, 5, 2)], block_size=4)
    groups = PrefixGroups(np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), np.array([0, 0], np.int32),
                          np.array([160, 8], np.int32), np.array([0, 0], np.int32))
    to = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    args = (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), to(tables), to(qsl), to(seq_lens), 0.25)
    out = cascade_attention(*args, 2, metadata(groups, qsl, 2))
    torch.testing.assert_close(out, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


def test_fp8_cache_matches_its_plain_attention():
    from llmserve.kernels.reference import quantize_kv_reference
    members = [("a", 3, own, 1) for own in (1, 6, 11)]
    q, kc, vc, tables, qsl, seq_lens, ctx_blocks = shared_batch(members, block_size=4)
    (kq, ks), (vq, vs) = quantize_kv_reference(kc), quantize_kv_reference(vc)
    to = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    args = (q.to(DEVICE), kq.to(DEVICE), vq.to(DEVICE), to(tables), to(qsl), to(seq_lens), 0.25)
    scales = dict(k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE))
    meta = metadata(find_prefix_groups(tables, ctx_blocks, 4), qsl, 3)
    ref = paged_attention_reference(*args, **scales)
    torch.testing.assert_close(cascade_attention(*args, 1, meta, **scales), ref, atol=1e-5, rtol=1e-5)


# ---- groups -----------------------------------------------------------------------------------

def test_groups_end_where_a_member_differs_or_its_context_ends():
    tables = np.array([[7, 8, 9, 10],
                       [7, 8, 9, 11],
                       [7, 8, 3, 12],
                       [5, 6, 0, 0],
                       [5, 6, 0, 0],
                       [4, 0, 0, 0]], dtype=np.int32)
    groups = find_prefix_groups(tables, np.array([4, 4, 4, 2, 1, 1]), block_size=16)
    found = {(int(lv), int(lo), int(hi)): groups.members[groups.starts[g]:groups.starts[g + 1]].tolist()
             for g, (lv, lo, hi) in enumerate(zip(groups.level, groups.lo, groups.hi))}
    # rows 0-2 share blocks 7, 8; rows 0, 1 also 9; rows 3, 4 share 5, but row 4's context ends there
    assert found == {(0, 0, 32): [0, 1, 2], (1, 32, 48): [0, 1], (0, 0, 16): [3, 4]}


def test_no_groups_without_shared_blocks_or_context():
    assert find_prefix_groups(np.array([[1, 2], [3, 4]], np.int32), np.array([2, 2]), 16) is None
    assert find_prefix_groups(np.array([[1, 2], [1, 2]], np.int32), np.array([0, 2]), 16) is None


def test_the_groups_that_save_most_are_kept():
    tables = np.array([[i // 2 + 1, 50 + i // 2, 100 + i] for i in range(12)], dtype=np.int32)
    ctx = np.array([1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2])
    groups = find_prefix_groups(tables, ctx, 16, max_groups=2)
    assert groups.num_groups == 2 and groups.hi.tolist() == [32, 32]


def test_pack_lays_out_rows_starts_and_levels():
    groups = PrefixGroups(np.array([0, 2, 4], np.int32), np.array([0, 2, 0, 2], np.int32), np.array([0, 16], np.int32),
                          np.array([16, 48], np.int32), np.array([0, 1], np.int32))
    qsl = np.array([0, 1, 4, 5], np.int32)  # row 1 is a prefill of three tokens, no group
    capacity = (3, 6, 3, 5)
    packed = np.empty(CascadeMetadata.size(*capacity), np.int32)
    CascadeMetadata.pack(groups, qsl, packed, capacity)
    meta = CascadeMetadata.view(torch.from_numpy(packed), capacity)
    assert meta.row_start.tolist() == [0, 2, 4, 4]
    assert meta.rows.tolist()[:4] == [0, 4, 0, 4]
    assert meta.kv_start.tolist() == [48, 0, 48]
    assert meta.levels.tolist() == [2, 0, 0, 0, 2]


# ---- generation with cascade forced on --------------------------------------------------------

SHARED = list(range(5, 47))  # 42 tokens: ten blocks of four and two tokens into the eleventh
PROMPTS = [SHARED + [60 + i, 70 + i, 80 + i] for i in range(3)] + [SHARED[:20] + [99], [3, 4, 5]]


def _generate(llm, prompts):
    from llmserve import SamplingParams
    params = SamplingParams(max_tokens=10, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(checkpoint):
    from conftest import hf_greedy
    return hf_greedy(checkpoint("llama"), PROMPTS, 10)


def test_cpu_backend_with_cascade_always_matches_transformers(checkpoint, expected):
    from llmserve import LLM
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, cascade_attention="always",
             log_interval_s=0) as llm:
        assert _generate(llm, PROMPTS) == expected
        assert llm.engine.runner.cascade_steps >= 8  # every decode step had groups to attend
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks  # cached blocks count as free


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run; test_gpu.py has the GPU's")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("graphs", [False, True])
def test_triton_cascade_matches_transformers(checkpoint, expected, graphs):
    """The Triton kernels end to end (the interpreter without a GPU), also through the cascade
    graphs' padded buffers (emulated)."""
    from conftest import record_calls

    from llmserve import LLM
    from llmserve.hookspecs import hookimpl
    from llmserve.plugin_manager import get_plugin_manager
    from llmserve.plugins.cuda import CUDABackend

    class TritonEverywhere:
        @hookimpl
        def llmserve_select_backend(self, device, config):
            return CUDABackend()

    pm, plugin = get_plugin_manager(), TritonEverywhere()
    pm.register(plugin, name="triton-everywhere")
    try:
        with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                 cascade_attention="always", log_interval_s=0) as llm:
            if graphs:
                llm.engine.runner.capture_graphs(8, 64, emulate=True)
                replays = record_calls(llm.engine.runner.graphs, "_replay")
            assert _generate(llm, PROMPTS) == expected
            assert llm.engine.runner.cascade_steps >= 8
            if graphs:
                assert sum(kind == "cascade" for kind, _ in replays) >= 8
    finally:
        pm.unregister(plugin)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["cpu", "triton-graphs"] if not torch.cuda.is_available() else ["cpu"])
def test_steps_with_prompt_rows_attend_their_short_rows_groups_once(checkpoint, expected, backend):
    """The first request ends early; the third, admitted on the prefix the first left cached,
    computes its last few prompt tokens in a step beside the second's decode row: that step
    attends the shared prefix once for both, eagerly (its graph has no cascade), and every output
    is still transformers' (the CPU reference; the Triton kernels in the interpreter, graphs
    emulated, after the start-up's eager cascade passes)."""
    from llmserve import LLM, SamplingParams
    from llmserve.hookspecs import hookimpl
    from llmserve.plugin_manager import get_plugin_manager
    from llmserve.plugins.cuda import CUDABackend

    class TritonEverywhere:
        @hookimpl
        def llmserve_select_backend(self, device, config):
            return CUDABackend()

    pm, plugin = get_plugin_manager(), TritonEverywhere()
    if backend != "cpu":
        pm.register(plugin, name="triton-everywhere")
    try:
        with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, max_num_seqs=4,
                 max_num_batched_tokens=64, cascade_attention="always", log_interval_s=0) as llm:
            runner, events = llm.engine.runner, []
            if backend != "cpu":  # capture ends with the eager cascade passes: their blocks change no output
                model, passes = runner.model, []

                def recorded(input_ids, positions, meta):
                    if meta.cascade is not None:
                        passes.append((len(meta.seq_lens), int(meta.max_query_len), int(input_ids.shape[0])))
                    return model(input_ids, positions, meta)
                runner.model = recorded
                runner.capture_graphs(4, 64, emulate=True)
                runner.model = model
                assert passes == [(4, 10, 13), (4, 60, 63)]
                run_mixed = runner.graphs.run_mixed
                runner.graphs.run_mixed = lambda *a: events.append("mixed graph") or run_mixed(*a)
            original = runner._cascade

            def recorded(plan, inputs, graphed):
                groups = original(plan, inputs, graphed)
                events.append("cascade, prompt rows" if inputs.max_query_len > 1 and groups is not None else "step")
                return groups
            runner._cascade = recorded
            lengths = [2, 5, 5]
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                                [SamplingParams(max_tokens=n, temperature=0) for n in lengths], use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [e[:n] for e, n in zip(expected, lengths)]
            used = [i for i, e in enumerate(events) if e == "cascade, prompt rows"]
            assert used and all(events[i + 1:i + 2] != ["mixed graph"] for i in used)
            assert backend == "cpu" or "mixed graph" in events  # (the graphs serve the other mixed steps)
    finally:
        if backend != "cpu":
            pm.unregister(plugin)


def test_the_cost_model_picks_cascade_for_long_shared_prefixes_only():
    from llmserve.kernels.cascade import worth_it
    one = lambda rows, keys, sms=132: worth_it(np.array([rows]), np.array([keys]), 16, 8, 128, sms)  # noqa: E731
    assert one(256, 4096) and one(32, 2048)
    assert not one(2, 8192)  # two rows save one read, the prefix kernel costs about as much
    assert not one(256, 32)  # a prefix too short to pay for the partials
    assert not one(8, 8192)  # too few programs to read the prefix at speed


def test_prompt_chunks_attend_their_prefix_plainly(checkpoint, expected):
    """A prompt chunk longer than MAX_CASCADE_QUERY joins no group (its own query tiles read the
    prefix once each either way), and a step's grouped rows stay within twice max_num_seqs: their
    partial results are memory the KV cache's sizing did not count."""
    from llmserve import LLM
    from llmserve.model.runner import MAX_CASCADE_QUERY
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, cascade_attention="always",
             max_num_seqs=2, max_num_batched_tokens=24, log_interval_s=0) as llm:
        runner, seen = llm.engine.runner, []
        original = runner._cascade

        def recorded(plan, inputs, graphed):
            groups = original(plan, inputs, graphed)
            query_lens = np.diff(inputs.query_start_loc)
            rows = 0 if groups is None else int(query_lens[np.unique(groups.members)].sum())
            seen.append((plan.prefix_groups is not None, int(query_lens.max()),
                         None if groups is None else int(query_lens[groups.members].max()), rows))
            return groups
        runner._cascade = recorded
        # the first prompt's second chunk and the second prompt's first (after the six blocks the
        # first chunk left cached) share a prefix in a step of 24 tokens; then decode steps of 2
        assert _generate(llm, PROMPTS[:2]) == expected[:2]
        assert any(longest > MAX_CASCADE_QUERY and grouped and used is None for grouped, longest, used, _ in seen)
        assert any(used for _, _, used, _ in seen)
        assert all(used <= MAX_CASCADE_QUERY and rows <= 4 for _, _, used, rows in seen if used)


def test_eager_cascade_layouts_cover_the_size_classes_steps_meet():
    """The start-up's eager cascade passes: every power of two of sequences up to the batch, group
    counts on both sides of 16, odd token counts, the largest step less a token, valid groups."""
    from llmserve.model.cuda_graphs import eager_cascade_layouts
    layouts = eager_cascade_layouts(256, 8192, 16, 100_000, 32, 8, 40960)
    seqs = [inputs.num_reqs for inputs, _ in layouts]
    assert seqs == [4, 8, 16, 32, 64, 128, 256, 256]
    assert all(inputs.num_tokens % 2 == 1 for inputs, _ in layouts) and layouts[-1][0].num_tokens == 8191
    assert {g.num_groups for _, g in layouts} >= {1, 15, 32}
    for inputs, groups in layouts:
        rows = np.diff(inputs.query_start_loc)
        assert rows[-1] > 8 and (rows[:-1] == 1).all()  # one prompt row, in no group
        members = np.split(groups.members, groups.starts[1:-1])
        assert all(len(m) >= 2 for m in members) and sorted(groups.members.tolist()) == list(range(len(rows) - 1))
        for g, m in enumerate(members):  # a group's rows begin with its one shared block, wholly in context
            assert len(set(inputs.block_tables[m, 0].tolist())) == 1 and (inputs.seq_lens[m] - 1 >= groups.hi[g]).all()
        used = np.concatenate([inputs.block_tables[:-1, :2].ravel(), inputs.block_tables[-1, :-(-rows[-1] // 16)]])
        assert used.min() >= 1  # block 0 is left to the graphs' padding rows
        own = inputs.block_tables[:-1, 1]
        assert len(set(own.tolist())) == len(own) and not set(own.tolist()) & set(inputs.block_tables[:-1, 0].tolist())
    assert eager_cascade_layouts(4, 64, 4, 100, 32, 8, 256)[0][0].num_reqs == 4
    assert eager_cascade_layouts(2, 64, 4, 100, 32, 8, 256) == []  # one one-token row: no group
    few = eager_cascade_layouts(256, 8192, 16, 20, 32, 8, 40960)  # a cache of 20 blocks: the layouts that fit
    assert [i.num_reqs for i, _ in few] == [4, 8] and all(int(i.block_tables.max()) < 20 for i, _ in few)
    short = eager_cascade_layouts(256, 8192, 16, 100_000, 32, 8, 300)  # no sequence past max_model_len
    assert [i.num_reqs for i, _ in short] == [4, 8, 16, 32, 64, 128, 256, 256]
    assert all(int(i.positions.max()) < 300 for i, _ in short) and short[-1][0].num_tokens % 2 == 1


@pytest.mark.parametrize("capacity", [(1, 2, 2, 3), (8, 37, 19, 4101), (32, 512, 256, 256), (3, 5, 7, 9)])
def test_packed_sections_each_start_on_16_bytes(capacity):
    """Triton compiles a kernel variant per pointer alignment: every section of the packed
    metadata starts 16-byte aligned whatever the counts, and holds what pack() put there."""
    G, R, S, T = capacity
    groups = PrefixGroups(np.array([0, 2], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
                          np.array([4], np.int32), np.array([0], np.int32))
    qsl = np.arange(min(S, T) + 1, dtype=np.int32)  # one token per sequence
    packed = torch.zeros(CascadeMetadata.size(*capacity), dtype=torch.int32)
    CascadeMetadata.pack(groups, qsl, packed.numpy(), capacity)
    meta = CascadeMetadata.view(packed, capacity)
    fields = [meta.row_start, meta.rows, meta.seq, meta.lo, meta.hi, meta.level, meta.kv_start, meta.levels]
    assert [f.numel() for f in fields] == [G + 1, R, G, G, G, G, S, T]
    assert all((f.data_ptr() - packed.data_ptr()) % 16 == 0 for f in fields)
    assert meta.row_start[:2].tolist() == [0, 2] and meta.rows[:2].tolist() == [0, 1]
    assert (int(meta.seq[0]), int(meta.lo[0]), int(meta.hi[0])) == (0, 0, 4) and meta.kv_start[:2].tolist() == [4, 4]
    assert meta.levels[:2].tolist() == [1, 1] and not meta.levels[2:].any() and not meta.kv_start[2:].any()
