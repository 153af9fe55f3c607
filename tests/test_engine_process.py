"""The device side in a child process (server.engine_process): same tokens as in-process, under both
asyncio and trio; start-up errors come back as the same errors; a dead child stops the frontend."""

import dataclasses
import os
import pickle
import signal
import struct
import time

import anyio
import pytest

from llmserve import EngineConfig, SamplingParams
from llmserve.engine import Engine
from llmserve.engine_process import EngineProcessError, ProcessEngine, Wire
from llmserve.messages import EngineOutputs, SequenceUpdate, TokenLogprobs

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def config(model: str, **kw) -> EngineConfig:
    args = dict(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=128, log_interval_s=0)
    return EngineConfig.from_kwargs(model=model, **{**args, **kw})


async def texts(engine, prompts, params):
    outs = {}

    async def one(i):
        async for out in engine.generate(prompts[i], params):
            outs[i] = out

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [outs[i].outputs[0].token_ids for i in range(len(prompts))]


async def run_both(cfg, prompts, params):
    results = []
    for engine in (Engine(cfg), ProcessEngine(cfg)):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            results.append(await texts(engine, prompts, params))
            engine.stop()
    return results


def edit_json(path, **fields):
    import json
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


async def test_the_tokenizers_end_of_sequence_ends_requests_in_either_engine(checkpoint, tmp_path):
    """A checkpoint whose config files name no end-of-sequence id: the tokenizer's still ends a
    request, after min_tokens held it back, in the engine process too (which loads no tokenizer:
    the server sends it the id)."""
    import json
    import shutil
    model = shutil.copytree(checkpoint("llama"), tmp_path / "model")
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    edit_json(model / "config.json", eos_token_id=None)
    edit_json(model / "generation_config.json", eos_token_id=None)
    params = SamplingParams(max_tokens=10, min_tokens=3, logit_bias={eos: 100.0})
    for tokens in await run_both(config(str(model)), [[5, 6, 7]], params):
        assert len(tokens[0]) == 4 and tokens[0][-1] == eos and eos not in tokens[0][:3]


async def test_generation_configs_end_of_sequence_ids_end_requests(checkpoint, tmp_path):
    """generation_config.json may list end-of-sequence ids that config.json and the tokenizer do
    not (an instruct model's turn end): they end requests too, as transformers' generate stops."""
    import shutil
    model = shutil.copytree(checkpoint("llama"), tmp_path / "model")
    turn_end = 7
    edit_json(model / "generation_config.json", eos_token_id=[2, turn_end])
    params = SamplingParams(max_tokens=10, logit_bias={turn_end: 100.0})
    for tokens in await run_both(config(str(model)), [[5, 6, 7]], params):
        assert tokens[0] == [turn_end]
    ignoring = SamplingParams(max_tokens=5, logit_bias={turn_end: 100.0}, ignore_eos=True)
    assert (await run_both(config(str(model)), [[5, 6, 7]], ignoring))[0][0] == [turn_end] * 5


async def test_same_tokens_as_in_process_and_counters_arrive(checkpoint):
    cfg = config(checkpoint("llama"))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 50))]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    in_process, child = await run_both(cfg, prompts, params)
    assert child == in_process and all(len(t) == 12 for t in child)

    engine = ProcessEngine(cfg)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        assert engine.device == "cpu" and engine.kv_tokens == 64 * 4
        await texts(engine, prompts, params)
        with anyio.fail_after(5):  # freed blocks reach the server between steps too
            while engine.snapshot().kv_usage or engine.snapshot().running:
                await anyio.sleep(0.01)
        snap = engine.snapshot()
        assert snap.generation_tokens == 36 and snap.prompt_tokens == sum(map(len, prompts))
        pid = engine.pid
        engine.stop()
    assert not engine.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child exited and was reaped


