"""Supervised fine-tuning on XTML-rendered conversations (K3_SPEC section 8: SFT on structured trajectories).

    openk3 sft --init-from runs/base --data runs/pt/sft.jsonl --out runs/pt/sft --steps 300

Each JSONL row is {"messages": [...], "tools": [...] | null, "effort": "low" | "high" | "max" | null}, rendered by
`render_xtml` and encoded segment by segment (`encode_segments`, section 9). The loss is on assistant tokens only:
what the model writes after the generation prompt `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`,
through its `<|end_of_msg|>`; system, user and tool tokens, and the generation prompt itself, are context.
Conversations are packed whole into rows with document boundaries (`cu_seqlens`): no attention, KDA state or label
crosses from one conversation into the next.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.posttrain.policy import add_fields, check_fields, load_policy, log_metrics, save_policy, start_run
from openk3.text.chat import encode_segments, render_xtml
from openk3.train.data import IGNORE_INDEX, Batch, iter_jsonl
from openk3.train.optim import build_optimizer, cosine_schedule, model_head_dims
from openk3.train.trainer import RouterBalancer


def encode_conversation(tokenizer, messages: list[dict], *, tools: list | None = None,
                        effort: str | None = None) -> tuple[list[int], list[bool]]:
    """(ids, target) of a whole conversation: target[i] is True where ids[i] is an assistant-written token.

    Segment spans come from rendering growing prefixes of the conversation: the prompt for assistant message k
    (messages[:k] + the generation prompt) is a prefix of the rendering of messages[:k + 1], and encoding is
    segment-local, so each span's ids are exactly that part of the whole conversation's ids."""
    segs = render_xtml(messages, tools=tools, effort=effort, add_generation_prompt=False)
    spans, done = [], 0  # (start, end) segment indices of assistant-written parts
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = render_xtml(messages[:k], tools=tools, effort=effort, add_generation_prompt=True)
        upto = render_xtml(messages[:k + 1], tools=tools, effort=effort, add_generation_prompt=False)
        if segs[:len(prompt)] != prompt or segs[:len(upto)] != upto:
            raise ValueError(f"message {k}: its rendering does not extend the conversation before it")
        spans.append((len(prompt), len(upto)))
    ids, target = [], []
    for start, end in spans:
        context = encode_segments(tokenizer, segs[done:start])
        written = encode_segments(tokenizer, segs[start:end])
        ids += context + written
        target += [False] * len(context) + [True] * len(written)
        done = end
    rest = encode_segments(tokenizer, segs[done:])
    return ids + rest, target + [False] * len(rest)


def pack(docs: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int) -> list[dict]:
    """Whole documents into rows of `seq_len` tokens, first fit (each goes into the first row with room; measured
    on the demo's 1,200 conversations in 512-token rows: 68% of the row tokens were real with in-order filling, 95%
    with first fit).
    Each row: {"ids": [T], "labels": [T], "starts": [document starts in the row, 0 first], "docs": [their indices
    in `docs`]}; labels[t] = ids[t + 1] when that token is a target of the same document, else IGNORE_INDEX; the
    padding is a document of its own."""
    rows = []
    for n, (ids, target) in enumerate(docs):
        if len(ids) > seq_len:
            raise ValueError(f"conversation {n} has {len(ids)} tokens, more than --seq-len={seq_len}; raise --seq-len")
        cur = next((r for r in rows if len(r["ids"]) + len(ids) <= seq_len), None)
        if cur is None:
            cur = {"ids": [], "labels": [], "starts": [], "docs": []}
            rows.append(cur)
        cur["starts"].append(len(cur["ids"]))
        cur["docs"].append(n)
        cur["ids"] += ids
        cur["labels"] += [ids[t + 1] if target[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    for row in rows:
        pad = seq_len - len(row["ids"])
        if pad:
            row["starts"].append(len(row["ids"]))
            row["ids"] += [pad_id] * pad
            row["labels"] += [IGNORE_INDEX] * pad
    return rows


def length_split(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of documents of these `lengths` in at most `parts` groups of similar length, longest first, chosen
    to minimise sum over groups of (documents x the group's longest), by dynamic programming over the sorted
    lengths.

    NOTE: why: the CPU's chunked KDA (ops/kda/chunk.py) lays the N documents of a forward out as N rows padded to
    the longest, so it computes N x L_max tokens. A random SFT batch mixes 60- and 420-token conversations: on the
    demo's data 2.8x its real tokens went through KDA; split into 4 such groups (micro-batches of one step,
    the same gradient), 1.1x (docs/posttrain.md)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    L = [lengths[i] for i in order]
    n = len(L)
    # cost[m][j]: the least cost of the j longest documents in at most m groups; a group order[i:j] costs (j - i) L[i]
    cost = [[0] + [math.inf] * n] + [[0] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    for m in range(1, parts + 1):
        for j in range(1, n + 1):
            cost[m][j], cut[m][j] = min((cost[m - 1][i] + (j - i) * L[i], i) for i in range(j))
    groups, j, m = [], n, parts
    while j > 0:
        i = cut[m][j]
        groups.append(order[i:j])
        j, m = i, m - 1
    return groups[::-1]


def sft_backward(model, docs: list[tuple[list[int], list[bool]]], rows: list[dict], split: int, device: str,
                 balancer: RouterBalancer | None = None) -> float:
    """Backward of one step's mean loss over the assistant tokens of `rows`; returns the loss. With `split` > 0 the
    rows' documents are re-packed into at most `split` micro-batches of similar length (`length_split`), one row
    each, and every micro-batch's loss is weighted by its share of the targets: the same loss and gradient as one
    forward over `rows` (tested), with far fewer tokens through the CPU's KDA."""
    if not split:
        micro = [collate(rows)]
    else:
        mine = [docs[i] for row in rows for i in row["docs"]]
        micro = []
        for group in length_split([len(ids) for ids, _ in mine], split):
            part = [mine[i] for i in group]
            micro.append(collate(pack(part, sum(len(ids) for ids, _ in part), 0)))  # one row, no padding
    counts = [int((b.labels != IGNORE_INDEX).sum()) for b in micro]
    total, loss = max(sum(counts), 1), 0.0
    for batch, count in zip(micro, counts):
        batch = batch.to(device)
        out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens, record=balancer is not None)
        (out.loss * (count / total)).backward()
        if balancer is not None:
            balancer.after_forward(out.router)
        loss += float(out.loss.detach()) * count / total
    return loss


