"""Speculative decoding: the n-gram proposer, drafts as extra tokens in the scheduler and the KV
manager, and engine outputs with speculation equal to those without it (greedy and seeded
sampling), whatever the proposals are."""

from __future__ import annotations

import time
from array import array
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
import torch
from conftest import ARCHS, Register, hold_speculation_on, record_calls

import llmserve
from llmserve import LLM, SamplingParams
from llmserve.cli import parse_serve
from llmserve.config import EngineConfig, SpeculativeConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.messages import Admission, NewRequest, ScheduledRequest, StepFeedback, StepProposal, StepResult
from llmserve.model.drafting import Drafting
from llmserve.plugin_manager import get_plugin_manager
from llmserve.plugins.ngram import NgramProposer
from llmserve.speculative import Acceptance, SpecControl, Speculation, kept_drafts

COMMON = dict(dtype="float32", device="cpu", log_interval_s=0)


# ---- the n-gram proposer ---------------------------------------------------------------------

def ngram(n_max=4, n_min=1):
    return NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_max=n_max, prompt_lookup_min=n_min))


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = ngram()
    #                     a  b  c  d  e  x  a  b  c  f  g  .  b  c
    tokens = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7, 8, 2, 3], dtype=np.int64)
    assert p.lookup(tokens, 3) == [6, 7, 8]  # "b c" last seen before "f g ."
    assert p.lookup(np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int64), 2) == [4, 1]  # "1 2 3" beats "3"
    assert p.lookup(np.array([1, 2, 3, 4, 5], dtype=np.int64), 4) == []  # nothing repeats
    assert p.lookup(np.array([7, 7, 7], dtype=np.int64), 5) == [7]  # overlapping: what follows is known
    assert ngram(n_max=3, n_min=2).lookup(np.array([1, 2, 9, 2], dtype=np.int64), 2) == []  # 1-grams not asked
    prompt = array("q", [10, 11, 12, 13])
    assert p.propose(["a", "b"], [(prompt, [10, 11]), (prompt, [])], [2, 2]) == [[12, 13], []]


def test_ngram_lookup_equals_the_plain_search_over_every_length():
    def plain(tokens, n_max, n_min, limit):  # longest n first, its latest earlier occurrence
        total = len(tokens)
        for n in range(min(n_max, total - 1), n_min - 1, -1):
            for start in range(total - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[total - n:]:
                    return tokens[start + n:start + n + limit]
        return []

    rng = np.random.default_rng(0)
    for i in range(3000):  # few candidates (compared one by one) and many (as one array)
        tokens = rng.integers(0, 4 if i % 3 else 40, int(rng.integers(1, 30 if i % 3 else 120))).tolist()
        n_max = int(rng.integers(1, 6))
        n_min = int(rng.integers(1, n_max + 1))
        got = ngram(n_max, n_min).lookup(np.array(tokens, dtype=np.int64), 3)
        assert got == plain(tokens, n_max, n_min, 3), (tokens, n_max, n_min)


def test_ngram_proposals_from_a_growing_request_are_those_of_its_whole_sequence():
    """A request's tokens are kept between calls and extended by what its output gained; a last
    token rewritten since (jump-forward) rebuilds them, and forget() lets them go."""
    rng = np.random.default_rng(1)
    p, fresh = ngram(), ngram()
    prompt = array("q", rng.integers(0, 6, 40).tolist())
    output: list[int] = []
    rebuilt = 0
    for step in range(120):
        if step % 17 == 5:
            output[-1] = (output[-1] + 1) % 6  # the last token it saw, rewritten after the fact
            rebuilt += 1
        output += rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
        got = p.propose(["a"], [(prompt, output)], [4])
        assert got == fresh.propose([f"x{step}"], [(prompt, output)], [4])  # (a request seen once)
        assert p._seen["a"][0][:len(prompt) + len(output)].tolist() == list(prompt) + output
    assert rebuilt == 7
    p.forget(["a"])
    assert p._seen == {}


def test_kept_drafts_is_the_run_of_draws_that_confirm_them():
    assert kept_drafts([5, 6, 7], [5, 6]) == 2
    assert kept_drafts([5, 9, 7], [5, 6]) == 1
    assert kept_drafts([4, 6, 7], [5, 6]) == 0


# ---- scheduler and KV manager ----------------------------------------------------------------

def make_scheduler(**kw):
    args = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, eos_token_ids=frozenset({0}),
                speculation=Speculation(num_tokens=3, max_batch=4))
    args.update(kw)
    return Scheduler(**args)


def feedback(s, proposal):
    sched = {}
    for e in proposal.entries:
        req = s.requests[e.req_id]
        before = req.num_computed - e.retract
        sched[e.req_id] = (before, e.num_tokens, True)
    s.on_feedback(StepFeedback(proposal.step_id, sched, [], [], {}, 0.0, 0, 0))


def test_drafts_are_extra_tokens_and_rejected_ones_are_taken_back():
    s = make_scheduler()
    s.add(NewRequest("a", array("q", [1, 2, 3]), SamplingParams(seed=1, max_tokens=20)))
    p = s.schedule()
    assert p.entries[0].propose == 3 and p.entries[0].drafts == 0
    feedback(s, p)
    assert s.must_wait()  # its drafts follow the token in flight
    s.on_result(StepResult(p.step_id, ["a"], [7], drafts={"a": [8, 9, 10]}))
    p = s.schedule()
    e = p.entries[0]
    assert (e.num_tokens, list(e.new_token_ids), e.drafts, e.propose) == (4, [7, 8, 9, 10], 3, 3)
    feedback(s, p)
    assert s.requests["a"].num_computed == 7
    # the draws keep 8, reject 9: the request produced 8 and 5; drafts 9, 10 are taken back
    out = s.on_result(StepResult(p.step_id, ["a"], [8], accepted={"a": [8, 5]}, drafts={"a": []}))
    assert out.updates[0].new_token_ids == [8, 5] and s.jumped_tokens == 0 and s.generation_tokens == 3
    req = s.requests["a"]
    assert (req.num_computed, req.num_tokens, req.retract) == (5, 6, 2)
    assert (s.spec.drafts, s.spec.draft_tokens, s.spec.accepted_tokens, s.spec.accepted_per_pos) == (1, 3, 1, [1, 0, 0])
    # no proposal this time: a plain step, proposals asked for again
    p = s.schedule()
    e = p.entries[0]
    assert (list(e.new_token_ids), e.retract, e.drafts, e.propose) == ([8, 5], 2, 0, 3)
    feedback(s, p)
    assert s.must_wait()


