"""The engine's host time per step, on any machine: what a step costs the CPU when the device's work
takes no time.

    python scripts/host_bench.py [--batch 1,16,64,256] [--steps 300] [--runs 3] [--shared-prefix 0]
                                 [--constrained] [--vocab V] [--json out.json]

A tiny model on the CPU backend, its forward pass, lm_head and sampler replaced by constants
(random token ids), so a step's wall time is the Python around them: the scheduler, the KV
manager, the executor's inputs and results, the request actor's detokenizing and publishing, and
the hand-offs between them. On the GPU this work runs beside the device's; once it takes longer
than a step's device time, it sets the pace (large batches of small models, cascade attention,
constrained decoding, a speculating engine waiting for its last step). B requests of 100 random
prompt tokens (after a shared prefix of --shared-prefix tokens, one of 8, as W-prefix has; cascade
attention as --cascade-attention says, whose groups the CPU's cost model never picks) each generate
--steps tokens at temperature 0.6, ignore_eos; the fastest of --runs generate calls
counts, ms per step = its wall time / --steps.

--constrained: every request's output constrained to the inside of a JSON string (structured
outputs, the regex structured_bench.py's tpot mode uses), so a step also fills each row's mask,
accepts each row's token and checks it for a jump-forward; the fake sampler picks a random token
each row's mask allows. --vocab V: a synthetic tokenizer of V tokens (151936: the masks of W-small's
vocabulary, 19 KB a row), the model's logits never touched (what the device would do with them
is not the host's work).
"""

import argparse
import random
import tempfile
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.report import report
from llmserve.bench.workloads import JSON_STRING_REGEX, synthetic_tokenizer
from llmserve.kernels.token_mask import unpack_mask
from llmserve.model import runner
from llmserve.model.llama import LlamaForCausalLM
from llmserve.plugins.cpu import CPUBackend
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.testing import make_checkpoint

HIDDEN = 64


def no_device_work(vocab: int, specials: list[int], max_rows: int) -> None:
    """The model's forward pass returns zeros, its logits one zero tensor nobody writes, the sampler
    random ids other than the tokenizer's specials (the end of sequence among them), within each
    masked row's mask."""
    zeros = torch.zeros(max_rows, vocab)
    in_pool = torch.ones(vocab, dtype=torch.bool)
    in_pool[specials] = False
    pool = in_pool.nonzero().flatten()
    masks = {}

    def process_logits(logits, batch, mask_fn):
        masks["allowed"] = batch.allowed  # (rows, packed masks) or None: for the sampler below
        return logits

    def sample_rows(self, logits, temperature, key):
        tokens = pool[torch.randint(len(pool), (logits.shape[0],))]
        allowed = masks.pop("allowed", None)
        if allowed is not None:
            rows, packed = allowed
            tokens[rows] = _allowed_tokens(packed, pool, in_pool)
        return tokens

    LlamaForCausalLM.forward = lambda self, ids, positions, meta: torch.zeros(ids.shape[0], HIDDEN)
    LlamaForCausalLM.compute_logits = lambda self, hidden: zeros[:hidden.shape[0]]
    runner.process_logits = process_logits
    CPUBackend.sample_rows = sample_rows


SAMPLER_SHARE = 0.05
"""The part of a step's device time its sampler takes (the rest: its forward pass)."""


