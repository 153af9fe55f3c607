from array import array

import numpy as np

from llmserve.core import kv_cache_manager
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.messages import PLACEHOLDER, Admission, ScheduledRequest, StepProposal
from llmserve.sampling_params import SamplingParams


def admit(req_id, tokens, n, key=None, cache=True):
    return ScheduledRequest(req_id, n, list(tokens), key or (0, float(len(req_id)), 0),
                            Admission(len(tokens), SamplingParams(), cache))


def decode(req_id, token, key):
    return ScheduledRequest(req_id, 1, [token], key)


def test_prefill_allocates_blocks_and_builds_plan():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    plan, fb = kv.process(StepProposal(0, [admit("a", range(10), 10, (0, 0.0, 0))]))
    assert kv.requests["a"].block_ids.tolist() == [0, 1, 2]
    assert plan.req_ids == ["a"] and plan.token_ids.tolist() == list(range(10))
    assert plan.context_lens.tolist() == [0] and plan.query_lens.tolist() == [10]
    assert plan.block_tables.tolist() == [[0, 1, 2]] and plan.sample.tolist() == [True]
    assert fb.scheduled == {"a": (0, 10, True)} and fb.cached_tokens == {"a": 0}
    assert [kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]


def test_chunked_prefill_does_not_sample_until_last_chunk():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    plan, _ = kv.process(StepProposal(0, [admit("a", range(10), 7, (0, 0.0, 0))]))
    assert plan.query_lens.tolist() == [7] and plan.sample.tolist() == [False]
    plan, fb = kv.process(StepProposal(1, [ScheduledRequest("a", 7, [], (0, 0.0, 0))]))
    assert plan.context_lens.tolist() == [7] and plan.query_lens.tolist() == [3]
    assert plan.token_ids.tolist() == [7, 8, 9] and plan.sample.tolist() == [True]
    assert fb.scheduled == {"a": (7, 3, True)}


def test_prefix_hit_shares_blocks_and_skips_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.process(StepProposal(0, [admit("a", range(10), 10, (0, 0.0, 0))]))
    # Same step semantics: b arrives later and shares a's two full blocks.
    plan, fb = kv.process(StepProposal(1, [decode("a", 99, (0, 0.0, 0)),
                                           admit("b", [*range(8), 50, 51, 52], 11, (0, 1.0, 1))]))
    assert kv.requests["b"].block_ids.tolist()[:2] == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert fb.cached_tokens["b"] == 8 and fb.scheduled["b"] == (8, 3, True)
    assert plan.token_ids.tolist() == [99, 50, 51, 52]
    assert kv.prefix_hits == 8 and kv.prefix_queries == 21


def test_full_prompt_hit_still_computes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.process(StepProposal(0, [admit("a", range(8), 8, (0, 0.0, 0))]))
    plan, fb = kv.process(StepProposal(1, [admit("b", range(8), 8, (0, 1.0, 1))]))
    assert fb.scheduled["b"] == (4, 4, True)  # only the first block is reused: its last token must be computed
    assert kv.requests["b"].block_ids[0] == 0


def test_freed_request_returns_blocks_and_cache_survives():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.process(StepProposal(0, [admit("a", range(9), 9, (0, 0.0, 0))]))
    assert kv.num_free_blocks() == 1
    plan, _ = kv.process(StepProposal(1, [], freed=["a"]))
    assert kv.num_free_blocks() == 4 and plan.freed == ["a"]
    _, fb = kv.process(StepProposal(2, [admit("b", range(9), 9, (0, 1.0, 1))]))
    assert fb.cached_tokens["b"] == 8


def test_preempts_lowest_priority_when_pool_runs_dry():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.process(StepProposal(0, [admit("a", range(4), 4, (0, 0.0, 0)), admit("b", range(10, 14), 4, (0, 1.0, 1))]))
    assert kv.num_free_blocks() == 0
    plan, fb = kv.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), decode("b", 2, (0, 1.0, 1))]))
    assert fb.preempted == ["b"] and list(fb.scheduled) == ["a"]
    assert kv.requests["a"].block_ids.tolist() == [0, 1, 3]  # b's freed tail block went to a
    assert "b" not in kv.requests and plan.req_ids == ["a"]