def test_a_request_checks_as_many_drafts_as_its_record_and_the_batch_make_worth_a_row():
    """Alone, a request checks all it may; in a batch, as many as its kept share to the power of
    the draft's place clears the batch's bar (nothing at 1, DRAFT_ODDS at the speculating limit)."""
    poor, good = Acceptance(), Acceptance()
    for _ in range(10):
        poor.record(4, 0)  # always rejected at once
        good.record(4, 4)
    assert [poor.limit(4, b, 32) for b in (1, 2, 16, 32)] == [4, 1, 1, 1]
    assert [good.limit(4, b, 32) for b in (1, 2, 16, 32)] == [4, 4, 4, 4]
    half = Acceptance(kept=1.0, judged=2.0)  # half kept: the i-th draft's chance 0.5^i
    assert half.limit(8, 32, 32) == 2 and half.limit(8, 9, 33) == 4 and half.limit(8, 1, 32) == 8  # 0.5^4 > 0.05
    assert Acceptance().limit(4, 32, 32) == 3  # the prior: two thirds


def test_a_scheduled_request_proposes_fewer_drafts_in_a_batch_while_few_are_kept():
    s = make_scheduler(speculation=Speculation(num_tokens=3, max_batch=2))
    for r in ("a", "b"):
        s.add(NewRequest(r, array("q", [1, 2, 3]), SamplingParams(seed=1, max_tokens=40)))
    asked = []
    for _ in range(6):  # a keeps every draft it checks, b none
        p = s.schedule()
        feedback(s, p)
        accepted, drafts = {}, {}
        for e in p.entries:
            checked = list(e.new_token_ids[len(e.new_token_ids) - e.drafts:]) if e.drafts else []
            if checked:
                accepted[e.req_id] = checked + [20] if e.req_id == "a" else [30]
            drafts[e.req_id] = [40] * e.propose
        asked.append({e.req_id: e.propose for e in p.entries})
        s.on_result(StepResult(p.step_id, [e.req_id for e in p.entries], [20, 30], accepted=accepted, drafts=drafts))
    assert asked[0] == asked[1] == {"a": 3, "b": 3}  # (the prior's, before any check)
    assert asked[-1] == {"a": 3, "b": 1}
    s.finish(["a"])  # b alone: all it may again
    assert s.schedule().entries[0].propose == 3


def test_speculation_stops_while_it_keeps_too_few_drafts_and_probes_before_it_starts_again():
    c = SpecControl()
    step = 0

    def until_stopped(requests, kept, limit=100):
        for taken in range(1, limit + 1):
            c.planned()
            c.record(requests, kept)
            if not c.active:
                return taken
        return None

    def probe(asked, found):
        """Plan steps until a probe is due, send it and give its result; the steps waited."""
        nonlocal step
        waited = 0
        while not c.probe_due:
            assert not c.active
            c.planned()
            waited += 1
        step += 1
        c.probe_sent(step)
        assert not c.probe_due
        c.planned()
        c.probed(asked, found)
        return waited
    assert c.active  # from the start
    assert until_stopped(4, 0) == SpecControl.SETTLE  # nothing kept: judged once the spell has its first steps
    assert probe(4, 1) == 8 and not c.active  # too few proposals found: no spell
    assert probe(4, 0) == 16 and probe(0, 0) == 32 and probe(4, 0) == 64  # the gap doubles
    assert probe(4, 2) == 128 and c.active and (c.gain, c.steps) == (0.0, 0)  # a spell's mean is its own
    assert until_stopped(4, 0) == SpecControl.SETTLE  # a short spell: the gap doubles too
    assert probe(4, 4) == 256 and c.active
    assert until_stopped(4, 4) is None  # a draft kept a step per request: it stays on
    assert until_stopped(4, 0) == 12 and probe(4, 4) == 8  # after a long spell (its mean 0.9^n, plus its
    # standard error, under 0.4 after 12 steps) the gap starts over
    assert until_stopped(4, 1) == SpecControl.SETTLE  # 0.25 a request: too few
    while not c.probe_due:
        c.planned()
    c.probe_sent(99)  # its result never comes: after a while, a miss
    for _ in range(2 * SpecControl.FIRST_GAP + 1):
        c.planned()
    assert c.probe_step is None and not c.active


def _spell(kept_pattern, interval, steps=300, plain_interval=0.002, cost=0.5, plain_batch=1):
    """A controller stopped once (nothing kept), plain steps of `plain_interval` s (of
    `plain_batch` requests) while it waits, then a spell of one request keeping `kept_pattern` in
    turn, a step every `interval` s, its proposer taking `cost` of a step; returns the controller
    and the steps the spell lasted."""
    c = SpecControl(max_gain=4)
    for _ in range(SpecControl.SETTLE):
        c.record(1, 0, cost=cost, interval=interval)
    assert not c.active
    while not c.probe_due:
        c.planned()
        c.plain(plain_interval, plain_batch)
    c.probe_sent(1)
    c.probed(1, 1)
    for i in range(steps):
        c.record(1, kept_pattern[i % len(kept_pattern)], cost=cost, interval=interval)
        if not c.active:
            return c, i + 1
    return c, steps


def test_the_bar_is_what_speculating_steps_measure_against_plain_ones():
    """1.1 drafts kept a step, in bursts with six rejections in a row: at 1.6 plain steps a step
    (the bar 0.6) it pays, and a run of rejections does not stop it (the mean dips to ~0.6, its
    standard error keeps it above the bar); at 2.25 plain steps (the bar 1.25) it stops. Before
    anything is measured the bar is the model's: 0.4 plus the proposer's cost."""
    bursty = [4, 0, 0, 0, 0, 0, 0, 3, 2, 2]
    c, lasted = _spell(bursty, 0.0032)
    assert c.active and lasted == 300 and c.bar() == pytest.approx(0.6)
    c, lasted = _spell(bursty, 0.0045)
    assert not c.active and c.bar() == pytest.approx(1.25) and lasted < 30
    fresh = SpecControl(max_gain=4)
    fresh.record(1, 2, cost=0.5, interval=0.0032)
    assert fresh.bar() == pytest.approx(0.9)  # nothing plain measured yet


def test_plain_steps_of_another_size_are_no_measure_of_a_spell():
    """Plain steps timed at 16 requests (5 ms) say nothing of speculating steps of one (2.5 ms,
    for 0.2 drafts kept): the bar stays the model's (0.4 plus the proposer's cost), and the spell
    stops; measured beside plain steps of one (2 ms) the bar is 0.25."""
    c, _ = _spell([0, 0, 0, 0, 1], 0.0025, steps=40, plain_interval=0.005, cost=0.1, plain_batch=16)
    assert not c.active and c.bar(1) == pytest.approx(0.5) and c.bar(16) == pytest.approx(0.5)
    for _ in range(SpecControl.SETTLE):
        c.plain(0.002, batch=1)
    assert c.bar(1) == pytest.approx(0.25) and c.bar(2) == pytest.approx(0.5)  # (2: another class)


def test_a_steady_shortfall_stops_a_spell_whatever_its_spread():
    """A spell that keeps 0.3 drafts a step against a bar of 0.6 stops once its mean and error
    settle under the bar, within a few dozen steps."""
    c, lasted = _spell([0, 0, 1, 0, 0, 0, 1, 0, 0, 1], 0.0032)
    assert not c.active and lasted < 40


