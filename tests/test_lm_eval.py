"""lm-evaluation-harness's `local-completions` model against the server, where lm_eval installs: a
small local multiple-choice task, the tokenizer found from what /v1/models reports (`root`), every
loglikelihood equal to transformers' own to four decimals."""

import json

import httpx
import pytest
import torch

from servers import MODEL, running_server

ITEMS = [{"question": "The list type is", "choices": [" mutable", " a number", " blue"], "answer": 0},
         {"question": "A dictionary maps", "choices": [" keys to values", " rivers", " nothing"], "answer": 0},
         {"question": "To open a file, call", "choices": [" open()", " the police", " 42"], "answer": 0}]


def test_lm_eval_scores_a_local_task_as_transformers_does(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tiny.yaml").write_text(
        "task: llmserve_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    with running_server() as server:
        root = httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"]
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["llmserve_tiny"], task_manager=TaskManager(include_path=str(tmp_path)),
            model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={root},"
                       "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", log_samples=True)
    tokenizer = AutoTokenizer.from_pretrained(root)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    samples = results["samples"]["llmserve_tiny"]
    assert len(samples) == len(ITEMS)
    for sample in samples:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            start = len(tokenizer(context, add_special_tokens=False).input_ids)
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            expected = sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
    assert 0 <= results["results"]["llmserve_tiny"]["acc,none"] <= 1