def test_a_preempted_request_is_readmitted_with_the_tokens_it_was_sent_before():
    """Preempted while its token was in flight (a PLACEHOLDER last), it keeps its tokens here: its
    re-admission carries only that token, which takes the placeholder's place."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.process(StepProposal(0, [admit("a", range(4), 4, (0, 0.0, 0)), admit("b", range(10, 14), 4, (0, 1.0, 1))]))
    _, fb = kv.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), decode("b", PLACEHOLDER, (0, 1.0, 1))]))
    assert fb.preempted == ["b"] and kv.parked["b"].tolist() == [10, 11, 12, 13, PLACEHOLDER]
    kv.process(StepProposal(2, [], freed=["a"]))
    readmit = ScheduledRequest("b", 5, [99], (0, 1.0, 1), Admission(4, SamplingParams(), False))
    plan, fb = kv.process(StepProposal(3, [readmit]))
    assert list(fb.scheduled) == ["b"] and "b" not in kv.parked
    assert plan.token_ids.tolist() == [10, 11, 12, 13, 99] and plan.sample.tolist() == [True]
    assert plan.new_sequences["b"].prompt_token_ids.tolist() == [10, 11, 12, 13]


def test_a_parked_request_that_finishes_leaves_nothing_behind():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.process(StepProposal(0, [admit("a", range(4), 4, (0, 0.0, 0))]))
    _, fb = kv.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), admit("b", range(10, 16), 6, (0, 1.0, 1))]))
    assert fb.not_admitted == ["b"] and kv.parked["b"].tolist() == list(range(10, 16))
    kv.process(StepProposal(2, [], freed=["a", "b"]))
    assert kv.parked == {} and kv.requests == {} and kv.num_free_blocks() == 3


def test_new_request_that_does_not_fit_stays_waiting():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.process(StepProposal(0, [admit("a", range(4), 4, (0, 0.0, 0))]))
    _, fb = kv.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), admit("b", range(10, 16), 6, (0, 1.0, 1))]))
    assert fb.not_admitted == ["b"] and fb.preempted == [] and "b" not in kv.requests
    assert kv.num_free_blocks() == 0


def test_higher_priority_arrival_preempts_running():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.process(StepProposal(0, [admit("low", range(4), 4, (5, 0.0, 0))]))
    _, fb = kv.process(StepProposal(1, [admit("high", range(10, 14), 4, (0, 1.0, 1)), decode("low", 1, (5, 0.0, 0))]))
    assert fb.preempted == ["low"] and list(fb.scheduled) == ["high"]
    assert kv.num_free_blocks() == 1


def test_salted_requests_share_only_within_their_group():
    kv = KVCacheManager(num_blocks=16, block_size=4)

    def salted(req_id, salt, key):
        return ScheduledRequest(req_id, 9, list(range(9)), key, Admission(9, SamplingParams(), True, salt))

    _, fb = kv.process(StepProposal(0, [salted("p#0", "p", (0, 0.0, 0)), salted("p#1", "p", (0, 0.0, 1)),
                                        salted("q#0", "q", (0, 1.0, 2)), admit("plain", range(9), 9, (0, 2.0, 3))]))
    assert fb.cached_tokens == {"p#0": 0, "p#1": 8, "q#0": 0, "plain": 0}
    assert kv.requests["p#1"].block_ids[:2] == kv.requests["p#0"].block_ids[:2]
    assert kv.prefix_queries == 9  # only unsalted requests count towards the shared cache's hit rate


def test_placeholder_is_resolved_before_its_block_is_hashed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.process(StepProposal(0, [admit("a", range(7), 7, (0, 0.0, 0))]))  # samples token 7, still unknown
    # Next step planned before that token is known: it rides as a placeholder and fills block 1.
    plan, fb = kv.process(StepProposal(1, [ScheduledRequest("a", 1, [-1], (0, 0.0, 0))]))
    assert plan.token_ids.tolist() == [-1] and fb.scheduled["a"] == (7, 1, True)
    req = kv.requests["a"]
    assert len(req.block_hashes) == 1 and kv.pool.blocks[req.block_ids[1]].block_hash is None
    # The step after: the real token replaces the placeholder, the block is hashed, a new one rides.
    plan, fb = kv.process(StepProposal(2, [ScheduledRequest("a", 1, [70, -1], (0, 0.0, 0))]))
    assert req.token_ids[-2:].tolist() == [70, -1] and plan.context_lens.tolist() == [8]
    assert len(req.block_hashes) == 2 and kv.pool.lookup(req.block_hashes[1]) == req.block_ids[1]


def admit_budget(req_id, tokens, n, key, max_tokens):
    return ScheduledRequest(req_id, n, list(tokens), key, Admission(len(tokens), SamplingParams(max_tokens=max_tokens), True))


def test_admission_keeps_room_for_the_growth_of_requests_ahead():
    """a (2 blocks, may grow by 4) runs; b fits now (1 block) but not with a's growth and its own."""
    first = admit_budget("a", range(8), 8, (0, 0.0, 0), max_tokens=16)
    second = admit_budget("b", range(100, 104), 4, (0, 1.0, 1), max_tokens=8)
    greedy = KVCacheManager(num_blocks=8, block_size=4)
    greedy.process(StepProposal(0, [first]))
    _, fb = greedy.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), second]))
    assert "b" in fb.scheduled  # admitted: it would be preempted once a grows

    kv = KVCacheManager(num_blocks=8, block_size=4, reserve_growth=True)
    _, fb = kv.process(StepProposal(0, [first]))  # nothing ahead of a: admitted as it fits
    assert kv.growth(kv.requests["a"]) == 4
    _, fb = kv.process(StepProposal(1, [decode("a", 1, (0, 0.0, 0)), second]))
    # After a's block for this step 5 are free; b needs 1 now plus room for a's growth (3 more
    # blocks to its end at 24 tokens) and its own (2 more to 12 tokens): 6 > 5
    assert fb.not_admitted == ["b"] and "b" not in kv.requests and fb.preempted == []

    # Requests that ended having used none of their budget lower the share reserved: b fits.
    for i in range(40):
        kv.process(StepProposal(2 + 2 * i, [admit_budget(f"x{i}", range(200, 204), 4, (0, 2.0 + i, 2 + i), 16)]))
        kv.process(StepProposal(3 + 2 * i, [], freed=[f"x{i}"]))
    assert kv.budget_share < 0.2
    _, fb = kv.process(StepProposal(99, [decode("a", 2, (0, 0.0, 0)), second]))
    assert "b" in fb.scheduled