def test_plain_steps_are_timed_while_speculation_is_stopped_and_probes_are_not():
    s = make_scheduler()
    control = s.spec_control
    s.add(NewRequest("a", array("q", [1, 2, 3]), SamplingParams(seed=1, max_tokens=40)))
    p = s.schedule()
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [5], drafts={"a": []}, interval=0.001))  # speculating: not plain
    assert not any(control.plain_intervals.values())
    control.active, control.wait = False, 2
    for interval in (0.002, 0.003):
        p = s.schedule()
        feedback(s, p)
        s.on_result(StepResult(p.step_id, ["a"], [6], interval=interval))
    p = s.schedule()  # the probe (proposals asked for: its step is not a plain one)
    assert control.probe_step == p.step_id
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [7], drafts={"a": []}, interval=0.009))
    assert {k: list(v) for k, v in control.plain_intervals.items()} == {1: [0.002, 0.003]}  # steps of one request


def test_the_executor_times_each_step_from_the_result_before():
    class Lookup:
        def propose(self, req_ids, sequences, limits):
            return [[] for _ in req_ids]

    drafting, seqs = Drafting(Lookup(), 100), {}
    first, second = StepResult(1, [], []), StepResult(2, [], [])
    drafting.finished(first, {}, seqs)
    time.sleep(0.01)
    drafting.finished(second, {}, seqs)
    assert first.interval == 0.0 and 0.01 <= second.interval < 0.1


def test_the_controller_judges_proposals_by_the_step_that_checks_them():
    """A request's first proposing step is not counted (its drafts are not checked yet: a slow
    proposer would otherwise stop speculation before anything was checked); a step that checked
    drafts counts what it kept, and one that waited for proposals that did not come counts zero."""
    s = make_scheduler()
    records = record_calls(s.spec_control, "record")
    s.add(NewRequest("a", array("q", [1, 2, 3]), SamplingParams(seed=1, max_tokens=40)))

    def step(accepted=None, drafts=()):
        p = s.schedule()
        feedback(s, p)
        e = p.entries[0]
        s.on_result(StepResult(p.step_id, ["a"], [5], accepted={"a": accepted} if accepted else {},
                               drafts={"a": list(drafts)}, propose_cost=0.1, interval=0.003))
        return e

    assert step(drafts=[6, 7, 8]).propose == 3 and records == []  # only proposed: not judged
    assert step(accepted=[6, 7, 4], drafts=[]).drafts == 3 and records == [(1, 2, 0.1, 0.003, 1)]  # two kept
    step()  # checked nothing: its proposals did not come
    assert records[-1] == (1, 0, 0.1, 0.003, 1)
    step(drafts=[9])  # none came again
    assert records[-1] == (1, 0, 0.1, 0.003, 1) and len(records) == 3


def test_drafts_from_before_a_pause_in_speculation_are_never_checked():
    """Drafts follow the token they were proposed after: a step planned without speculation (the
    controller stopped it) moves the request on, so when speculation starts again they are gone."""
    s = make_scheduler()
    s.add(NewRequest("a", array("q", [1, 2, 3]), SamplingParams(seed=1, max_tokens=40)))
    p = s.schedule()
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [5], drafts={"a": [6, 7, 8]}))
    s.spec_control.active, s.spec_control.wait = False, 5  # stopped: the next step goes without drafts
    p = s.schedule()
    assert p.entries[0].drafts == 0 and p.entries[0].propose == 0
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [6]))
    s.spec_control.active = True  # started again: [6, 7, 8] followed 5, not 6
    p = s.schedule()
    assert p.entries[0].drafts == 0 and p.entries[0].num_tokens == 1 and p.entries[0].propose == 3


def test_a_probe_step_overlaps_and_its_proposals_only_decide():
    s = make_scheduler()
    s.spec_control.active, s.spec_control.wait = False, 0
    s.add(NewRequest("a", array("q", [1, 2]), SamplingParams(seed=1)))
    p = s.schedule()  # the probe
    assert p.entries[0].propose == 3 and s.spec_control.probe_step == p.step_id
    feedback(s, p)
    assert not s.must_wait()  # overlapped: the next step may go out with its token in flight
    s.on_result(StepResult(p.step_id, ["a"], [6], drafts={"a": [7, 8]}))
    assert s.spec_control.active and s.requests["a"].drafts is None  # found: speculation is on; drafts unused


def test_an_idle_engine_overlaps_its_steps_and_asks_for_nothing():
    s = make_scheduler()
    s.spec_control.active, s.spec_control.wait = False, 5
    s.add(NewRequest("a", array("q", [1, 2]), SamplingParams(seed=1)))
    p = s.schedule()
    assert p.entries[0].propose == 0
    feedback(s, p)
    assert not s.must_wait()
    s.spec_control.active = True  # starting again: the next step waits for the last token
    assert s.must_wait()


def test_drafts_never_pass_max_tokens_or_the_step_budget():
    s = make_scheduler(max_num_batched_tokens=3)
    s.add(NewRequest("a", array("q", [1, 2]), SamplingParams(seed=1, max_tokens=4)))
    p = s.schedule()
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [7], drafts={"a": [8, 9, 10]}))
    e = s.schedule().entries[0]
    assert e.drafts == 2 and e.num_tokens == 3  # the budget: 3 tokens
    s = make_scheduler()
    s.add(NewRequest("a", array("q", [1, 2]), SamplingParams(seed=1, max_tokens=3)))
    p = s.schedule()
    feedback(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [7], drafts={"a": [8, 9, 10]}))
    e = s.schedule().entries[0]
    assert e.drafts == 1 and e.propose == 0  # 2 tokens left: its own and one draft


def test_no_request_speculates_above_the_batch_limit_and_steps_overlap_again():
    s = make_scheduler(speculation=Speculation(num_tokens=3, max_batch=1))
    for r in "ab":
        s.add(NewRequest(r, array("q", [1, 2]), SamplingParams(seed=1)))
    p = s.schedule()
    assert all(e.propose == 0 for e in p.entries)
    feedback(s, p)
    assert not s.must_wait()


def test_requests_with_constraints_do_not_speculate():
    s = make_scheduler()
    s.add(NewRequest("a", array("q", [1, 2]), SamplingParams(seed=1, logprobs=2)))
    s.add(NewRequest("b", array("q", [1, 2]), SamplingParams(seed=1), prepared={"toy": object()}))
    p = s.schedule()
    assert [e.propose for e in p.entries] == [3, 0]


