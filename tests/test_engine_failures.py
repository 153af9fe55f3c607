"""A step that fails: run again in halves until the requests that fail it alone are found, which end
with their error while the others get the tokens a run without them gives; the engine keeps serving."""

import anyio
import pytest

def run_together(llm, prompts, params) -> list:
    """Submit the requests in one message (so they share their steps); each one's output token
    ids, or the exception it ended with."""
    from llmserve.actors.request_actor import OutputSlot, Submit

    async def main():
        subs = [Submit(f"r{i}", p, sp, OutputSlot()) for i, (p, sp) in enumerate(zip(prompts, params))]
        await llm.engine.submit(subs)
        results: list = [None] * len(subs)

        async def read(i):
            try:
                async for out in llm.engine.outputs(subs[i]):
                    results[i] = out.outputs[0].token_ids
            except Exception as exc:
                results[i] = exc
        async with anyio.create_task_group() as tg:
            for i in range(len(subs)):
                tg.start_soon(read, i)
        return results
    return llm._portal.call(main)


def fail_on_third_call(monkeypatch, obj, name: str) -> list:
    """obj.name raises once, on its third call; returns the list its calls are counted in."""
    original, calls = getattr(obj, name), []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return original(*args)
    monkeypatch.setattr(obj, name, flaky)
    return calls


def test_a_step_that_fails_once_is_run_again_and_gives_the_same_tokens(checkpoint, monkeypatch):
    from llmserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=5)
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0) as llm:
        expected = llm.generate(["the quick brown"], params, use_tqdm=False)[0].outputs[0].token_ids
        calls = fail_on_third_call(monkeypatch, llm.engine.runner, "_forward")
        again = llm.generate(["the quick brown"], params, use_tqdm=False)[0].outputs[0]
        assert len(calls) > 8 and again.token_ids == expected and again.finish_reason == "length"


def test_a_failing_finish_fails_its_requests_and_the_engine_keeps_serving(checkpoint, monkeypatch):
    from llmserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0) as llm:
        fail_on_third_call(monkeypatch, llm.engine.runner, "_finish")
        with pytest.raises(RuntimeError, match="the engine failed this request: RuntimeError: device fell over"):
            llm.generate(["the quick brown"], params, use_tqdm=False)
        again = llm.generate(["the quick brown"], params, use_tqdm=False)[0].outputs[0]
        assert again.finish_reason == "length" and len(again.token_ids) == 8
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_that_fails_its_steps_fails_alone(checkpoint, monkeypatch, async_scheduling):
    """A request whose sampling raises (seed 13 here) is found by running its step again in halves:
    it ends with the error, the others of its steps get exactly the tokens of a run without it."""
    from llmserve import LLM, SamplingParams
    prompts = [[5 + i, 17, 33, 2 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=i) for i in range(6)]
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0, async_scheduling=async_scheduling) as llm:
        expected = run_together(llm, prompts, params)
        sampling = llm.engine.runner.sampling
        original = sampling.batch

        def poisoned(states, vocab, drafts=None):
            if any(s.params.seed == 13 for s in states):
                raise IndexError("sampler index out of range")
            return original(states, vocab, drafts)

        monkeypatch.setattr(sampling, "batch", poisoned)
        bad = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=13)
        got = run_together(llm, prompts[:3] + [[9, 9, 9]] + prompts[3:], params[:3] + [bad] + params[3:])
        assert isinstance(got[3], RuntimeError) and "IndexError: sampler index out of range" in str(got[3])
        assert got[:3] + got[4:] == expected
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks
