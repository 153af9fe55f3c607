"""vLLM's allowed_token_ids and bad_words (the built-in decoding strategy `token_masks`), offline
and over HTTP."""

import httpx
import pytest

from llmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        yield llm


def contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_ones_sampled(llm, temperature):
    allowed = [7, 42, 99, 250, 383]
    outs = llm.generate(["the quick brown"] * 4, [SamplingParams(temperature=temperature, seed=s, max_tokens=24,
                                                                 ignore_eos=True, allowed_token_ids=allowed)
                                                  for s in range(4)], use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) and len(o.outputs[0].token_ids) == 24 for o in outs)


def test_a_bad_word_never_appears_even_when_pushed(llm):
    """A two-token word whose tokens a bias makes nearly the only ones drawn: unbanned, the pair
    follows each other within a few draws; banned, its last token never follows its first (and a
    one-token word never appears at all)."""
    tok = llm.get_tokenizer()
    word, seq = next((w, tuple(ids)) for w in ("paged", "blocks", "values", "tokens", "decode", "step")
                     if len(ids := tok.encode(w, add_special_tokens=False)) == 2 and ids[0] != ids[1])
    single = tok.encode(" the", add_special_tokens=False)
    assert len(single) == 1
    bias = {seq[0]: 30.0, seq[1]: 30.0, single[0]: 30.0}

    def run(**banned) -> list[list[int]]:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True, logit_bias=bias, **banned)
                  for s in range(6)]
        return [o.outputs[0].token_ids for o in llm.generate(["continuous"] * 6, params, use_tqdm=False)]

    assert any(contains(ids, seq) for ids in run())
    for ids in run(bad_words=[word, "the"]):
        assert not contains(ids, seq) and single[0] not in ids and len(ids) == 30


@pytest.mark.parametrize("kwargs, match", [
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids must be a non-empty list"),
    ({"bad_words": ["", "x"]}, "bad_words must be a list of non-empty strings"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_an_allowed_id_past_the_vocabulary_fails_its_request_alone(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids must be < vocab size 384, got \[384\]"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[5, 384]), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_allowed_ids_that_all_end_the_request_under_min_tokens_are_refused(llm):
    """min_tokens holds back the tokens that end a request; if those are all allowed_token_ids
    allows, nothing could be drawn: the request is refused, naming the field."""
    eos = llm.engine.spec.eos_token_ids[0]
    with pytest.raises(ValueError, match=r"allowed_token_ids: with min_tokens 3, allow a token that does not end"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[eos], min_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match=r"allowed_token_ids: with min_tokens 2"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[9], stop_token_ids=[9], min_tokens=2), use_tqdm=False)
    out = llm.generate(["x"], SamplingParams(allowed_token_ids=[eos, 9], min_tokens=3, max_tokens=5, seed=0),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out[:3] == [9, 9, 9] and set(out) <= {eos, 9}


def test_over_http_the_fields_constrain_and_bad_values_are_400s(checkpoint):
    from servers import running_server
    with running_server(model=checkpoint("llama")) as s:
        body = {"prompt": "the quick", "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                "allowed_token_ids": [7, 42], "logprobs": 0}
        r = httpx.post(f"{s.url}/v1/completions", json=body).json()
        pieces = {httpx.post(f"{s.url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (7, 42)}
        tokens = r["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 12 and set(tokens) <= pieces
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "allowed_token_ids": [10 ** 6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "bad_words": "the"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