def test_the_kv_manager_never_hashes_drafts_and_drops_them_when_the_next_tokens_come():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    key = (0, 0.0, 0)
    kv.process(StepProposal(0, [ScheduledRequest("a", 3, array("q", [1, 2, 3]), key,
                                                 Admission(3, SamplingParams(), True))]))
    # token 4 and drafts 5 6 7: the first block is full of known tokens, the second holds drafts
    plan, fb = kv.process(StepProposal(1, [ScheduledRequest("a", 4, array("q", [4, 5, 6, 7]), key, drafts=3)]))
    assert plan.drafts == {"a": 3} and plan.sample.tolist() == [True] and fb.scheduled == {"a": (3, 4, True)}
    req = kv.requests["a"]
    assert len(req.block_hashes) == 1 and req.num_drafts == 3
    # 5 kept, then 8: 6 and 7 are taken back; 5 8 come as the next tokens
    plan, _ = kv.process(StepProposal(2, [ScheduledRequest("a", 1, array("q", [5, 8]), key, retract=2)]))
    assert req.token_ids.tolist() == [1, 2, 3, 4, 5, 8] and req.num_drafts == 0
    assert plan.context_lens.tolist() == [5] and plan.token_ids.tolist() == [8]
    # preempted with drafts in it: what it keeps is its known tokens
    kv.process(StepProposal(3, [ScheduledRequest("a", 3, array("q", [9, 9]), key, drafts=2)]))
    kv._preempt(kv.requests["a"], [])
    assert kv.parked["a"].tolist() == [1, 2, 3, 4, 5, 8]


# ---- the engine: outputs equal those without speculation -------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], list(range(20, 60)), [3] * 10, [44, 45, 46]]


def params_of(kind):
    return {
        "greedy": [SamplingParams(max_tokens=40, temperature=0)] * len(PROMPTS),
        "sampled": [SamplingParams(max_tokens=40, temperature=0.9, seed=i, top_k=50 if i % 2 else 0,
                                   top_p=0.9 if i == 2 else 1.0) for i in range(len(PROMPTS))],
        "penalties": [SamplingParams(max_tokens=30, temperature=0.8, seed=i, repetition_penalty=1.3,
                                     frequency_penalty=0.5, presence_penalty=0.2, min_tokens=20)
                      for i in range(len(PROMPTS))],
    }[kind]


def run(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[o.token_ids for o in r.outputs] for r in outs]


def reference_of(prompts, outputs):
    return {(tuple(p), tuple(o[:1])): o for p, outs in zip(prompts, outputs) for o in outs}


@pytest.mark.parametrize("kind", ["greedy", "sampled", "penalties"])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}, {"async_scheduling": False}],
                         ids=["default", "chunked", "sync"])
def test_outputs_with_speculation_are_the_plain_engines(checkpoint, oracle, kind, options):
    ck = checkpoint("llama")
    params = params_of(kind)
    with LLM(ck, **COMMON, **options) as llm:
        plain = run(llm, params)
    name = oracle(reference_of(PROMPTS, plain))
    with LLM(ck, **COMMON, **options, speculative_config={"method": name, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        assert run(llm, params) == plain
        spec = llm.engine.scheduler.spec
    assert spec.accepted_tokens > 0 and spec.accepted_tokens < spec.draft_tokens  # kept some, rejected some
    assert spec.accepted_per_pos[2] > 0  # whole runs kept


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_every_architecture_speculates_to_the_plain_engines_tokens(checkpoint, oracle, arch):
    ck = checkpoint(arch)
    params = params_of("greedy")[:2] + params_of("sampled")[2:]
    with LLM(ck, **COMMON) as llm:
        plain = run(llm, params)
    name = oracle(reference_of(PROMPTS, plain))
    with LLM(ck, **COMMON, speculative_config={"method": name, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        assert run(llm, params) == plain
        assert llm.engine.scheduler.spec.accepted_tokens > 0


def test_n_samples_stop_tokens_prefix_hits_and_preemption_with_speculation(checkpoint, oracle):
    ck = checkpoint("llama")
    prompts = PROMPTS + PROMPTS[:2]  # prefix hits
    params = [SamplingParams(n=3, max_tokens=30, temperature=0.8, seed=i, stop_token_ids=[7]) for i in range(len(prompts))]
    options = dict(num_blocks=24, block_size=4, max_model_len=80, reserve_growth=False)  # preempts
    with LLM(ck, **COMMON, **options) as llm:
        plain = run(llm, params, prompts)
        assert llm.engine.scheduler.num_preemptions > 0
    name = oracle(reference_of(prompts, plain), wrong=2)
    with LLM(ck, **COMMON, **options, speculative_config={"method": name, "num_speculative_tokens": 4}) as llm:
        hold_speculation_on(llm)
        assert run(llm, params, prompts) == plain
        assert llm.engine.scheduler.spec.accepted_tokens > 0
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks  # nothing leaked


def test_logprobs_of_speculated_tokens_are_the_plain_engines(checkpoint, oracle):
    ck = checkpoint("llama")
    params = [SamplingParams(max_tokens=30, temperature=0, logprobs=3),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, logprobs=0)] * 2
    with LLM(ck, **COMMON) as llm:
        plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    name = oracle(reference_of(PROMPTS, [[o.token_ids for o in r.outputs] for r in plain]))
    with LLM(ck, **COMMON, speculative_config={"method": name, "num_speculative_tokens": 4}) as llm:
        hold_speculation_on(llm)
        spec = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.engine.scheduler.spec.accepted_tokens > 0
    for a, b in zip(spec, plain):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert pa.keys() == pb.keys()
            assert all(pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4) and pa[t].rank == pb[t].rank for t in pa)


def test_stop_strings_cut_speculated_outputs_where_they_cut_plain_ones(checkpoint, oracle):
    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=40, temperature=0)
    with LLM(ck, **COMMON) as llm:
        full = run(llm, params)
        tok = llm.get_tokenizer()
        stops = [tok.decode(out[0][12:14]) for out in full]  # text in the middle of each output
        stopped = [SamplingParams(max_tokens=40, temperature=0, stop=[stop], logprobs=1) for stop in stops]
        plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], stopped, use_tqdm=False)
    name = oracle(reference_of(PROMPTS, full))
    with LLM(ck, **COMMON, speculative_config={"method": name, "num_speculative_tokens": 4}) as llm:
        hold_speculation_on(llm)
        spec = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], stopped, use_tqdm=False)
        assert llm.engine.scheduler.spec.accepted_tokens > 0
    assert [r.outputs[0].text for r in spec] == [r.outputs[0].text for r in plain]
    assert [r.outputs[0].token_ids for r in spec] == [r.outputs[0].token_ids for r in plain]
    assert all(r.outputs[0].finish_reason == "stop" for r in spec)
    for a, b in zip(spec, plain):  # the logprobs of tokens past the stop string are dropped with them
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