class _Device:
    """A device that works through what it is given in order: each piece starts at the later of
    its launch and the end of the piece before."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def launch(self, seconds: float) -> "_Ready":
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return _Ready(self.free_at)


class _Ready:
    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))  # (the interpreter lock released, as CUDA's wait does)

    def query(self) -> bool:
        return time.perf_counter() >= self.at


def with_device_time(step_s: float) -> None:
    """Each launched step takes a simulated device `step_s`: its forward pass from when it is
    queued, its sampler (SAMPLER_SHARE of it) from when that is queued, after the forward pass; its
    tokens are ready then. A constrained step's masks are filled while its forward pass runs, and
    its sampler waits for them, as on a GPU."""
    device, forward, queue = _Device(), runner.ModelRunner._forward, runner.ModelRunner._queue

    def timed_forward(self, *args, **kwargs):
        queued = forward(self, *args, **kwargs)
        device.launch(step_s * (1 - SAMPLER_SHARE))
        return queued

    def timed_queue(self, sampling):
        flight = queue(self, sampling)
        flight.ready = device.launch(step_s * SAMPLER_SHARE)
        return flight

    runner.ModelRunner._forward = timed_forward
    runner.ModelRunner._queue = timed_queue


def _allowed_tokens(packed: torch.Tensor, pool: torch.Tensor, in_pool: torch.Tensor, tries: int = 64) -> torch.Tensor:
    """One random token of `pool` (in_pool: bool [V], its members) per packed mask row that the row
    allows: `tries` at once, and a row that allows few (the output's opening `{"text": "`) from
    its unpacked bits."""
    # (index_select: indexing with 16k ids takes ~8 ms on the CPU, longer than the step it fakes)
    picks = pool.index_select(0, torch.randint(len(pool), (packed.shape[0] * tries,))).view(-1, tries)
    ok = (packed.gather(1, picks // 32) >> (picks % 32)) & 1
    tokens = picks.gather(1, ok.argmax(1, keepdim=True)).squeeze(1)
    few = (~ok.any(1)).nonzero().flatten()
    if len(few):  # (these rows' grammars stand at the same place: one unpacking each distinct mask)
        distinct, which = packed[few].unique(dim=0, return_inverse=True)
        for i, allowed in enumerate(unpack_mask(distinct, len(in_pool)) & in_pool):
            ids, rows = allowed.nonzero().flatten(), few[which == i]
            tokens[rows] = ids[torch.randint(len(ids), (len(rows),))]
    return tokens


def checkpoint(path: str, vocab: int | None) -> None:
    """The tiny model, with a synthetic tokenizer of `vocab` tokens in place of the trained one."""
    if vocab is None:
        make_checkpoint(path, "llama", hidden_size=HIDDEN, num_hidden_layers=1, max_position_embeddings=8192)
        return
    from transformers import PreTrainedTokenizerFast

    make_checkpoint(path, "llama", hidden_size=HIDDEN, num_hidden_layers=1, max_position_embeddings=8192,
                    vocab_size=vocab, eos_token_id=vocab - 1, bos_token_id=vocab - 2, pad_token_id=vocab - 2)
    tok = synthetic_tokenizer(vocab, {vocab - 2: "<|bos|>", vocab - 1: "<|eos|>"})
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", bos_token="<|bos|>").save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--cascade-attention", default="auto", choices=["auto", "always", "never"])
    ap.add_argument("--constrained", action="store_true")
    ap.add_argument("--no-jump", action="store_true", help="constrained: jump-forward off (json_object's default)")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="a simulated device's time a step (its forward pass from its launch, its sampler from "
                         "its queueing): ms a step beyond it is host time the device waits for")
    ap.add_argument("--sync", action="store_true", help="async scheduling off: each step planned once the one before is back")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(tmp, args.vocab)
        # Its launches compute nothing (no_device_work): the executor runs them as a GPU engine's,
        # on the event loop. (Read as the engine starts, so set before it.)
        runner.ModelRunner.launches_async = property(lambda self: True)
        llm = LLM(tmp, dtype="float32", max_model_len=8192, max_num_seqs=max(batches), cpu_kv_cache_gib=1.0,
                  cascade_attention=args.cascade_attention, log_interval_s=0,
                  async_scheduling=not args.sync)
        vocab = llm.engine.spec.vocab_size
        specials = llm.get_tokenizer().all_special_ids
        no_device_work(vocab, specials, max(batches))
        if args.device_ms:
            with_device_time(args.device_ms / 1e3)
        rng = random.Random(0)
        prefixes = [[rng.randrange(3, vocab) for _ in range(args.shared_prefix)] for _ in range(8)]
        # (constrained: the end of sequence is allowed, but the fake sampler never picks a special)
        params = SamplingParams(max_tokens=args.steps, ignore_eos=not args.constrained, temperature=0.6, seed=1,
                                structured_outputs=StructuredOutputsParams(regex=JSON_STRING_REGEX, jump_forward=not args.no_jump)
                                if args.constrained else None)
        for b in batches:
            prompts = [{"prompt_token_ids": prefixes[i % 8] + [rng.randrange(3, vocab) for _ in range(100)]}
                       for i in range(b)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the prefixes cached)
            walls = []
            for _ in range(args.runs):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
            best = min(walls)
            rows.append({"batch": b, "steps": args.steps, "shared_prefix": args.shared_prefix,
                         "constrained": args.constrained, "vocab": vocab,
                         "device_ms": args.device_ms, "sync": args.sync,
                         "ms_per_step": 1e3 * best / args.steps, "us_per_request_step": 1e6 * best / args.steps / b,
                         "walls_s": walls})
            print(f"batch {b}: {rows[-1]['ms_per_step']:.3f} ms a step, "
                  f"{rows[-1]['us_per_request_step']:.1f} us a request-step", flush=True)
        llm.shutdown()
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
