import numpy as np

from llmserve.core.scheduler import RequestStatus, Scheduler
from llmserve.messages import NewRequest, StepFeedback, StepPlan, StepResult
from llmserve.sampling_params import SamplingParams


def make_scheduler(**kw):
    args = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, eos_token_ids=frozenset({0}))
    args.update(kw)
    return Scheduler(**args)


def add(s, req_id, n_prompt, arrival, priority=0, **params):
    s.add(NewRequest(req_id, list(range(1, n_prompt + 1)), SamplingParams(seed=1, **params), priority, arrival))


def accept_all(s, proposal):
    """Feedback as if the KV manager fitted every entry without cache hits."""
    sched = {}
    for e in proposal.entries:
        req = s.requests[e.req_id]
        before = req.num_computed
        sched[e.req_id] = (before, e.num_tokens, before + e.num_tokens == req.num_tokens + req.pending)
    s.on_feedback(StepFeedback(proposal.step_id, sched, [], [], {}, 0.0, 0, 0))


def test_budget_mixes_decodes_and_prefill_chunks():
    s = make_scheduler(max_num_batched_tokens=10)
    add(s, "a", 6, 0.0)
    add(s, "b", 20, 1.0)
    p = s.schedule()
    assert [(e.req_id, e.num_tokens) for e in p.entries] == [("a", 6), ("b", 4)]
    accept_all(s, p)
    out = s.on_result(StepResult(p.step_id, ["a"], [7]))
    assert out.updates[0].new_token_ids == [7]
    p = s.schedule()
    # a decodes one token; b continues its prefill with the rest of the budget.
    assert [(e.req_id, e.num_tokens, list(e.new_token_ids)) for e in p.entries] == [("a", 1, [7]), ("b", 9, [])]


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 2, float(i))
    p = s.schedule()
    assert [e.req_id for e in p.entries] == ["r0", "r1"]


def test_priority_policy_orders_by_priority_then_arrival():
    s = make_scheduler(policy="priority", max_num_batched_tokens=4)
    add(s, "late-urgent", 2, 1.0, priority=-1)
    add(s, "early", 2, 0.0, priority=0)
    add(s, "later", 2, 2.0, priority=0)
    assert [e.req_id for e in s.schedule().entries] == ["late-urgent", "early"]


def test_new_requests_past_the_spent_budget_are_tentative_once_the_cache_hits():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    add(s, "warm", 8, 0.0)
    p = s.schedule()
    s.on_feedback(StepFeedback(p.step_id, {"warm": (4, 4, True)}, [], [], {"warm": 4}, 0.0, 0, 0))  # 4 were cached
    for i in range(4):
        add(s, f"r{i}", 8, float(i + 1))
    p = s.schedule()
    assert [(e.req_id, e.num_tokens, e.tentative) for e in p.entries] == \
        [("warm", 1, False), ("r0", 8, False), ("r1", 1, False), ("r2", 8, True)]  # four seats
    assert p.token_budget == 10


def test_without_cache_hits_nothing_is_tentative():
    s = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        add(s, f"r{i}", 8, float(i))
    assert [e.req_id for e in s.schedule().entries] == ["r0", "r1"]


def test_fcfs_ignores_priority():
    s = make_scheduler(max_num_batched_tokens=4)
    add(s, "a", 2, 1.0, priority=-5)
    add(s, "b", 2, 0.0, priority=0)
    assert [e.req_id for e in s.schedule().entries] == ["b", "a"]


def test_stop_conditions():
    s = make_scheduler()
    add(s, "eos", 2, 0.0, max_tokens=10)
    add(s, "len", 2, 1.0, max_tokens=1)
    add(s, "stoptok", 2, 2.0, stop_token_ids=[9])
    add(s, "min", 2, 3.0, min_tokens=2)
    p = s.schedule()
    accept_all(s, p)
    out = s.on_result(StepResult(p.step_id, ["eos", "len", "stoptok", "min"], [0, 5, 9, 0]))
    got = {u.req_id: (u.finish_reason, u.stop_reason) for u in out.updates}
    assert got == {"eos": ("stop", None), "len": ("length", None), "stoptok": ("stop", 9), "min": (None, None)}
    assert list(s.requests) == ["min"]
    assert s.schedule().freed == ["eos", "len", "stoptok"]