def test_greedy_ngram_speculation_matches_the_plain_engine(checkpoint):
    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        # prompts that hold text the output may repeat: a prompt, its own continuation, the prompt again
        prompts = [p + out[0][:40] + p for p, out in zip(PROMPTS, run(llm, params))]
        plain = run(llm, params, prompts)
    with LLM(ck, **COMMON, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        assert run(llm, params, prompts) == plain
        assert llm.engine.scheduler.spec.drafts > 0


def test_aborted_requests_with_drafts_leave_the_pool_full(checkpoint, oracle):
    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=40, temperature=0)
    with LLM(ck, **COMMON) as llm:
        plain = run(llm, params)
    name = oracle(reference_of(PROMPTS, plain))
    with LLM(ck, **COMMON, speculative_config={"method": name}) as llm:
        hold_speculation_on(llm)
        async def abort_some():
            async def one(i):
                outputs = 0
                async for _ in llm.engine.generate(PROMPTS[i % len(PROMPTS)], params):
                    outputs += 1
                    if outputs > i % 5:
                        break  # leaving the loop aborts the request
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
        llm._portal.call(abort_some)
        assert llm.engine.scheduler.spec.drafts > 0
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2), use_tqdm=False)  # frees the last
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_sampled_tokens_follow_the_plain_distribution(checkpoint, oracle):
    """Two-sample chi-square on the second token over different seeds: with speculation (drafts
    taken from other seeds' outputs, half of them changed) and without, on a vocabulary of 64."""
    ck = checkpoint("llama", vocab_size=64)
    prompts = [[5, 6, 7]] * 400
    sampled = lambda seeds: [SamplingParams(max_tokens=3, temperature=1.0, top_k=20, top_p=0.95, seed=s)  # noqa: E731
                             for s in seeds]
    with LLM(ck, **COMMON) as llm:
        plain = [o[0] for o in run(llm, sampled(range(400)), prompts)]
        plain_other = [o[0] for o in run(llm, sampled(range(1000, 1400)), prompts)]
    name = oracle(reference_of(prompts, [[o] for o in plain]), wrong=2)
    config = {"method": name, "num_speculative_tokens": 2, "disable_by_batch_size": 400}
    with LLM(ck, **COMMON, speculative_config=config) as llm:
        hold_speculation_on(llm)
        spec = [o[0] for o in run(llm, sampled(range(1000, 1400)), prompts)]
        assert llm.engine.scheduler.spec.drafts > 100
    assert spec == plain_other  # seeded draws are the plain engine's own
    counts = np.zeros((2, 64))
    for row, outs in enumerate((plain, spec)):
        for o in outs:
            counts[row, o[1]] += 1
    assert chi_square_pvalue(counts[:, counts.sum(0) > 0]) > 0.001


def chi_square_pvalue(counts: np.ndarray) -> float:
    """Pearson's test that the rows of a contingency table share one distribution."""
    expected = counts.sum(1, keepdims=True) * counts.sum(0, keepdims=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = (counts.shape[0] - 1) * (counts.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# ---- configuration -----------------------------------------------------------------------------

def test_speculative_config_is_vllms_and_is_validated(checkpoint):
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 5
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens must be in"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_max must be >= prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_max=1, prompt_lookup_min=2)
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="speculative.model must be unset without speculative.method"):
        EngineConfig.from_kwargs(speculative_config={"model": "small"})
    with pytest.raises(ValueError, match="speculative.model 'small' is not used by method 'ngram'"):
        LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "ngram", "model": "small"})
    with pytest.raises(ValueError, match="speculative.method 'nope' is not available; registered proposers: .*ngram"):
        LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "nope"})


def test_the_ngram_lookup_runs_default_and_are_refused_by_the_draft_method(checkpoint):
    """A setting the chosen method would ignore is an error naming it, never silently dropped."""
    def lookup(**kw) -> tuple[int, int]:
        proposer = NgramProposer(SpeculativeConfig(method="ngram", **kw))
        return proposer.n_max, proposer.n_min

    assert lookup() == (4, 1) and lookup(prompt_lookup_min=6) == (6, 6) and lookup(prompt_lookup_max=2) == (2, 1)
    with pytest.raises(ValueError, match=r"speculative.prompt_lookup_max must be >= prompt_lookup_min \(3\), got 2"):
        SpeculativeConfig(method="ngram", prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="speculative.prompt_lookup_min must be an integer >= 1, got 0"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=0)
    ck = checkpoint("llama")
    with pytest.raises(ValueError, match="speculative.prompt_lookup_max is not used by method 'draft'"):
        LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "prompt_lookup_max": 3})


def test_cli_takes_vllms_speculative_config_and_the_section_flags():
    config, _ = parse_serve(["builtin", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                             "--speculative-prompt-lookup-max", "2"])
    assert (config.speculative.method, config.speculative.num_speculative_tokens,
            config.speculative.prompt_lookup_max) == ("ngram", 3, 2)
    with pytest.raises(SystemExit):
        parse_serve(["builtin", "--speculative-config", "[1]"])


# ---- the server ----------------------------------------------------------------------------------

COPY_PROMPT = (Path(llmserve.__file__).parent / "builtin_model" / "heldout.txt").read_text()[:600]


def test_the_server_speculates_in_its_engine_process_and_reports_vllms_series():
    """The built-in model asked to go on with a text it was given twice: n-gram proposals are
    kept, the output is the plain engine's, and /metrics counts the drafts."""
    from servers import running_server

    prompt = COPY_PROMPT + "\n\n" + COPY_PROMPT[:300]
    with LLM("builtin", **COMMON) as llm:
        plain = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)[0].outputs[0].text
    with running_server(engine_process=True, speculative={"method": "ngram"}) as s:
        out = s.client().completions.create(model="llmserve-builtin", prompt=prompt, max_tokens=48, temperature=0)
        text = httpx.get(f"{s.url}/metrics").text
    assert out.choices[0].text == plain
    counts = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("llmserve_spec_decode") and "{" in line and "position" not in line}
    assert counts["llmserve_spec_decode_num_accepted_tokens_total"] > 0
    assert counts["llmserve_spec_decode_num_draft_tokens_total"] >= counts["llmserve_spec_decode_num_accepted_tokens_total"]
    assert 'llmserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="llmserve-builtin",position="0"}' in text


