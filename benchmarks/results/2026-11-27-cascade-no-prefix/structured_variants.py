"""Experiment (not committed): constrained TPOT at batch 256 under host-side variants, one call."""
import json, sys, tempfile, time
sys.path.insert(0, "scripts")
import torch
from structured_bench import timed, tpot_at_batch, decode_launch, TPOT_MIN_BATCH
from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.bench.workloads import JSON_STRING_REGEX, w_small
from llmserve.model import sampling_state

def set_fill_gil(release):
    import xgrammar as xgr
    for m in type(xgr.BatchGrammarMatcher()._handle).__tvm_ffi_type_info__.methods:
        if m.name == "batch_fill_next_token_bitmask":
            m.func.release_gil = release

orig_masks = sampling_state.SamplingState.masks
def inline_masks(self, states, vocab, *, background=False, drafts=None):
    return orig_masks(self, states, vocab, background=False, drafts=drafts)

def variant(name, on):
    if name == "gil": set_fill_gil(not on)
    if name == "inline": sampling_state.SamplingState.masks = inline_masks if on else orig_masks
    if name == "switch1ms": sys.setswitchinterval(0.001 if on else 0.005)
    if name == "gil+inline": variant("gil", on); variant("inline", on)

w = w_small()
out = {}
with tempfile.TemporaryDirectory() as tmp:
    d = w.write_model_dir(tmp); w.write_tokenizer(d)
    with LLM(d, load_format="dummy", log_interval_s=0) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        cons = [SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, seed=i,
                               structured_outputs=StructuredOutputsParams(regex=JSON_STRING_REGEX)) for i, p in enumerate(w.params)]
        def run(label, params):
            wall, outs, records, cpu = timed(llm, w.prompts, params)
            r = {"wall_s": wall, **tpot_at_batch(records, TPOT_MIN_BATCH), **decode_launch(records, TPOT_MIN_BATCH)}
            out.setdefault(label, []).append(r); print(label, json.dumps(r), flush=True)
        run("plain", w.params)
        for rnd in range(2):
            for name in ("base", "gil", "inline", "gil+inline", "switch1ms"):
                variant(name, True)
                try:
                    run("json_string:" + name, cons)
                finally:
                    variant(name, False)
            run("plain", w.params)
json.dump(out, open(sys.argv[1], "w"), indent=1)