def test_preempted_request_requeues_and_sends_no_token_twice():
    """The KV manager keeps a preempted request's tokens: re-admitted, it computes all four again,
    and is sent only what was sampled since its last proposal (nothing here)."""
    s = make_scheduler()
    add(s, "a", 3, 0.0)
    p = s.schedule()
    accept_all(s, p)
    s.on_result(StepResult(p.step_id, ["a"], [42]))
    p = s.schedule()
    s.on_feedback(StepFeedback(p.step_id, {}, ["a"], [], {}, 1.0, 0, 0))
    assert s.requests["a"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    p = s.schedule()
    [e] = p.entries
    assert e.admitted is not None and list(e.new_token_ids) == [] and e.num_tokens == 4


def test_abort_removes_request_and_frees_next_step():
    s = make_scheduler()
    add(s, "a", 3, 0.0)
    p = s.schedule()
    accept_all(s, p)
    s.finish(["a"])
    assert not s.running and s.schedule().freed == ["a"]
    # A result for the aborted request is discarded.
    assert s.on_result(StepResult(p.step_id, ["a"], [5])).updates == []


def test_async_scheduling_plans_on_placeholders_and_stops_at_max_tokens():
    s = make_scheduler()
    add(s, "a", 3, 0.0, max_tokens=3)
    p0 = s.schedule()
    accept_all(s, p0)  # step 0 in flight: its token is pending
    p1 = s.schedule()
    assert [(e.req_id, e.num_tokens, list(e.new_token_ids)) for e in p1.entries] == [("a", 1, [-1])]
    accept_all(s, p1)
    assert s.requests["a"].pending == 2
    s.on_result(StepResult(p0.step_id, ["a"], [10]))  # token 1 of 3 arrives
    p2 = s.schedule()
    assert [(e.req_id, list(e.new_token_ids)) for e in p2.entries] == [("a", [10, -1])]
    accept_all(s, p2)
    s.on_result(StepResult(p1.step_id, ["a"], [11]))
    assert s.schedule().entries == []  # the token in flight is the third and last: nothing to plan
    out = s.on_result(StepResult(p2.step_id, ["a"], [12]))
    assert out.updates[0].finish_reason == "length" and s.requests == {}


def test_a_failed_request_is_ended_and_reported_even_if_never_taken_in():
    s = make_scheduler()
    add(s, "a", 3, 0.0)
    out = s.fail({"a": "boom", "ghost": "lost"})
    assert [(u.req_id, u.finish_reason, u.error) for u in out.updates] == [("a", "abort", "boom"),
                                                                          ("ghost", "abort", "lost")]
    assert not s.waiting and s.schedule().freed == ["a"]


def test_a_step_plan_subset_keeps_each_requests_rows():
    plan = StepPlan(7, ["a", "b", "c"], np.array([1, 2, 3, 4, 5, 6], dtype=np.int64),
                    np.array([2, 1, 3], dtype=np.int32), np.array([0, 5, 9], dtype=np.int32),
                    np.array([[1, 0], [2, 3], [4, 5]], dtype=np.int32), np.array([True, False, True]),
                    freed=["z"])
    part = plan.subset(np.array([0, 2]))
    assert part.req_ids == ["a", "c"] and part.token_ids.tolist() == [1, 2, 4, 5, 6]
    assert part.query_lens.tolist() == [2, 3] and part.context_lens.tolist() == [0, 9]
    assert part.block_tables.tolist() == [[1, 0], [4, 5]] and part.sample.tolist() == [True, True]
    assert part.freed == ["z"] and part.step_id == 7


def test_a_request_arriving_while_a_step_that_only_frees_is_planned_gets_scheduled():
    """A request ended by its stop string leaves a step that only frees its blocks; a request
    arriving before that step's feedback must not be taken for nothing to do (it hung forever)."""
    import anyio

    from llmserve.actors.scheduler_actor import EngineStats, SchedulerActor
    from llmserve.messages import FinishInFlight, FinishRequests, NewRequests

    def new(req_id):
        return NewRequests([NewRequest(req_id, list(range(1, 4)), SamplingParams(seed=1), 0, 0.0)])

    async def main():
        inbox_send, inbox = anyio.create_memory_object_stream(100)
        kv_send, kv = anyio.create_memory_object_stream(100)
        out_send, _out = anyio.create_memory_object_stream(100)
        actor = SchedulerActor(make_scheduler(), EngineStats(0), inbox=inbox, to_kv=kv_send, to_requests=out_send,
                               async_scheduling=False)
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            await inbox_send.send(new("a"))
            p0 = await kv.receive()
            await inbox_send.send(StepFeedback(p0.step_id, {"a": (0, 3, True)}, [], [], {}, 0.0, 0, 0))
            assert isinstance(await kv.receive(), FinishInFlight)
            await inbox_send.send(FinishRequests(["a"], "stop"))  # its stop string, found by the request actor
            await inbox_send.send(StepResult(p0.step_id, ["a"], [5]))
            p1 = await kv.receive()
            assert p1.entries == [] and p1.freed == ["a"]
            await inbox_send.send(new("b"))  # arrives before p1's feedback
            await inbox_send.send(StepFeedback(p1.step_id, {}, [], [], {}, 0.0, 0, 0))
            assert isinstance(await kv.receive(), FinishInFlight)
            await inbox_send.send(StepResult(p1.step_id, [], []))
            with anyio.fail_after(5):
                p2 = await kv.receive()
            assert [e.req_id for e in p2.entries] == ["b"]
            tg.cancel_scope.cancel()
    anyio.run(main)