def test_a_failing_or_out_of_vocabulary_proposer_costs_no_request(checkpoint):
    class Bad:
        calls = 0

        def propose(self, req_ids, sequences, limits):
            Bad.calls += 1
            if Bad.calls % 2:
                raise RuntimeError("proposer bug")
            return [[1, 10 ** 6, 2]] * len(sequences)  # from the second draft on: not a token

    pm, plugin = get_plugin_manager(), Register("bad", lambda config, context: Bad())
    pm.register(plugin, name="bad")
    try:
        params = SamplingParams(max_tokens=20, temperature=0)
        with LLM(checkpoint("llama"), **COMMON) as llm:
            plain = run(llm, params)
        with LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "bad"}) as llm:
            hold_speculation_on(llm)
            assert run(llm, params) == plain
            assert llm.engine.scheduler.spec.draft_tokens == llm.engine.scheduler.spec.drafts > 0  # one draft each
    finally:
        pm.unregister(plugin)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_proposer_that_reads_hidden_states_gets_the_models_own_at_every_position(checkpoint, graphs):
    """Proposer.observe: with chunked prompts and drafts checked, kept and rejected, the rows a
    proposer was handed for each position, the last time a step computed it, are transformers'
    final hidden states (after the last norm) of the finished sequence there. graphs: the steps
    through their CUDA graphs' padded buffers (emulated)."""
    from conftest import OracleProposer
    from transformers import AutoModelForCausalLM

    ck = checkpoint("llama")
    prompts = [list(range(20, 60)), [5, 6, 7, 8, 9, 10, 5, 6, 7]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        plain = run(llm, params, prompts)
    seen: dict[tuple[str, int], torch.Tensor] = {}

    class Watcher(OracleProposer):
        def observe(self, req_ids, starts, query_start_loc, hidden):
            for i, req_id in enumerate(req_ids):
                for j, row in enumerate(range(query_start_loc[i], query_start_loc[i + 1])):
                    seen[req_id, int(starts[i]) + j] = hidden[row].clone()

    pm = get_plugin_manager()
    plugin = Register("watcher", lambda config, context: Watcher(reference_of(prompts, plain)))
    pm.register(plugin, name="watcher")
    try:
        with LLM(ck, **COMMON, max_num_batched_tokens=16,  # the 40-token prompt in chunks
                 speculative_config={"method": "watcher", "num_speculative_tokens": 3}) as llm:
            hold_speculation_on(llm)
            if graphs:
                llm.engine.runner.capture_graphs(llm.config.scheduler.max_num_seqs, 16, emulate=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            spec = llm.engine.scheduler.spec
    finally:
        pm.unregister(plugin)
    assert [[o.token_ids for o in r.outputs] for r in outs] == plain
    assert 0 < spec.accepted_tokens < spec.draft_tokens  # drafts kept, and rejected
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    for r, prompt in zip(outs, prompts):
        sequence = prompt + list(r.outputs[0].token_ids)
        with torch.no_grad():  # every position but the last token's, which no step computed
            expected = model.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
        got = torch.stack([seen[r.request_id, p] for p in range(len(sequence) - 1)])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_proposer_that_fails_to_observe_leaves_the_outputs_alone(checkpoint):
    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        plain = run(llm, params)

    class Broken:
        def propose(self, req_ids, sequences, limits):
            return [[] for _ in req_ids]

        def observe(self, req_ids, starts, query_start_loc, hidden):
            raise RuntimeError("a head that cannot read them")

    pm, plugin = get_plugin_manager(), Register("broken", lambda config, context: Broken())
    pm.register(plugin, name="broken")
    try:
        with LLM(ck, **COMMON, speculative_config={"method": "broken"}) as llm:
            assert run(llm, params) == plain
    finally:
        pm.unregister(plugin)


# ---- the draft-model proposer ----------------------------------------------------------------------

@pytest.mark.parametrize("graphs", [False, True])
def test_a_draft_model_that_is_the_model_itself_has_every_greedy_draft_kept(checkpoint, graphs):
    """graphs: the engine's steps and the draft's passes through their CUDA graphs' padded buffers
    (emulated: the same buffers run eagerly)."""
    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        plain = run(llm, params)
    config = {"method": "draft", "model": ck, "num_speculative_tokens": 4}
    with LLM(ck, **COMMON, speculative_config=config, max_num_batched_tokens=32) as llm:  # chunked prompts
        hold_speculation_on(llm)
        proposer = llm.engine.runner.proposer
        if graphs:
            llm.engine.runner.capture_graphs(llm.config.scheduler.max_num_seqs, 32, emulate=True)
            first, chained = record_calls(proposer.graphs, "_replay"), record_calls(proposer.chain, "_forward")
            target = llm.engine.runner.graphs
            steps = record_calls(target, "_replay")
        assert run(llm, params) == plain
        spec = llm.engine.scheduler.spec
    assert spec.drafts > 0 and spec.accepted_tokens == spec.draft_tokens  # its own argmax, every time
    assert proposer.cached == {} and proposer.pool.num_free == proposer.pool.num_blocks  # forgotten at the end
    if graphs:  # every chain padded to a captured batch size; in steady state (a catch-up of one or
        # two tokens a request) pass 0 and the chain as one (fused), a prompt's pass 0 a mixed step
        assert chained and {b for b, _ in chained} <= set(proposer.chain.sizes)
        assert {variant for _, variant in chained} == {"argmax", "fused"}  # greedy requests: argmaxes
        assert [v for _, v in chained].count("fused") > [v for _, v in chained].count("argmax")
        assert first and {kind for kind, _ in first} == {"mixed"}
        # the steps checking drafts (k + 1 = 5 tokens a request) through the verify graphs, at
        # captured sizes; the chunked prompts through the mixed ones
        verify = [b for kind, b in steps if kind == "verify"]
        assert verify and set(verify) <= set(target.verify_sizes)
        assert "mixed" in {kind for kind, _ in steps}


@pytest.mark.parametrize("graphs", [False, True])
def test_draft_proposals_are_the_draft_models_greedy_continuations(checkpoint, graphs):
    """Called directly, with the model itself as the draft: whatever its cache holds (nothing, the
    drafts it proposed, drafts the output then departs from), each request gets the next `limit`
    tokens of the plain greedy output, each request its own limit."""
    ck = checkpoint("llama")
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        plain = [outs[0] for outs in run(llm, greedy)]
    prompts = [array("q", p) for p in PROMPTS]
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "num_speculative_tokens": 4}) as llm:
        proposer = llm.engine.runner.proposer
        if graphs:
            llm.engine.runner.capture_graphs(llm.config.scheduler.max_num_seqs, 64, emulate=True)
            first, chained = record_calls(proposer.graphs, "_replay"), record_calls(proposer.chain, "_forward")
        ids = [f"r{i}" for i in range(len(prompts))]
        for done, limits in [(0, [4, 1, 3, 2]), (4, [4, 4, 4, 4]), (6, [2, 3, 0, 4]), (13, [1, 4, 4, 2]),
                             (20, [1, 1, 1, 1]), (21, [3, 3, 3, 3])]:
            got = proposer.propose(ids, [(p, out[:done]) for p, out in zip(prompts, plain)], limits)
            assert got == [out[done:done + k] for out, k in zip(plain, limits)], done
        # a request whose output departed from its drafts: its cache falls back to the common prefix
        wrong = [out[:24] + [(out[24] + 1) % 100] for out in plain]
        proposer.propose(ids, [(p, o) for p, o in zip(prompts, wrong)], [4] * 4)
        assert proposer.propose(ids, [(p, o[:25]) for p, o in zip(prompts, plain)], [4] * 4) == [o[25:29] for o in plain]
        proposer.forget(ids)
        assert proposer.pool.num_free == proposer.pool.num_blocks
        if graphs:  # the prompts' pass 0 a mixed step; the catch-ups of a few tokens fused with the chain
            assert {kind for kind, _ in first} == {"mixed"} and ("fused" in {v for _, v in chained})


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_small_draft_model_gives_the_plain_engines_tokens_with_preemption_and_n(checkpoint, temperature):
    ck, draft = checkpoint("llama"), checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, num_key_value_heads=1, seed=3)
    params = [SamplingParams(n=2, max_tokens=30, temperature=temperature, seed=i) for i in range(len(PROMPTS))]
    options = dict(num_blocks=20, block_size=4, max_model_len=80, reserve_growth=False)
    with LLM(ck, **COMMON, **options) as llm:
        plain = run(llm, params)
    with LLM(ck, **COMMON, **options, speculative_config={"method": "draft", "model": draft}) as llm:
        hold_speculation_on(llm)
        assert run(llm, params) == plain
        assert llm.engine.scheduler.spec.drafts > 0 and llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_a_draft_model_needs_a_checkpoint_of_the_same_vocabulary(checkpoint):
    with pytest.raises(ValueError, match="speculative.model must name the draft checkpoint"):
        LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "draft"})
    other = checkpoint("llama", vocab_size=500)
    with pytest.raises(ValueError, match="vocabulary of 500 tokens.*must share the model's tokenizer"):
        LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "draft", "model": other})