async def test_structured_outputs_cross_to_the_child_as_files_written_once(checkpoint):
    """A compiled grammar crosses the process boundary as files (the tokenizer's and the grammar's);
    the child's outputs are the in-process engine's (jump-forward included: the child encodes with
    the tokenizer it loads), and a schema sent again writes nothing new."""
    import json
    import os

    from llmserve import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "w": {"enum": ["up", "down"]}}, "required": ["n", "w"]}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(json=schema))
    cfg = config(checkpoint("llama"))
    prompts = [[5, 6, 7], [8, 9]]
    in_process, child = await run_both(cfg, prompts, params)
    assert child == in_process
    engine = ProcessEngine(cfg)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        outs = [await collect_text(engine, p, params) for p in prompts * 2]
        folder = engine.strategies["structured_outputs"]._files._dir
        assert sorted(os.listdir(folder)) and len(os.listdir(folder)) == 2  # one tokenizer, one grammar
        assert engine.snapshot().jumped_tokens > 0  # the child loaded the tokenizer to jump forward with
        engine.stop()
    assert all(set(json.loads(text)) == {"n", "w"} for text in outs)


async def test_a_waiting_requests_grammar_file_stays_until_it_runs(checkpoint):
    """The child starts a request's constraint from its grammar file when the request first runs:
    with more distinct grammars sent meanwhile than the folder keeps, each waiting request's file
    stays (its request holds it), and every request follows its regex."""
    import re

    from llmserve import StructuredOutputsParams

    regexes = [f"{w}[a-z]{{1,4}}( [0-9]{{1,2}}){{1,2}}" for w in ("ab", "cd", "ef", "gh", "ij", "kl")]
    engine = ProcessEngine(config(checkpoint("llama"), max_num_seqs=1))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        engine.strategies["structured_outputs"]._files.max_grammars = 1
        outs = {}

        async def one(i):
            params = SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                    structured_outputs=StructuredOutputsParams(regex=regexes[i]))
            async for out in engine.generate([5, 6, 7 + i], params):
                outs[i] = out.outputs[0]

        async with anyio.create_task_group() as requests:
            for i in range(len(regexes)):
                requests.start_soon(one, i)
        engine.stop()
    for i, out in outs.items():
        assert out.finish_reason in ("stop", "length") and (out.finish_reason == "length" or re.fullmatch(regexes[i], out.text))
    assert len(outs) == len(regexes)


async def collect_text(engine, prompt, params):
    async for out in engine.generate(prompt, params):
        last = out
    return last.outputs[0].text


async def test_abort_in_the_child_frees_blocks(checkpoint):
    engine = ProcessEngine(config(checkpoint("llama")))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                break  # leaving the loop aborts
        with anyio.fail_after(5):
            while engine.snapshot().kv_usage or engine.snapshot().running:
                await anyio.sleep(0.01)
        assert engine.snapshot().generation_tokens < 100
        engine.stop()


async def test_start_up_error_is_raised_by_run(checkpoint):
    engine = ProcessEngine(config(checkpoint("llama"), num_blocks=4))  # 128 positions need 32 blocks
    with pytest.raises(ValueError, match="max_model_len 128 needs 32 KV blocks"):
        await engine.run()
    assert not engine.running


@pytest.mark.parametrize("after_s", [0.2, 3.0])  # the child importing, then building its engine
async def test_a_start_up_cancelled_ends_the_child_at_once(checkpoint, after_s):
    """A signal during start-up cancels run: the child, still importing or building its engine
    (it reads its socket only once that is done), is ended then and there, not waited for."""
    engine = ProcessEngine(config(checkpoint("llama")))
    start = time.monotonic()
    with anyio.move_on_after(after_s):
        await engine.run()
    assert time.monotonic() - start < after_s + 5  # (it waited 30 s for the child, then killed it)
    assert engine.pid is not None and not engine.running
    with pytest.raises(ProcessLookupError):
        os.kill(engine.pid, 0)