def test_room_for_growth_is_never_taken_by_preemption():
    """A priority arrival whose blocks fit but whose room for growth does not waits; the
    lower-priority request after it in the walk keeps running."""
    kv = KVCacheManager(num_blocks=12, block_size=4, reserve_growth=True)
    top, low = (0, 0.0, 0), (5, 1.0, 1)
    kv.process(StepProposal(0, [admit_budget("top", range(4), 4, top, max_tokens=20),
                                admit_budget("low", range(10, 14), 4, low, max_tokens=4)]))
    mid = admit_budget("mid", range(20, 28), 8, (1, 2.0, 2), max_tokens=16)
    # top grows into its 2nd block (4 more to come), 9 free; mid needs 2 and room for 4 + 4 more
    _, fb = kv.process(StepProposal(1, [decode("top", 1, top), mid, decode("low", 2, low)]))
    assert fb.not_admitted == ["mid"] and fb.preempted == []
    assert set(fb.scheduled) == {"top", "low"}


def test_an_entry_that_fails_fails_alone_and_its_blocks_go_back(monkeypatch):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    original = kv.admit

    def admit_or_fail(req, *args, **kw):
        if req.req_id == "b":
            req.block_ids = kv.pool.allocate(1)  # it took a block before it failed
            raise KeyError("bug")
        return original(req, *args, **kw)
    monkeypatch.setattr(kv, "admit", admit_or_fail)
    plan, fb = kv.process(StepProposal(0, [admit("a", range(6), 6, (0, 0.0, 0)), admit("b", range(9), 9, (0, 1.0, 1)),
                                           admit("c", range(3), 3, (0, 2.0, 2))]))
    assert plan.req_ids == ["a", "c"] and set(plan.new_sequences) == {"a", "c"}
    assert fb.failed == {"b": "KV cache manager: KeyError: 'bug'"} and set(fb.scheduled) == {"a", "c"}
    assert "b" not in kv.requests and kv.pool.num_free == 8 - 2 - 1


