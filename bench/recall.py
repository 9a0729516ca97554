"""The Kimi Linear paper's synthetic recall suite at small scale (arXiv 2510.26692, section 5.1): MQAR, palindrome
and stack, two-layer models, accuracy against steps.

    python bench/recall.py                                   # the issue's grid (GPU-sized; minutes per run on an H200)
    python bench/recall.py --tasks mqar --seqs 512 --models kda --steps 3000
    python bench/recall.py --device cpu --seqs 64 --steps 300 --hidden 128 --head-dim 64 --vocab 256 --pairs 8

Models (2 layers each, hidden 256, no MoE, SwiGLU MLP, plain residual so only the token mixer differs):
  kda           openk3 K3ForCausalLM with 2 KDA layers, K3's gate (bounded at -5, full-rank output gate)
  kda-softplus  the same with Kimi-Linear's unbounded softplus decay
  mla           openk3 with 2 gated MLA layers (NoPE: no position information at all)
  transformer   the control: torch TransformerEncoder, pre-norm, learned positions, 4 heads, causal mask
  fla-kda       flash-linear-attention's own `fla.layers.KimiDeltaAttention` in the same 2-layer frame (CUDA + fla)

Tasks (aligned targets: labels[t] is what the model must output after reading inputs[t]; -100 = not scored):
  mqar        Zoology's multi-query associative recall: `pairs` key-value pairs (keys from the lower half of the
              vocabulary, values from the upper half), then the keys again in random order at random places of
              the rest of the sequence, which is filled with random tokens; scored at each queried key (target:
              its value)
  palindrome  (seq-1)//2 random tokens, a separator, then the same tokens reversed; scored on the reversed half
  stack       a random program of PUSH x / POP over a stack of values; scored at each POP (target: the top value)

Training: AdamW (lr 1e-3, weight decay 0.1, betas 0.9/0.95), gradient clipping 1.0, batch 64, fp32, fresh random
batches every step, accuracy on 256 held-out sequences. Writes bench/results/recall.json after every evaluation and
docs/recall.png at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openk3.config import K3Config  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.ops.kda.tuned import FLA_MODULES, limit_fla_autotuning  # noqa: E402

# ------------------------------------------------------------------------------------------------ tasks


def mqar(batch: int, seq: int, vocab: int, pairs: int, gen: torch.Generator, layout: str = "zoology"
         ) -> tuple[Tensor, Tensor]:
    """Multi-query associative recall. -> inputs [B, seq], labels [B, seq] (int64).

    layout "zoology": the queries (each key followed by its value) sit at random places of the rest of the sequence,
    which is filled with random tokens (Zoology's MQAR, the paper's). layout "adjacent": the queries follow the
    pairs at once and the random filler comes after them (the recall issue's description)."""
    if 4 * pairs > seq:
        raise ValueError(f"mqar needs seq >= 4 * pairs, got seq={seq}, pairs={pairs}")
    half = vocab // 2
    keys = torch.argsort(torch.rand(batch, half, generator=gen), dim=1)[:, :pairs]     # distinct keys per row
    values = half + torch.randint(0, vocab - half, (batch, pairs), generator=gen)
    x = torch.randint(0, vocab, (batch, seq), generator=gen)
    x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2] = keys, values
    if layout == "zoology":  # distinct even offsets of the rest, so a query never overwrites another's value slot
        slots = (seq - 2 * pairs) // 2
        where = 2 * pairs + 2 * torch.argsort(torch.rand(batch, slots, generator=gen), dim=1)[:, :pairs]
    elif layout == "adjacent":
        where = (2 * pairs + 2 * torch.arange(pairs)).expand(batch, pairs)
    else:
        raise ValueError(f"unknown mqar layout {layout!r}: not one of zoology, adjacent")
    order = torch.argsort(torch.rand(batch, pairs, generator=gen), dim=1)
    qk, qv = keys.gather(1, order), values.gather(1, order)
    x.scatter_(1, where, qk)
    x.scatter_(1, where + 1, qv)
    labels = torch.full_like(x, -100)
    labels.scatter_(1, where, qv)
    return x, labels