async def test_a_dead_child_stops_the_frontend(checkpoint):
    engine = ProcessEngine(config(checkpoint("llama")))
    with pytest.raises(BaseExceptionGroup) as info:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            os.kill(engine.pid, signal.SIGKILL)
            await anyio.sleep(30)
    leaf = info.value
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, EngineProcessError) and "exit code -9" in str(leaf)


def test_sequence_updates_survive_the_wire():
    values = dict(req_id="r", new_token_ids=[1, 2], finish_reason="stop", stop_reason="\n",
                  logprobs=[TokenLogprobs(1, -0.5, 1, [1], [-0.5])], prompt_logprobs=[TokenLogprobs(2, -1.0, 2, [], [])],
                  num_cached_tokens=16, queue_time_s=0.25, error="boom")
    assert set(values) == {f.name for f in dataclasses.fields(SequenceUpdate)}  # every field set, none default
    up = SequenceUpdate(**values)
    assert pickle.loads(pickle.dumps(EngineOutputs([up]))) == EngineOutputs([up])


async def test_wire_takes_every_frame_that_arrived_and_reassembles_split_ones():
    class Chunks:  # a byte stream that hands out scripted chunks
        def __init__(self):
            self.chunks = []

        async def send(self, data):
            self.chunks.append(data)

        async def receive(self, max_bytes=65536):
            if not self.chunks:
                raise anyio.EndOfStream
            return self.chunks.pop(0)

    sent = Chunks()
    writer = Wire(sent)
    for obj in ["a", {"b": [1, 2]}, list(range(5000)), None]:
        await writer.send(obj)
    frames = b"".join(sent.chunks)
    mid = sum(map(len, sent.chunks[:2])) + len(sent.chunks[2]) // 2  # inside the 5000-int list's frame
    stream = Chunks()
    stream.chunks = [frames[:3], frames[3:mid], frames[mid:]]  # a header split, then a frame split
    reader = Wire(stream)
    assert await reader.receive() == "a"
    assert await reader.receive_all() == [{"b": [1, 2]}]
    assert await reader.receive_all() == [list(range(5000)), None]  # both complete in the last chunk
    with pytest.raises(EOFError):
        await reader.receive_all()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_wait_cancelled_as_its_bytes_arrive_leaves_the_loop_no_failing_callback(anyio_backend):
    """The server stops its reader as the engine's outputs arrive: the selector has queued the
    reader's wake-up in the loop turn where the reader is cancelled. (anyio's UNIX socket stream
    then failed in that wake-up: an InvalidStateError traceback in the log.) The bytes stay for
    the next receive."""
    import asyncio
    import socket

    from llmserve.engine_process import SocketBytes

    errors, loop = [], asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: errors.append(context))
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    frame = pickle.dumps("late", protocol=pickle.HIGHEST_PROTOCOL)
    async with SocketBytes(ours) as stream:
        wire = Wire(stream)
        for send in (False, True):  # a wait for the socket to be readable, then for it to be writable
            reader = anyio.CancelScope()

            async def waiting():
                with reader:
                    if send:
                        while True:  # until the socket's buffer is full
                            await wire.send(b"x" * (1 << 16))
                    await wire.receive()

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting)
                await anyio.sleep(0.05)  # it waits for the socket now
                if send:
                    theirs.setblocking(False)
                    while True:  # drain: the socket becomes writable
                        try:
                            theirs.recv(1 << 20)
                        except BlockingIOError:
                            break
                else:
                    theirs.sendall(struct.pack("!Q", len(frame)) + frame)
                await asyncio.sleep(0)  # the selector has seen it: the waiter's wake-up is queued behind this task
                reader.cancel()
            await anyio.sleep(0.05)
            assert reader.cancelled_caught and errors == []
        theirs.setblocking(True)
        assert await wire.receive() == "late"
    loop.set_exception_handler(None)
    theirs.close()
    with pytest.raises(anyio.ClosedResourceError):  # as anyio's streams say it
        await stream.receive()