def test_tentative_admissions_take_only_the_budget_cache_hits_left():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    shared = list(range(100, 116))  # four blocks
    kv.process(StepProposal(0, [admit("warm", shared + [1], 17)], token_budget=20))
    kv.free("warm")
    tentative = lambda r, tokens: ScheduledRequest(r, len(tokens), list(tokens), (0, 1.0, len(r)),  # noqa: E731
                                                   Admission(len(tokens), SamplingParams(), True), tentative=True)
    entries = [admit("a", shared + [2, 3], 18),  # charged 18, computes 2 (16 cached)
               tentative("b", shared + [4]),  # computes 1
               tentative("c", list(range(50, 70))),  # nothing cached: 20 tokens, 17 left: a chunk of 17
               tentative("d", shared + [5])]  # the budget is spent
    plan, fb = kv.process(StepProposal(1, entries, token_budget=20))
    assert fb.scheduled == {"a": (16, 2, True), "b": (16, 1, True), "c": (0, 17, False)}
    assert fb.not_admitted == ["d"] and "d" in kv.parked and plan.num_tokens == 20


def test_plans_report_rows_sharing_prefix_blocks_when_asked():
    shared = list(range(100, 112))  # three blocks
    for groups in (False, True):
        kv = KVCacheManager(num_blocks=32, block_size=4, prefix_groups=groups)
        kv.process(StepProposal(0, [admit("a", shared + [1], 13)]))
        plan, _ = kv.process(StepProposal(1, [decode("a", 7, (0, 0.0, 0)), admit("b", shared + [2], 13, (0, 1.0, 1)),
                                               admit("c", [9] * 13, 13, (0, 2.0, 2))]))
        if not groups:
            assert plan.prefix_groups is None
            continue
        g = plan.prefix_groups  # b's context is its three cached blocks: it joins a at once
        assert g.starts.tolist() == [0, 2] and g.members.tolist() == [0, 1] and g.hi.tolist() == [12]