def palindrome(batch: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """n = (seq-1)//2 random tokens, a separator (the last id), the n tokens reversed; padded with the separator."""
    n = (seq - 1) // 2
    sep = vocab - 1
    a = torch.randint(0, vocab - 1, (batch, n), generator=gen)
    x = torch.full((batch, seq), sep, dtype=torch.long)
    x[:, :n], x[:, n + 1:2 * n + 1] = a, a.flip(1)
    labels = torch.full_like(x, -100)
    labels[:, n:2 * n] = a.flip(1)  # at the separator and each reversed token: the next reversed token
    return x, labels


def stack(batch: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A PUSH x (two tokens) / POP program; at a POP the target is the value it removes. PUSH = vocab-2, POP = vocab-1;
    a POP only when the stack is not empty, a PUSH with probability 1/2 otherwise."""
    push, pop = vocab - 2, vocab - 1
    x = torch.full((batch, seq), pop, dtype=torch.long)
    labels = torch.full_like(x, -100)
    coins = torch.rand(batch, seq, generator=gen)
    vals = torch.randint(0, vocab - 2, (batch, seq), generator=gen)
    for b in range(batch):  # data generation only; seq x batch python steps are negligible next to training
        st, t = [], 0
        while t < seq:
            if (not st or coins[b, t] < 0.5) and t + 1 < seq:
                x[b, t], x[b, t + 1] = push, vals[b, t]
                st.append(int(vals[b, t]))
                t += 2
            elif st:
                labels[b, t] = st.pop()
                t += 1
            else:
                break
    return x, labels


def make_batch(task: str, batch: int, seq: int, vocab: int, pairs: int, gen: torch.Generator,
               layout: str = "zoology") -> tuple[Tensor, Tensor]:
    if task == "mqar":
        return mqar(batch, seq, vocab, pairs, gen, layout)
    if task == "palindrome":
        return palindrome(batch, seq, vocab, gen)
    if task == "stack":
        return stack(batch, seq, vocab, gen)
    raise ValueError(f"unknown task {task!r}: not one of mqar, palindrome, stack")


# ----------------------------------------------------------------------------------------------- models


def k3_config(kind: str, vocab: int, hidden: int, heads: int, head_dim: int) -> K3Config:
    """Two openk3 layers of one mixer kind, dense SwiGLU MLP, plain residual (the token mixer is what differs)."""
    kda = kind in ("kda", "kda-softplus")
    return K3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
        intermediate_size=2 * hidden, hidden_act="silu", max_position_embeddings=1 << 20,
        kv_lora_rank=head_dim, qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
        mla_use_output_gate=True,
        linear_attn_config={"num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": kind == "kda",
                            "gate_lower_bound": -5.0 if kind == "kda" else None,
                            "kda_layers": [1, 2] if kda else [], "full_attn_layers": [] if kda else [1, 2]},
        num_experts=2, num_experts_per_token=1, first_k_dense_replace=2,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)


class K3Wrapper(nn.Module):
    def __init__(self, config: K3Config, seed: int, init: str):
        super().__init__()
        self.model = K3ForCausalLM(config)
        self.model.reset_parameters(seed=seed)
        if init == "torch":  # diagnosis: PyTorch's default init for every Linear, Conv1d and Embedding
            for m in self.model.modules():
                if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)):
                    m.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


class Transformer(nn.Module):
    """Pre-norm causal Transformer with learned positions: the control a user would pick."""

    def __init__(self, vocab: int, hidden: int, heads: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        h = self.embed(x) + self.pos(torch.arange(T, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


class FlaKDA(nn.Module):
    """fla's own KimiDeltaAttention layer in a 2-layer pre-norm frame with a SwiGLU MLP: the second control."""

    def __init__(self, vocab: int, hidden: int, heads: int, head_dim: int):
        super().__init__()
        from fla.layers import KimiDeltaAttention

        self.embed = nn.Embedding(vocab, hidden)
        self.attn = nn.ModuleList(KimiDeltaAttention(hidden_size=hidden, head_dim=head_dim, num_heads=heads,
                                                     layer_idx=i) for i in range(2))
        self.n1 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(2))
        self.n2 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(hidden, 4 * hidden, bias=False) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(2 * hidden, hidden, bias=False) for _ in range(2))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for i in range(2):
            h = h + self.attn[i](self.n1[i](h))[0]
            a, b = self.up[i](self.n2[i](h)).chunk(2, -1)
            h = h + self.down[i](F.silu(a) * b)
        return self.head(self.norm(h))


MODELS = ("kda", "kda-softplus", "mla", "transformer", "fla-kda")


def build(kind: str, args, max_len: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "transformer":
        return Transformer(args.vocab, args.hidden, 4, max_len)
    if kind == "fla-kda":
        return FlaKDA(args.vocab, args.hidden, args.heads, args.head_dim)
    if kind in ("kda", "kda-softplus", "mla"):
        return K3Wrapper(k3_config(kind, args.vocab, args.hidden, args.heads, args.head_dim), seed, args.init)
    raise ValueError(f"unknown model {kind!r}: not one of {MODELS}")


# --------------------------------------------------------------------------------------------- training


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embeddings included) but not on vectors or the short-conv kernels: norm weights,
    A_log, dt_bias and biases, as fla marks A_log and dt_bias `_no_weight_decay`."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "conv1d" not in name else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


@torch.no_grad()
def accuracy(model: nn.Module, data: tuple[Tensor, Tensor], batch: int) -> tuple[float, float]:
    """(accuracy, mean loss) over the scored positions of the held-out set."""
    model.eval()
    right = scored = 0
    loss = 0.0
    x_all, y_all = data
    for s in range(0, x_all.shape[0], batch):
        x, y = x_all[s:s + batch], y_all[s:s + batch]
        logits = model(x).float()
        m = y != -100
        right += int((logits.argmax(-1)[m] == y[m]).sum())
        scored += int(m.sum())
        loss += float(F.cross_entropy(logits[m], y[m], reduction="sum"))
    model.train()
    return right / scored, loss / scored