def test_a_proposer_that_costs_more_than_it_can_gain_stops_speculation_for_good():
    c = SpecControl(max_gain=4)
    for _ in range(40):
        c.record(4, 8, cost=0.1)  # two drafts kept a request, for a tenth of a step: it pays
    assert c.active
    c = SpecControl(max_gain=4)
    c.record(4, 8, cost=30.0)  # ... for thirty steps: it does not
    assert not c.active and c.cost == 30.0
    for _ in range(1000):
        c.planned()
    assert not c.probe_due  # never tried again


def test_a_proposer_that_costs_most_of_a_step_yet_keeps_enough_stays_on():
    """Nine tenths of a fast step for proposals that keep 2.7 drafts a step pays (up to 3.7 tokens
    for 1.9 steps): a spell is judged by its own steps, not a prior that such a cost would stop
    at the first one."""
    c = SpecControl(max_gain=4)
    for i in range(50):
        c.planned()
        c.record(1, 0 if i % 10 == 0 else 3, cost=0.9)  # a step that kept nothing among them
        assert c.active


def test_the_executor_reports_what_its_proposer_costs(checkpoint):
    class Slow:
        def propose(self, req_ids, sequences, limits):
            time.sleep(0.05)
            return [[] for _ in req_ids]

    pm, plugin = get_plugin_manager(), Register("slow", lambda config, context: Slow())
    pm.register(plugin, name="slow")
    try:
        with LLM(checkpoint("llama"), **COMMON, speculative_config={"method": "slow"}) as llm:
            run(llm, SamplingParams(max_tokens=20, temperature=0))
            control = llm.engine.scheduler.spec_control
            assert control.cost > 1 and not control.active  # a tiny model's step is far shorter than 50 ms
    finally:
        pm.unregister(plugin)


# ---- drafts drawn from a distribution ------------------------------------------------------------

def test_a_draft_drawn_from_q_is_kept_with_probability_min_1_p_over_q_and_tokens_follow_p():
    """check_drafts_reference on one position, 40,000 rows with their own streams: the tokens follow
    p (goodness of fit), and a draft d is kept (the row's token is d: a rejected d has p(d) < q(d),
    so the redraw from max(p - q, 0) is never d) with probability min(1, p(d) / q(d)), in all
    sum(min(p, q))."""
    from llmserve.kernels.sampling_reference import check_drafts_reference, row_keys, sample_rows_reference
    from llmserve.speculative import draft_keys

    rows, temperature = 40_000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.5])
    q_logits = torch.tensor([0.0, 2.0, 0.5, 1.0, -1.0, 0.0, -2.0, 1.5])  # a draft model that disagrees
    p = torch.softmax(logits / temperature, -1)
    q = torch.softmax(q_logits / temperature, -1)
    temps = torch.full((rows,), temperature)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919
    drafts = sample_rows_reference(q_logits.expand(rows, -1), temps,
                                   torch.from_numpy(np.concatenate([draft_keys(s, 3, 1) for s in seeds.tolist()])))
    keys = row_keys(seeds, torch.full((rows,), 3))
    tokens = check_drafts_reference(logits.expand(rows, -1), temps, keys, drafts, q.expand(rows, -1))
    observed = torch.bincount(tokens, minlength=8).double()
    expected = p.double() * rows
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert float(torch.special.gammaincc(torch.tensor(3.5, dtype=torch.float64), torch.tensor(stat / 2))) > 0.001
    kept = tokens == drafts
    assert abs(kept.double().mean().item() - float(torch.minimum(p, q).sum())) < 0.01
    for x in range(8):  # each draft token kept with probability min(1, p / q)
        if (drafts == x).sum() >= 500:
            assert abs(kept[drafts == x].double().mean().item() - min(1.0, float(p[x] / q[x]))) < 0.04, x


def sampled_runs(llm, n, prompts, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)  # unseeded: drafts drawn
    return [o[0] for o in run(llm, [params] * n, prompts)]


def test_unseeded_samples_with_drawn_drafts_follow_the_plain_distribution(checkpoint):
    """A draft model unlike the target (vocabulary of 64): unseeded requests at temperature 1 get
    drafts drawn from the draft's distribution, checked with min(1, p / q); the tokens after the
    first (where drafts are checked) follow the plain engine's distribution (chi-square per
    position), and more drafts are kept than the same draft's greedy choices keep."""
    ck = checkpoint("llama", vocab_size=64)
    draft = checkpoint("llama", vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1, seed=3)
    prompts = [[5, 6, 7]] * 600
    config = {"method": "draft", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 600}
    with LLM(ck, **COMMON) as llm:
        plain = sampled_runs(llm, 600, prompts)
    with LLM(ck, **COMMON, speculative_config=config) as llm:
        hold_speculation_on(llm)
        drawn = sampled_runs(llm, 600, prompts)
        spec = llm.engine.scheduler.spec
        kept_drawn = spec.accepted_tokens / spec.draft_tokens
    with LLM(ck, **COMMON, speculative_config=config) as llm:
        hold_speculation_on(llm)
        seeded = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i) for i in range(600)]
        run(llm, seeded, prompts)  # seeded: greedy drafts
        spec = llm.engine.scheduler.spec
        kept_greedy = spec.accepted_tokens / spec.draft_tokens
    assert drawn != plain and spec.drafts > 100
    for position in (1, 2, 3):
        counts = np.zeros((2, 64))
        for row, outs in enumerate((plain, drawn)):
            for o in outs:
                counts[row, o[position]] += 1
        assert chi_square_pvalue(counts[:, counts.sum(0) > 0]) > 0.001, position
    assert kept_drawn > kept_greedy + 0.05