def collate(rows: list[dict]) -> Batch:
    """Rows of one length -> a `Batch` whose cu_seqlens (over the flattened B*T tokens) hold every document start."""
    T = len(rows[0]["ids"])
    starts = [b * T + s for b, row in enumerate(rows) for s in row["starts"]] + [len(rows) * T]
    seq_ids = torch.tensor([[sum(s <= t for s in row["starts"]) - 1 for t in range(T)] for row in rows])
    return Batch(input_ids=torch.tensor([r["ids"] for r in rows]), labels=torch.tensor([r["labels"] for r in rows]),
                 cu_seqlens=torch.tensor(starts), seq_ids=seq_ids)


def load_conversations(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data file not found: {path}")
    rows = []
    for n, row, _ in iter_jsonl(p):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ValueError(f"{path}:{n}: expected an object with a 'messages' list")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no conversations")
    return rows


@dataclass
class SFTArgs:
    init_from: str
    data: str
    out: str
    steps: int = 300
    batch_size: int = 8  # rows per step
    seq_len: int = 512
    lr: float = 3e-3
    warmup: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    length_split: int = 4  # micro-batches of similar-length documents per step (sft_backward); 0 = the rows as packed
    seed: int = 0
    log_every: int = 10
    threads: int = 1
    device: str = "cpu"


def sft(args: SFTArgs) -> dict:
    """Run SFT; returns {"losses": [...], "wall_s", "run_dir"}."""
    check_fields(args, counts=("steps", "batch_size", "seq_len", "log_every", "threads"), positive=("lr",),
                 non_negative=("weight_decay", "grad_clip", "length_split"))
    if not 0 <= args.warmup < 1:
        raise ValueError(f"--warmup={args.warmup}: a fraction of the steps in [0, 1)")
    if not 0 <= args.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio={args.min_lr_ratio}: must be in [0, 1]")
    t0 = time.time()
    torch.set_num_threads(args.threads)
    conversations = load_conversations(args.data)
    model, tokenizer, init_dir = load_policy(args.init_from, args.device)
    run_dir, _ = start_run(args.out, dataclasses.asdict(args))
    docs = []
    for n, c in enumerate(conversations, start=1):
        try:
            docs.append(encode_conversation(tokenizer, c["messages"], tools=c.get("tools"), effort=c.get("effort")))
        except ValueError as e:  # a bad message / effort / tools list: say which conversation of which file
            raise ValueError(f"--data {args.data}: conversation {n}: {e}") from None
        if not any(docs[-1][1]):  # NOTE: a batch of such rows has no target token: a NaN loss
            raise ValueError(f"--data {args.data}: conversation {n} has no assistant message: nothing to learn")
    rows = pack(docs, args.seq_len, tokenizer.pad_id)  # also refuses a conversation longer than --seq-len
    targets = sum(sum(t) for _, t in docs)
    n_tokens = sum(len(i) for i, _ in docs)
    print(f"sft: {len(docs)} conversations, {n_tokens:,} tokens ({targets:,} assistant) in {len(rows)} rows of "
          f"{args.seq_len} ({n_tokens / (len(rows) * args.seq_len):.0%} filled); from {init_dir}")
    torch.manual_seed(args.seed)
    model.train()
    opt = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay, head_dims=model_head_dims(model.config))
    balancer = RouterBalancer(model, "quantile", 0, 0.0)
    rng, order, pos, losses = random.Random(args.seed), [], 0, []
    for step in range(args.steps):
        if pos + args.batch_size > len(order):  # a new epoch, shuffled
            order, pos = list(range(len(rows))), 0
            rng.shuffle(order)
        picked = [rows[i] for i in (order * 2)[pos:pos + args.batch_size]]  # an epoch shorter than a batch wraps
        pos += args.batch_size
        opt.set_lr_scale(cosine_schedule(step, args.steps, args.warmup, args.min_lr_ratio))
        loss = sft_backward(model, docs, picked, args.length_split, args.device, balancer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf")))
        opt.step()
        opt.zero_grad()
        balancer.end_step()
        if not math.isfinite(loss):
            raise FloatingPointError(f"the SFT loss is {loss} at step {step + 1}; lower --lr")
        losses.append(loss)
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            log_metrics(run_dir, {"step": step + 1, "loss": loss, "grad_norm": grad_norm,
                                  "lr": args.lr * cosine_schedule(step, args.steps, args.warmup, args.min_lr_ratio),
                                  "elapsed_s": time.time() - t0})
            print(f"sft step {step + 1}/{args.steps}: loss {loss:.4f}", flush=True)
    save_policy(run_dir, model, tokenizer)
    from openk3.train import plots

    plots.plot_run(run_dir)
    wall = time.time() - t0
    print(f"sft: done in {wall:.0f} s, final loss {losses[-1]:.4f}; checkpoint in {run_dir}")
    return {"losses": losses, "wall_s": wall, "run_dir": str(run_dir)}


def register_commands(sub: argparse._SubParsersAction) -> None:
    d = SFTArgs("", "", "")
    p = sub.add_parser("sft", description="Supervised fine-tuning on XTML conversations (loss on assistant tokens).")
    p.add_argument("--init-from", required=True, metavar="DIR", help="checkpoint or run directory to start from")
    p.add_argument("--data", required=True, help="JSONL of {messages, tools, effort} (openk3 posttrain-data)")
    p.add_argument("--out", required=True, help="run directory")
    add_fields(p, d, exclude=("init_from", "data", "out", "device"))
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.set_defaults(fn=lambda ns: sft(SFTArgs(**{k: v for k, v in vars(ns).items() if k not in ("fn", "command")})))
