import random

import pytest
from conftest import train_tokenizer

from llmserve.detokenizer import Detokenizer, rust_tokenizer


class _Windowed:
    """A tokenizer with no Rust backend in reach: the detokenizer falls back to decoding windows."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.fixture(params=["streamed", "windowed"])
def tok(request, tmp_path):
    fast = train_tokenizer(str(tmp_path))
    assert rust_tokenizer(fast) is not None
    if request.param == "windowed":
        wrapped = _Windowed(fast)
        wrapped.encode = fast.encode
        return wrapped
    return fast


def test_incremental_text_equals_full_decode_with_multibyte(tok):
    text = "Café 日本語 🚀 over the lazy dog."
    ids = tok.encode(text)
    d = Detokenizer(tok, [], True, [], False)
    pieces = []
    for t in ids:
        before = d.text
        d.add([t])
        pieces.append(d.text[len(before):])
        assert "\ufffd" not in d.text  # never a broken character mid-stream
    assert d.text == text == "".join(pieces)
    # Some character really was split across tokens, so the hold-back was exercised.
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)


def test_stop_string_spanning_tokens_is_cut(tok):
    prompt = tok.encode("Once upon")
    ids = tok.encode(" a time there was a small model")
    d = Detokenizer(tok, prompt, True, ["re was"], False)
    found = None
    for t in ids:
        found = d.add([t])
        if found:
            break
    assert found == "re was" and d.text == " a time the"
    assert len(tok.decode([ids[0]])) < len("re was")  # the stop string needed several tokens


def test_stop_strings_match_literally_earliest_first_then_in_list_order(tok):
    d = Detokenizer(tok, [], True, ["x(", "a.b", "b"], True)
    assert d.add(tok.encode("aXb then a.b")) == "b" and d.text == "aXb"  # "." is no wildcard; "b" comes first
    d = Detokenizer(tok, [], True, ["cd", "c"], False)
    assert d.add(tok.encode("abcd")) == "cd" and d.text == "ab"  # at one position, the first listed wins
    d = Detokenizer(tok, [], True, ["(", "\\"], False)
    assert d.add(tok.encode("a\\b(")) == "\\" and d.text == "a"


def test_visible_text_holds_back_possible_stop_prefix(tok):
    d = Detokenizer(tok, [], True, ["STOP"], True)
    d.add(tok.encode("abc ST"))
    assert d.visible_text(False) == "abc" and d.visible_text(True) == "abc ST"
    assert d.add(tok.encode("OP tail")) == "STOP" and d.text == "abc STOP"


def _metaspace_tokenizer():
    """SentencePiece-style (Llama 2, Mistral): '▁' marks a word's leading space, which decoding a
    sequence strips from its first token; unknown bytes fall back to <0xXX> tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(["hello world over the lazy dog, the quick brown fox"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_equals_windowed_on_random_ids(kind, tmp_path):
    """Random output ids (as random weights sample them: broken characters, special tokens, ids past
    the tokenizer's vocabulary) after a text prompt or random prompt ids give the same text both
    ways, and the same text as decoding prompt + output and cutting the prompt's text off; the
    final call flushes a held-back broken character as U+FFFD. A final-only sequence (no stop
    strings), decoded once at its end, gets the same text."""
    fast = train_tokenizer(str(tmp_path)) if kind == "byte-level" else _metaspace_tokenizer()
    rng = random.Random(0)
    vocab = len(fast)
    saw_flush = False
    for _ in range(40):
        prompt = (fast.encode(rng.choice(["", "Once upon", "the lazy dog", "Café 日本"])) if rng.random() < 0.5
                  else [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))])  # may end mid-character
        out = [rng.randrange(vocab + 5) for _ in range(rng.randrange(1, 40))]
        streamed = Detokenizer(fast, prompt, True, [], False)
        windowed = Detokenizer(_Windowed(fast), prompt, True, [], False)
        deferred = Detokenizer(fast, prompt, True, [], False, final_only=True)
        i = 0
        while i < len(out):
            k = rng.randrange(1, 4)
            final = i + k >= len(out)
            streamed.add(out[i:i + k], final=final)
            windowed.add(out[i:i + k], final=final)
            deferred.add(out[i:i + k], final=final)
            i += k
        assert streamed.text == windowed.text == deferred.text
        context = prompt[-5:]
        whole = fast.decode(context + out, skip_special_tokens=True)
        assert streamed.text == whole[len(fast.decode(context, skip_special_tokens=True)):]
        saw_flush |= streamed.text.endswith("\ufffd")
    assert saw_flush or kind == "metaspace"  # byte fallback decodes a broken character at once


def test_final_only_text_is_decoded_once_at_the_end_or_when_shown(tok):
    """A final-only sequence decodes nothing per step; its text appears with the final tokens, or
    when shown before them (an abort ends it early). With stop strings, or without a fast
    tokenizer, it detokenizes as it goes."""
    d = Detokenizer(tok, tok.encode("Once"), True, [], False, final_only=True)
    d.add(tok.encode(" upon a"))
    assert d.text == ("" if rust_tokenizer(tok) is not None else " upon a")
    assert d.visible_text(True) == " upon a"
    d.add(tok.encode(" time"), final=True)
    assert d.text == " upon a time"
    stops = Detokenizer(tok, [], True, ["time"], False, final_only=True)
    assert stops.add(tok.encode("upon a time")) == "time" and stops.text == "upon a "
