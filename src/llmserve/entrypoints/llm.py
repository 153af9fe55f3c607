"""Offline batch inference: `LLM(model=...).generate(prompts, params)`.

Runs the same engine and actors as the server, on an event loop in a background thread.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
from anyio.from_thread import start_blocking_portal
from tqdm import tqdm

from llmserve.actors.request_actor import OutputSlot, Submit
from llmserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from llmserve.config import EngineConfig
from llmserve.engine import Engine, EngineFailed
from llmserve.logging import configure_logging
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]


class LLM:
    """An engine for offline use.

    LLM(model="/path/to/checkpoint", dtype="float32", max_model_len=2048, ...) takes any field of
    the config sections by name; or pass config=EngineConfig(...).
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        configure_logging()
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.config = config
        self.engine = Engine(config)
        portal_cm = start_blocking_portal("asyncio")
        self._portal = portal_cm.__enter__()
        run_future, _ = self._portal.start_task(self.engine.run)
        # Stops the engine on shutdown(), when the LLM is collected, or at interpreter exit, whichever
        # comes first: at exit while the loop's (daemon) thread still runs; a __del__ would run later,
        # during finalization, and wait forever on a loop thread the interpreter has frozen.
        self._finalizer = weakref.finalize(self, _stop, self.engine, self._portal, portal_cm, run_future)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no sampling_params: the checkpoint's
        generation_config.json values (model.generation_config = "auto"), SamplingParams' own otherwise."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string, or {"prompt_token_ids": [...]}) and return the
        finished outputs in prompt order. A ValueError for one bad prompt aborts the batch."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        items = [_prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(items)
        if len(sampling_params) != len(items):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(items)} prompts")
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority: got {len(priority)} values for {len(items)} prompts")
        start = self._counter
        self._counter += len(items)
        return self._portal.call(self._run_batch, items, list(sampling_params), list(priority or [0] * len(items)),
                                 start, use_tqdm)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's offline chat: one conversation (a list of {"role", "content", ...} messages) or a
        list of them, each rendered with the tokenizer's chat template (or `chat_template`, Jinja
        text), `tools` and `chat_template_kwargs` reaching the template as in transformers'
        apply_chat_template, then generated as generate() does (the rendered text is tokenized
        without special tokens: the template writes its own). The outputs in conversation order."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False (the last message is "
                             "continued, no new one begins)")
        single = bool(messages) and isinstance(messages[0], dict)
        prompts = []
        for conversation in ([messages] if single else messages):
            text = tokenizer.apply_chat_template(list(conversation), tools=tools, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=False,
                                                 **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: for each prompt (as generate() takes them) the best
        `params.beam_width` beams, best first, chosen as transformers' beam search chooses them
        (llmserve/beam_search.py); beams share their prompt's and common prefix's KV blocks through
        the prefix cache."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenizer = self.get_tokenizer()
        ids = []
        for p in map(_prompt, prompts):
            if isinstance(p, str):
                if tokenizer is None:
                    raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
                p = tokenizer.encode(p)
            ids.append(list(p))
        decode = None if tokenizer is None else partial(tokenizer.decode, skip_special_tokens=True)
        run = lambda batch, step: self.generate([{"prompt_token_ids": b} for b in batch], step,  # noqa: E731
                                                use_tqdm=use_tqdm)
        return beam_search(run, ids, params, self.engine.eos_token_ids, decode,
                           self.engine.max_model_len)

    async def _run_batch(self, items: list[str | list[int]], params: list[SamplingParams], priority: list[int],
                         start: int, use_tqdm: bool) -> list[RequestOutput]:
        """Submit every request in one message (the first step is then a full one) and read their
        final outputs as they finish, in one loop: each slot reports its index when it is filled,
        so the event loop runs no task per request. The first error aborts the rest of the batch."""
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        t0, out_tokens = time.monotonic(), 0
        filled_send, filled = anyio.create_memory_object_stream(math.inf)
        subs = [Submit(str(start + i), items[i], params[i], OutputSlot(partial(filled_send.send_nowait, i)),
                       priority[i], final_only=True) for i in range(len(items))]
        await self.engine.submit(subs)
        try:
            for _ in range(len(items)):
                i = await filled.receive()
                results[i] = out = subs[i].slot.take()  # final_only: the one output is the finished one
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
                bar.set_postfix(output_tok_s=f"{out_tokens / max(time.monotonic() - t0, 1e-9):.1f}", refresh=False)
                bar.update(1)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for sub, out in zip(subs, results):
                    if out is None:
                        await self.engine.abort(sub.req_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stop(engine: Engine, portal, portal_cm, run_future) -> None:
    """Stop the engine's loop and thread and release its memory (once: weakref.finalize's call)."""
    try:
        portal.call(engine.stop)
        try:
            run_future.result()
        except* EngineFailed:
            pass  # its requests have ended with it; what is left here is to release the rest
    finally:
        portal_cm.__exit__(None, None, None)
        engine.release()


def _prompt(p: PromptInput) -> str | list[int]:
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and "prompt_token_ids" in p:
        return p["prompt_token_ids"]  # the request actor makes the engine's int64 copy: none here
    if isinstance(p, dict) and "prompt" in p:
        return p["prompt"]
    raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(p).__name__}")