@pytest.mark.parametrize("graphs", [False, True])
def test_drawn_drafts_from_the_model_itself_are_all_kept(checkpoint, graphs):
    """With the model itself as the draft, q is p: a drawn draft is kept with probability 1 (a
    greedy draft only with p of the argmax), through the draft's graphs too (emulated)."""
    ck = checkpoint("llama")
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        proposer = llm.engine.runner.proposer
        if graphs:
            llm.engine.runner.capture_graphs(llm.config.scheduler.max_num_seqs, 64, emulate=True)
        chained = record_calls(proposer.chain, "_forward")
        sampled_runs(llm, 4, PROMPTS, max_tokens=30)
        spec = llm.engine.scheduler.spec
    assert spec.drafts > 20 and spec.accepted_tokens >= 0.99 * spec.draft_tokens
    assert chained and all(sampled for _, sampled in chained)


def test_drafts_drawn_in_one_replay_with_the_catch_up_pass_are_those_drawn_apart(checkpoint):
    """A distinct draft model, emulated graphs, a catch-up of a few tokens a request: pass 0 fused
    with the chain ("fused_draw") draws the same drafts from the same distributions, stream for
    stream, as pass 0 and the chain run apart, rows at temperature 0 taking the argmax in both."""
    ck, draft = checkpoint("llama"), checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, num_key_value_heads=1, seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(ck, **COMMON) as llm:
        outs = [o[0] for o in run(llm, greedy)]
    prompts, ids = [array("q", p) for p in PROMPTS], [f"r{i}" for i in range(len(PROMPTS))]
    temps, limits = [0.8, 0.0, 1.3, 0.5], [4, 3, 4, 2]
    rng = np.random.default_rng(0)
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": draft, "num_speculative_tokens": 4}) as llm:
        proposer = llm.engine.runner.proposer
        llm.engine.runner.capture_graphs(llm.config.scheduler.max_num_seqs, 64, emulate=True)
        chained = record_calls(proposer.chain, "_forward")
        keys = lambda: [rng.integers(0, 1 << 40, 4) if t > 0 else None for t in temps]  # noqa: E731
        proposer.propose_sampled(ids, [(p, o[:2]) for p, o in zip(prompts, outs)], limits, temps, keys())  # prompts
        for done in (4, 7):  # catch-ups of 2 and 3 tokens
            seqs, streams = [(p, o[:done]) for p, o in zip(prompts, outs)], keys()
            chained.clear()
            fused, fused_q = proposer.propose_sampled(ids, seqs, limits, temps, streams)
            assert [v for _, v in chained] == ["fused_draw"]
            first, proposer.chain.first = proposer.chain.first, None  # pass 0 and the chain apart
            apart, apart_q = proposer.propose_sampled(ids, seqs, limits, temps, streams)
            proposer.chain.first = first
            assert [v for _, v in chained][1:] == ["draw"]
            assert fused == apart and [len(d) for d in fused] == limits
            for t, a, b in zip(temps, fused_q, apart_q):
                assert (a is None) == (b is None) == (t == 0)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- structured outputs ---------------------------------------------------------------------------

STRUCTURED_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "b": {"enum": ["x", "yy", "zzz"]}, "c": {"type": "boolean"},
                                                      "d": {"type": "string", "maxLength": 12}},
                     "required": ["a", "b", "c", "d"], "additionalProperties": False}


def structured_params(jump_forward: bool) -> list[SamplingParams]:
    from llmserve import StructuredOutputsParams
    kinds = [{"json": STRUCTURED_SCHEMA}, {"regex": r"[a-z]{3,8}( [0-9]{2}){2,4}"}, {"json": STRUCTURED_SCHEMA}]
    return [SamplingParams(max_tokens=60, temperature=0.0 if i < 2 else 0.9, seed=i,
                           structured_outputs=StructuredOutputsParams(**kind, jump_forward=jump_forward))
            for i, kind in enumerate(kinds)]


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_requests_speculate_and_keep_no_draft_their_grammar_rejects(checkpoint, jump_forward):
    """The model itself as the draft proposes its unconstrained continuations, which the grammar
    rejects here and there: each checked position is masked as the grammar stands after the drafts
    before it, so the outputs (greedy, and seeded sampling) are the plain constrained engine's,
    with jump-forward too, and valid; some drafts are kept, some are not."""
    import json

    import jsonschema

    ck = checkpoint("llama")
    prompts = [[5, 6, 7], [20, 21, 22, 23], [44, 45]]
    params = structured_params(jump_forward)
    with LLM(ck, **COMMON) as llm:
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    config = {"method": "draft", "model": ck, "num_speculative_tokens": 3}
    with LLM(ck, **COMMON, speculative_config=config) as llm:
        hold_speculation_on(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        spec = llm.engine.scheduler.spec
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), STRUCTURED_SCHEMA)
    assert spec.drafts > 5 and 0 < spec.accepted_tokens < spec.draft_tokens


def test_constrained_unseeded_samples_check_drawn_drafts_against_their_grammar(checkpoint):
    """Drafts drawn from the (unconstrained) draft model's distribution, checked with min(1, p / q)
    where p is the constrained one: a draft the grammar rejects has p = 0 and is never kept, and
    every output validates."""
    import json

    import jsonschema

    from llmserve import StructuredOutputsParams

    ck = checkpoint("llama")
    params = SamplingParams(max_tokens=60, temperature=0.9, structured_outputs=StructuredOutputsParams(json=STRUCTURED_SCHEMA))
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(6)], params, use_tqdm=False)
        spec = llm.engine.scheduler.spec
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), STRUCTURED_SCHEMA)
    assert spec.drafts > 5 and 0 < spec.accepted_tokens < spec.draft_tokens


def test_a_grammar_that_dies_midway_fails_its_speculating_request_as_its_own_fault(checkpoint, monkeypatch):
    """After six letters the grammar admits nothing: the verify step's row there allows no token,
    and the request fails with NoTokenAllowed (a 400 over HTTP) naming the field, as in a step
    without drafts; its neighbour is served."""
    from llmserve import StructuredOutputsParams
    from llmserve.decoding import NoTokenAllowed
    from llmserve.model.sampling_state import MaskFill

    found = []
    empty_rows = MaskFill.empty_rows
    monkeypatch.setattr(MaskFill, "empty_rows", lambda self: found.append(empty_rows(self)) or found[-1])
    ck = checkpoint("llama")
    grammar = "root ::= " + " ".join(["[a-z]"] * 6) + " dead\ndead ::= dead"
    dead = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=grammar, jump_forward=False))
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        with pytest.raises(NoTokenAllowed, match="structured_outputs: no token may come next: structured_outputs "
                                                 "excludes every token"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, dead, use_tqdm=False)
        assert any(found), found  # it failed in a verify step
        assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8),
                                use_tqdm=False)[0].outputs[0].token_ids) == 8
