"""Train llmserve's built-in default model: a ~5.6M-parameter Llama that writes Python-documentation prose.

Corpus: the reStructuredText sources of the Python 3.11 documentation, as Debian ships them in the
package python3.11-doc (Python Software Foundation License; no network needed beyond the package
registry):

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python scripts/train_builtin_model.py corpus /tmp/pydoc/usr/share/doc/python3.11/html/_sources corpus.txt
    python scripts/train_builtin_model.py train corpus.txt OUT_DIR --steps 3000     # a GPU takes ~2 min

`corpus` strips the markup to plain prose and writes one document per source file; every 50th
document is held out (OUT_DIR/heldout.txt) for perplexity checks. `train` fits a byte-level BPE
tokenizer (4096 tokens) and the model, and saves both with save_pretrained (bfloat16 safetensors).

The same recipe trains a target/draft pair for speculative decoding (scripts/spec_bench.py) on the
same text with the built-in model's own tokenizer: a larger target, then a draft (the built-in
shape, or `--size draft`: two wide layers) distilled from it (`--teacher`: the loss is the KL divergence from the target's next-token
distribution, so the draft learns to guess what the target would say, not only the text):

    python scripts/train_builtin_model.py train corpus.txt TARGET --size target \
        --tokenizer src/llmserve/builtin_model --steps 500      # ~139M parameters; a GPU takes ~1 min
    python scripts/train_builtin_model.py train corpus.txt DRAFT --teacher TARGET \
        --tokenizer src/llmserve/builtin_model --steps 2000

`--copies F` ends that share of each batch's sequences in a passage, two blank lines and the
passage again, so the model learns to copy what its context holds (what n-gram speculation
proposes); training.json logs the share of a repeated held-out passage its argmax copies.

The target's held-out loss is lowest near 500 steps (about 2 epochs of the 2.1M tokens; it
overfits after); training.json logs it, and for a distilled draft also the share of held-out
positions where its argmax is the target's (what a greedy draft can hope to have kept).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

SEP = "\n\n<|doc|>\n\n"
_ROLE = re.compile(r":[\w:.+-]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_DIRECTIVE = re.compile(r"^\s*\.\. [\w:|-]+::.*$|^\s*\.\. _[^:]*:.*$|^\s*:[\w-]+:.*$")


def clean_rst(text: str) -> str:
    """reST source -> readable prose: roles unwrapped, directives, option lines and rules dropped."""
    text = _ROLE.sub(r"\1", text)
    text = text.replace("``", "").replace("**", "")
    lines = []
    for line in text.splitlines():
        if _DIRECTIVE.match(line) or re.fullmatch(r"\s*([=\-~^*#+\"'`])\1{2,}\s*", line):
            continue
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def build_corpus(sources: Path, out: Path) -> None:
    docs = []
    for path in sorted(sources.rglob("*.txt")):
        if path.parts[-2] == "whatsnew" or path.name.startswith("changelog"):
            continue  # release notes: lists of issue numbers, not prose
        text = clean_rst(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) > 200:
            docs.append(text)
    out.write_text(SEP.join(docs), encoding="utf-8")
    print(f"{len(docs)} documents, {sum(map(len, docs)):,} characters -> {out}")


SIZES = {
    "builtin": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, lr=3e-3),
    "target": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, lr=1e-3),
    "draft": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, lr=2e-3),
}
"""Model shapes by name: the built-in model, the target it drafts for, and a draft of two wide
layers (a small model's pass costs its kernels' launches, not its bytes: two layers launch a third
of the built-in shape's six)."""


def train(corpus: Path, out_dir: Path, steps: int, device: str, batch: int = 64, seed: int = 0,
          size: str = "builtin", tokenizer: Path | None = None, teacher: Path | None = None,
          copies: float = 0.0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    docs = corpus.read_text(encoding="utf-8").split(SEP)
    heldout = [d for i, d in enumerate(docs) if i % 50 == 49]
    train_docs = [d for i, d in enumerate(docs) if i % 50 != 49]
    out_dir.mkdir(parents=True, exist_ok=True)

    if tokenizer is not None:  # another model's (a draft and its target share one)
        fast = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(train_docs, trainers.BpeTrainer(
            vocab_size=4096, special_tokens=["<|endoftext|>", "<|pad|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       pad_token="<|pad|>", model_max_length=512)
        # The model only knows documentation prose: a chat renders as that prose, one message a paragraph.
        fast.chat_template = ("{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}")
    fast.save_pretrained(out_dir)

    eos = fast.eos_token_id

    def stream(texts):
        ids = []
        for t in texts:
            ids += fast.encode(t) + [eos]
        return torch.tensor(ids, dtype=torch.long)

    train_ids, held_ids = stream(train_docs), stream(heldout)
    shape = dict(SIZES[size])
    lr = shape.pop("lr")
    config = LlamaConfig(vocab_size=len(fast), **shape, max_position_embeddings=512,
                         rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=fast.pad_token_id, initializer_range=0.02)
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if teacher is not None:
        teacher_model = LlamaForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16).to(device).eval()
        if teacher_model.config.vocab_size != config.vocab_size:
            raise SystemExit(f"--teacher {teacher} has a vocabulary of {teacher_model.config.vocab_size}, "
                             f"the tokenizer {config.vocab_size}")
    seq, warmup = 256, 100
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)

    blank = torch.tensor(fast.encode("\n\n"), dtype=torch.long)

    def copy_row(ids, g):
        """seq + 1 tokens ending in a passage of the text, two blank lines and the passage again
        (text before it up to the length): what a model must copy to continue."""
        span = int(torch.randint(16, (seq + 1 - len(blank)) // 2, (1,), generator=g))
        s = int(torch.randint(0, len(ids) - seq - 1, (1,), generator=g))
        n = seq + 1 - 2 * span - len(blank)  # text before the passage, which follows it in the corpus
        return torch.cat([ids[s:s + n], ids[s + n:s + n + span], blank, ids[s + n:s + n + span]]), span

    def batch_of(ids):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        rows = [ids[s:s + seq + 1] for s in starts.tolist()]
        for i in range(batch - round(copies * batch), batch):  # the share that teaches copying
            rows[i] = copy_row(ids, gen)[0]
        x = torch.stack(rows).to(device)
        return x[:, :-1], x[:, 1:]

    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu")

    @torch.no_grad()
    def teacher_logits(x):
        with autocast:
            return teacher_model(x).logits.float()

    copy_rows = [copy_row(held_ids, torch.Generator().manual_seed(seed + i)) for i in range(32)]

    @torch.no_grad()
    def heldout_scores():
        """Held-out loss, with a teacher the share of positions where both argmaxes agree, and the
        share of a repeated held-out passage's tokens (after its first) the argmax copies."""
        model.eval()
        losses, agree, copied = [], [], []
        for s in range(0, len(held_ids) - seq - 1, seq * 8)[:64]:
            x = held_ids[s:s + seq + 1][None].to(device)
            with autocast:
                logits = model(x[:, :-1]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item())
            if teacher is not None:
                agree.append((logits.argmax(-1) == teacher_logits(x[:, :-1]).argmax(-1)).float().mean().item())
        for row, span in copy_rows:
            x = row[None].to(device)
            with autocast:
                guess = model(x[:, :-1]).logits.argmax(-1)[0]
            copied.append((guess[-span + 1:] == x[0, -span + 1:]).float().mean().item())
        model.train()
        return (sum(losses) / len(losses), (sum(agree) / len(agree) if agree else None),
                sum(copied) / len(copied))

    log = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        x, y = batch_of(train_ids)
        with autocast:
            logits = model(x).logits.float()
        if teacher is None:
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        else:  # KL(teacher || model) per position
            target = torch.log_softmax(teacher_logits(x), -1).reshape(-1, logits.shape[-1])
            loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1]), target,
                                              log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == steps - 1:
            held_loss, agreement, copied = heldout_scores()
            entry = {"step": step, "train_loss": round(loss.item(), 4), "heldout_loss": round(held_loss, 4),
                     "heldout_copied": round(copied, 4), "seconds": round(time.time() - t0, 1)}
            if agreement is not None:
                entry["heldout_argmax_agreement"] = round(agreement, 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)

    model.to(torch.bfloat16).save_pretrained(out_dir)
    (out_dir / "heldout.txt").write_text(SEP.join(heldout), encoding="utf-8")
    (out_dir / "training.json").write_text(json.dumps({
        "corpus": "Python 3.11 documentation sources (Debian python3.11-doc), markup stripped",
        "train_tokens": len(train_ids), "heldout_tokens": len(held_ids), "parameters": n_params,
        "steps": steps, "batch": batch, "seq_len": seq, "peak_lr": lr, "seed": seed, "copies": copies,
        "teacher": None if teacher is None else str(teacher), "log": log}, indent=1))
    print(f"{n_params:,} parameters, {len(train_ids):,} training tokens -> {out_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("sources", type=Path)
    c.add_argument("out", type=Path)
    t = sub.add_parser("train")
    t.add_argument("corpus", type=Path)
    t.add_argument("out_dir", type=Path)
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--device", default="cuda")
    t.add_argument("--batch", type=int, default=64, help="sequences of 256 tokens a step")
    t.add_argument("--size", choices=sorted(SIZES), default="builtin", help="the model's shape")
    t.add_argument("--tokenizer", type=Path, help="use this directory's tokenizer instead of fitting one")
    t.add_argument("--teacher", type=Path, help="distil from this checkpoint (of the same tokenizer) instead of "
                                                "learning the text: a draft for that target")
    t.add_argument("--copies", type=float, default=0.0,
                   help="the share of each batch's sequences that end in a passage repeated (0: none)")
    args = ap.parse_args()
    if args.cmd == "corpus":
        build_corpus(args.sources, args.out)
    else:
        train(args.corpus, args.out_dir, args.steps, args.device, args.batch, size=args.size, tokenizer=args.tokenizer,
              teacher=args.teacher, copies=args.copies)


if __name__ == "__main__":
    main()
