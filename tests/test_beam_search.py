"""Beam search offline (`LLM.beam_search`): the beams transformers' own beam search returns, and
beams sharing their prompt's KV blocks."""

import pytest
import torch

from llmserve import LLM, BeamSearchParams

PROMPTS = [[5, 17, 33, 40], [7, 8, 9], [100, 3, 60, 61, 62, 63, 64, 65]]


def hf_beams(path: str, prompt: list[int], width: int, max_tokens: int, eos: list[int],
             length_penalty: float = 1.0) -> list[list[int]]:
    """transformers' beam search: the generated tokens of its `width` beams, best first, each up to
    and with its end-of-sequence token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=width,
                           max_new_tokens=max_tokens, do_sample=False, early_stopping=False,
                           length_penalty=length_penalty, eos_token_id=eos, pad_token_id=model.config.pad_token_id)
    beams = []
    for row in y[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        beams.append(row if end is None else row[:end + 1])
    return beams


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_beam_search_returns_transformers_beams(checkpoint, arch):
    path = checkpoint(arch)
    with LLM(path, dtype="float32", device="cpu", log_interval_s=0) as llm:
        eos = sorted(llm.engine.scheduler.eos_token_ids)
        got = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=3, max_tokens=8))
    for prompt, out in zip(PROMPTS, got):
        assert [s.tokens[:len(prompt)] for s in out.sequences] == [prompt] * 3
        assert [s.tokens[len(prompt):] for s in out.sequences] == hf_beams(path, prompt, 3, 8, eos)
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_that_end_early_are_ranked_as_transformers_ranks_them(checkpoint, length_penalty):
    """The end-of-sequence id made a token the beams often take: beams end at different lengths
    and are ranked by their length-penalised scores, finished ones kept while they can still win
    (without a length penalty the short ones win: some returned beams end there)."""
    from collections import Counter

    plain = checkpoint("llama")
    taken = Counter(t for p in PROMPTS for beam in hf_beams(plain, p, 4, 10, [0]) for t in beam[1:4])
    frequent = taken.most_common(1)[0][0]
    path = checkpoint("llama", eos_token_id=frequent)  # the same weights: only the end id differs
    with LLM(path, dtype="float32", device="cpu", log_interval_s=0) as llm:
        eos = sorted(llm.engine.scheduler.eos_token_ids)
        assert frequent in eos
        got = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=length_penalty))
    ended = 0
    for prompt, out in zip(PROMPTS, got):
        beams = [s.tokens[len(prompt):] for s in out.sequences]
        assert beams == hf_beams(path, prompt, 4, 10, eos, length_penalty)
        ended += sum(s.finish_reason == "stop" for s in out.sequences)
        assert all((s.finish_reason == "stop") == (s.tokens[-1] in eos) for s in out.sequences)
    assert ended >= 1 or length_penalty > 0


def test_beams_share_their_prompts_kv_blocks(checkpoint):
    """Each step's beams are requests on the prompt and their common prefix: the prefix cache gives
    them its full blocks, so the pool holds fewer blocks than beams × blocks a beam."""
    prompt, width, max_tokens = list(range(3, 43)), 4, 8
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        pool, peak = llm.engine.kv.pool, [0]
        for name in ("allocate", "touch"):
            original = getattr(pool, name)

            def counted(*args, original=original):
                out = original(*args)
                peak[0] = max(peak[0], pool.num_blocks - pool.num_free)
                return out
            setattr(pool, name, counted)
        out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
        block = llm.config.cache.block_size
        assert len(out[0].sequences) == width
        assert peak[0] < width * -(-(len(prompt) + max_tokens) // block)
        assert pool.num_free == pool.num_blocks  # every block back


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, length_penalty=10.5), r"length_penalty.*\[-10, 10\]"),
])
def test_beam_search_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_a_beam_longer_than_the_model_allows_is_refused(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0, max_model_len=32) as llm:
        with pytest.raises(ValueError, match="exceed max_model_len 32"):
            llm.beam_search({"prompt_token_ids": list(range(3, 23))}, BeamSearchParams(beam_width=2, max_tokens=20))
        text = llm.beam_search("the quick brown", BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
        assert len(text) == 2 and all(isinstance(s.text, str) for s in text)


@pytest.mark.parametrize("engine_process", [False, True])
def test_beam_search_over_http_gives_the_offline_beams(engine_process):
    """vLLM's use_beam_search (n beams, length_penalty) on completions and chat: the choices are
    the offline search's beams; what beam search cannot honour is a 400 naming the field."""
    import httpx
    from servers import MODEL, running_server

    with LLM("builtin", dtype="float32", device="cpu", log_interval_s=0) as llm:
        offline = llm.beam_search("The list type", BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
        expected = [s.text for s in offline[0].sequences]
    with running_server(engine_process, max_waiting_requests=3) as server:  # beams leave the queue: no 503
        client = server.client()
        out = client.completions.create(model=MODEL, prompt="The list type", max_tokens=6, n=3,
                                        extra_body={"use_beam_search": True, "length_penalty": 0.5})
        assert [c.text for c in out.choices] == expected and [c.index for c in out.choices] == [0, 1, 2]
        same = client.completions.create(model=MODEL, prompt="The list type", max_tokens=6, n=3, temperature=0, top_p=1,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                     "stop_token_ids": []})
        assert [c.text for c in same.choices] == expected  # fields sent at their defaults ask for nothing
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A dict is"}],
                                              max_tokens=5, n=2, temperature=0, extra_body={"use_beam_search": True})
        assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
        assert chat.choices[0].message.content != chat.choices[1].message.content
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "use_beam_search": True}
        for extra, param in (({"stream": True}, "stream"), ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n"),
                             ({"temperature": 0.7}, "temperature"), ({"logprobs": 2}, "logprobs"),
                             ({"length_penalty": 1e308}, "length_penalty"), ({"length_penalty": -11}, "length_penalty")):
            r = httpx.post(f"{server.url}/v1/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "length_penalty": 2.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