def test_blocks_every_window_has_passed_go_back_and_stay_cached():
    """Windows of 6 keys, blocks of 4: once neither the step planned nor the one in flight has a
    query that sees a block, it goes back to the pool (cached: a new request with the prompt hits it)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, window=6)
    key = (0, 0.0, 0)
    kv.process(StepProposal(0, [admit("a", range(20), 20, key)]))
    kv.process(StepProposal(1, [decode("a", 100, key)]))  # queries from 20; the prompt's step from 0
    assert kv.requests["a"].released == 0 and kv.num_free_blocks() == 10
    plan, _ = kv.process(StepProposal(2, [decode("a", 101, key)]))  # from 21; in flight from 20: sees keys 15..
    a = kv.requests["a"]
    assert a.released == 3 and kv.released_blocks == 3 and kv.num_free_blocks() == 13  # positions 0..11
    assert plan.block_tables.tolist() == [a.block_ids.tolist()]  # (their ids stay, never read)
    _, fb = kv.process(StepProposal(3, [admit("b", range(20), 20, (0, 1.0, 1))]))
    assert fb.cached_tokens["b"] == 16  # the prompt's blocks, given back or held, still hit
    kv.process(StepProposal(4, [], freed=["a", "b"]))
    assert kv.num_free_blocks() == 16  # nothing freed twice


def test_a_preempted_windowed_request_gives_back_only_what_it_still_holds():
    kv = KVCacheManager(num_blocks=8, block_size=2, window=2)
    a, b = (0, 0.0, 0), (0, 1.0, 1)
    kv.process(StepProposal(0, [admit("a", range(6), 6, a)]))
    for i, t in enumerate(range(100, 103)):
        kv.process(StepProposal(1 + i, [decode("a", t, a)]))
    assert kv.requests["a"].released == 3 and kv.num_free_blocks() == 6  # 9 tokens: it holds blocks 3, 4
    _, fb = kv.process(StepProposal(9, [decode("a", 200, a), admit("b", range(50, 62), 12, b)]))
    assert "b" in fb.scheduled and kv.num_free_blocks() == 0
    _, fb = kv.process(StepProposal(10, [admit("z", range(70, 86), 16, (-1, 0.0, 0))]))  # ranks first
    assert fb.preempted == ["b", "a"] and kv.num_free_blocks() == 0 and "z" in fb.scheduled
    kv.process(StepProposal(11, [], freed=["a", "b", "z"]))
    assert kv.num_free_blocks() == 8


def test_a_plans_prefix_groups_are_the_last_plans_while_nothing_they_depend_on_changed():
    """Step after step of the same running rows, the groups are the last step's (no search);
    what could change them (the first steps' contexts, which end the group; a row leaving)
    searches again. At every step they equal a fresh search."""
    import random

    from llmserve.core.kv_cache_manager import find_prefix_groups

    rng = random.Random(0)
    kv = KVCacheManager(4096, 4, max_model_len=4096, prefix_groups=True)
    searches = []
    original = kv_cache_manager.find_prefix_groups
    kv_cache_manager.find_prefix_groups = lambda *a, **k: searches.append(1) or original(*a, **k)
    try:
        shared = [rng.randrange(3, 99) for _ in range(10)]  # two blocks and two tokens
        names = [f"r{i}" for i in range(5)]
        prompts = {r: shared + [rng.randrange(3, 99) for _ in range(i)] for i, r in enumerate(names)}
        key = lambda i: (0, float(i), i)  # noqa: E731
        # the first prompt's blocks are cached, then all five run (the others hit its two blocks)
        plan, _ = kv.process(StepProposal(0, [ScheduledRequest("r0", len(prompts["r0"]), array("q", prompts["r0"]),
                                                               key(0), Admission(10, SamplingParams(), True))]))
        entries = [ScheduledRequest(r, len(prompts[r]), array("q", prompts[r]), key(i), Admission(len(prompts[r]),
                                    SamplingParams(), True)) for i, r in enumerate(names[1:], 1)]
        entries.insert(0, ScheduledRequest("r0", 1, array("q", [7]), key(0)))
        plans = [kv.process(StepProposal(1, entries))[0]]
        for step in range(2, 40):
            entries = [ScheduledRequest(r, 1, array("q", [rng.randrange(3, 99)]), key(i)) for i, r in enumerate(names)]
            if step == 20:  # one row leaves: other rows
                kv.free(names.pop())
                entries.pop()
            plans.append(kv.process(StepProposal(step, entries))[0])
        for p in plans:
            fresh = find_prefix_groups(p.block_tables, p.context_lens // 4, 4)
            assert fresh is not None and p.prefix_groups is not None
            for field in ("starts", "members", "lo", "hi", "level"):
                assert np.array_equal(getattr(p.prefix_groups, field), getattr(fresh, field))
        assert plans[5].prefix_groups is plans[4].prefix_groups  # reused
        assert 2 <= len(searches) <= 8  # the first steps, the step a row left
    finally:
        kv_cache_manager.find_prefix_groups = original