def train_one(task: str, seq: int, kind: str, args, log, save=lambda run: None) -> dict:
    device = torch.device(args.device)
    model = build(kind, args, seq, args.seed).to(device)
    groups = decay_groups(model, args.weight_decay) if args.decay_matrices_only else model.parameters()
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warm = args.warmup

    def lr_at(step: int) -> float:  # linear warmup, cosine to 10%
        if step < warm:
            return (step + 1) / warm
        p = (step - warm) / max(1, args.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed + 1)
    held = make_batch(task, args.eval_size, seq, args.vocab, args.pairs, torch.Generator().manual_seed(12345),
                      args.layout)
    held = (held[0].to(device), held[1].to(device))
    curve, t0 = [], time.time()

    def summary(curve):
        return run_summary(task, seq, kind, args, model, device, curve)

    for step in range(1, args.steps + 1):
        x, y = make_batch(task, args.batch, seq, args.vocab, args.pairs, gen, args.layout)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            acc, val = accuracy(model, held, args.batch)
            curve.append({"step": step, "accuracy": acc, "loss": val, "train_loss": float(loss),
                          "seconds": round(time.time() - t0, 1)})
            log(f"  {task:10s} seq {seq:5d} {kind:12s} step {step:5d}  train loss {float(loss):.3f}  "
                f"held-out loss {val:.3f}  accuracy {100 * acc:6.2f}%  ({time.time() - t0:.0f} s)")
            save(summary(curve))
            if acc >= args.stop_at:
                break
    return summary(curve)


def run_summary(task, seq, kind, args, model, device, curve) -> dict:
    return {"task": task, "seq": seq, "model": kind, "backend": backend_name(kind, device),
            "steps": curve[-1]["step"], "accuracy": curve[-1]["accuracy"], "curve": curve,
            "pairs": args.pairs if task == "mqar" else None,
            "layout": args.layout if task == "mqar" else None, "vocab": args.vocab, "lr": args.lr, "init": args.init,
            "params": sum(p.numel() for p in model.parameters())}


def backend_name(kind: str, device: torch.device) -> str:
    if kind in ("kda", "kda-softplus"):
        from openk3.ops.kda import select_kda_backend
        return select_kda_backend(device).name
    if kind == "fla-kda":
        return "fla (its own layer)"
    return "sdpa" if kind == "mla" else "torch"


def hardware(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()} x {os.cpu_count()} cores, torch {torch.__version__}"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(r):
        return r["task"], r["seq"], r.get("layout") or "", r.get("lr", 0)

    panels = sorted({panel(r) for r in runs})
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        for r in runs:
            if panel(r) == key:
                label = r["model"] + ("" if r.get("variant", "default") == "default" else f" ({r['variant']})")
                label += f" [{r['backend']}]" if r["model"].startswith("kda") else ""
                ax.plot([c["step"] for c in r["curve"]], [100 * c["accuracy"] for c in r["curve"]], label=label,
                        marker="o", markersize=2.5)  # a marker, so a run with one evaluation still shows
        task, seq, layout, lr = key
        ax.set_title(f"{task} {layout}, length {seq}, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="mqar,palindrome,stack")
    p.add_argument("--seqs", default="256,512,1024")
    p.add_argument("--models", default="kda,kda-softplus,mla,transformer")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--stop-at", type=float, default=1.01, help="stop a run once held-out accuracy reaches this")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--decay-matrices-only", action="store_true")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--layout", choices=("zoology", "adjacent"), default="zoology", help="where MQAR's queries go")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("openk3", "torch"), default="openk3",
                   help="openk3 models: their own init, or PyTorch's default init of every layer (a diagnosis)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(ROOT / "bench/results/recall.json"))
    p.add_argument("--plot", default=str(ROOT / "docs/recall.png"))
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the setting)
    torch.backends.cudnn.allow_tf32 = False
    if args.device.startswith("cuda") and importlib.util.find_spec("fla"):
        # fla's own layers autotune like openk3's kernels: over at most 3 candidates (OPENK3_FLA_AUTOTUNE=full: all)
        limit_fla_autotuning(FLA_MODULES + ("fla.layers", "fla.modules"))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"hardware": hardware(args.device), "command": " ".join(["python bench/recall.py", *(argv or sys.argv[1:])]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")}, "runs": []}
    print(f"recall suite on {result['hardware']}", flush=True)
    for task in args.tasks.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            for kind in args.models.split(","):
                def save(run, n=len(result["runs"])):  # after every evaluation, so a killed run keeps its curve
                    result["runs"][n:] = [run]
                    tmp = out.with_suffix(".tmp")
                    tmp.write_text(json.dumps(result, indent=1))
                    os.replace(tmp, out)

                save(train_one(task, seq, kind, args, lambda s: print(s, flush=True), save))
    print(f"\n| task | seq | model | backend | steps | accuracy |\n|---|---|---|---|---|---|")
    for r in result["runs"]:
        print(f"| {r['task']} | {r['seq']} | {r['model']} | {r['backend']} | {r['steps']} | {100 * r['accuracy']:.2f}% |")
    if args.plot:
        plot(result["runs"], Path(args.plot))


if __name__ == "__main__":
    main()
