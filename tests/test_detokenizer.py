from conftest import train_tokenizer

from llmserve.detokenizer import Detokenizer


def test_incremental_text_equals_full_decode_with_multibyte(tmp_path):
    tok = train_tokenizer(str(tmp_path))
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


def test_stop_string_spanning_tokens_is_cut(tmp_path):
    tok = train_tokenizer(str(tmp_path))
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


def test_visible_text_holds_back_possible_stop_prefix(tmp_path):
    tok = train_tokenizer(str(tmp_path))
    d = Detokenizer(tok, [], True, ["STOP"], True)
    d.add(tok.encode("abc ST"))
    assert d.visible_text(False) == "abc" and d.visible_text(True) == "abc ST"
    assert d.add(tok.encode("OP tail")) == "STOP" and d.text == "abc STOP"
