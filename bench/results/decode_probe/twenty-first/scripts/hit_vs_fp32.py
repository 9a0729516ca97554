"""Twenty-first session: is a prefix hit's first token less faithful than a cold prefill's in bf16?

In the twentieth session's bf16 prefix-hit run the hit turn's first token differed from the cold turn's (the fp32
gate, which checks them equal, passes). This probe serves conversations the way `vs_transformers_decode.py
--parts prefix_hit_ttft` does (a first turn whose reply the prefix-cached engine decodes, then a second turn that
resumes from its cache) and compares, for each second turn, the first-token logprobs of three computations of the
same weights: the bf16 hit, the bf16 cold prefill, and an fp32 cold prefill (the same bf16 checkpoint loaded in
fp32: the reference). Tokens compared: the hit's, the cold one's and the fp32 one's greedy pick. Then (`--fp32-hit`)
each conversation again in fp32 end to end: an fp32 prefix-cached engine serves the first turn (its own reply) and
the second turn from its cache, against an fp32 cold prefill of that turn. There rounding is small, so a difference
of the bf16 runs' size would point at the cache. On the GPU fla's KDA kernels run fp32 dot products in TF32;
`--ieee` (twenty-second session) sets them to IEEE fp32.

    python bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --device cuda --out hit_vs_fp32.json
    python bench/results/decode_probe/twenty-first/scripts/hit_vs_fp32.py --config tiny --device cpu --turn 512 \
        --conversations 2 --out /tmp/h.json                                                      # smoke test
"""

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import vs_transformers_decode as vs  # noqa: E402
from openk3.config import get_config  # noqa: E402
from openk3.model.checkpoint import load_pretrained  # noqa: E402
from openk3.ops.kda.backend import select_kda_backend  # noqa: E402


def bf16_row(warm, cold, ref, first, user, args) -> dict:
    """The bf16 hit and cold prefill of one conversation's second turn against the fp32 cold prefill."""
    reply = warm.generate([first], vs.greedy(args.ttft_reply_len))[0].output
    turn = first + reply + user
    hit = warm.generate([turn], vs.greedy(1))[0]
    c = cold.generate([turn], vs.greedy(1))[0]
    r = ref.generate([turn], vs.greedy(1))[0]
    picks = {"hit": hit.output[0], "cold": c.output[0], "fp32": r.output[0]}
    row = {"cached_tokens": hit.cached_tokens, "picks": picks, "hit_logprob_of_its_pick": hit.logprobs[0],
           "logprobs": {}}
    for t in sorted(set(picks.values())):
        row["logprobs"][str(t)] = {"bf16_cold": cold.score(turn + [t])[-1], "fp32": ref.score(turn + [t])[-1]}
    lp = row["logprobs"]
    row["hit_error_on_its_pick"] = abs(hit.logprobs[0] - lp[str(picks["hit"])]["fp32"])
    row["cold_error_on_the_hit_pick"] = abs(lp[str(picks["hit"])]["bf16_cold"] - lp[str(picks["hit"])]["fp32"])
    row["cold_error_on_its_pick"] = abs(c.logprobs[0] - lp[str(picks["cold"])]["fp32"])
    row["fp32_cold_pick_minus_hit_pick"] = lp[str(picks["cold"])]["fp32"] - lp[str(picks["hit"])]["fp32"]
    return row


def logprob_pair(a, b, b_engine, turn: list[int]) -> tuple[bool, float]:
    """(whether requests a and b picked the same first token, b's logprob of a's pick: b's own where they agree,
    else `b_engine`'s score of a's pick after `turn`)."""
    same = a.output == b.output
    return same, b.logprobs[0] if same else b_engine.score(turn + a.output[:1])[-1]


@torch.inference_mode()
def router_choices(model, turn: list[int]) -> list[tuple]:
    """Per MoE layer of one uncached forward of `turn`: (its router, each token's gap between the k-th and (k+1)-th
    biased score [T], the (k+1)-th expert [T])."""
    out = model(torch.tensor([turn], device=next(model.parameters()).device), record=True)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    rows = []
    for (scores, _), router in zip(out.router or [], routers):
        values, experts = (scores + router.e_score_correction_bias).topk(router.k + 1, -1)
        rows.append((router, values[:, -2] - values[:, -1], experts[:, -1]))
    return rows


def router_gaps(model, turn: list[int], last: int) -> dict:
    """Per MoE layer of one uncached forward of `turn`: the smallest gap between the k-th and (k+1)-th biased router
    score over all tokens and over the `last` tokens (those a hit recomputes), and how many tokens have a gap under
    1e-6 and under 1e-4."""
    layers = [{"min_all": gap.min().item(), "min_last": gap[-last:].min().item(),
               "under_1e-6": int((gap < 1e-6).sum()), "under_1e-4": int((gap < 1e-4).sum())}
              for _, gap, _ in router_choices(model, turn)]
    return {"tokens": len(turn), "layers": layers}


@torch.inference_mode()
def break_ties_and_compare(model, args, pages: int, first_turn: list[int], turn: list[int]) -> dict:
    """Widen every router gap under 1e-6 in one uncached forward of `turn` (the (k+1)-th expert's bias lowered by
    1e-3, which changes the model), then a hit after the prefilled `first_turn` against a cold prefill, on fresh
    engines."""
    choices = router_choices(model, turn)
    saved = [router.e_score_correction_bias.clone() for router, _, _ in choices]
    ties = []
    for layer, (router, gap, loser) in enumerate(choices):
        lowered = set()
        for t in (gap < 1e-6).nonzero()[:, 0].tolist():
            ties.append({"moe_layer": layer, "token": t, "gap": gap[t].item(), "lowered_expert": int(loser[t])})
            lowered.add(int(loser[t]))
        for e in lowered:  # the bias of an expert moves every token's choice in this layer, not only the tied one's
            router.e_score_correction_bias[e] -= 1e-3
    try:
        cold_engine = vs.engine_for(model, args, 1, num_pages=pages, prefix_cache=False)
        cold = cold_engine.generate([turn], vs.greedy(1))[0]
        warm = vs.engine_for(model, args, 1, num_pages=pages)
        warm.generate([first_turn], vs.greedy(1))
        hit = warm.generate([turn], vs.greedy(1))[0]
        same, cold_lp = logprob_pair(hit, cold, cold_engine, turn)
    finally:  # the model as it was, for the conversations after this one
        for (router, _, _), bias in zip(choices, saved):
            router.e_score_correction_bias.copy_(bias)
    return {"ties": ties, "same_pick": same, "difference": abs(hit.logprobs[0] - cold_lp)}


def summary(row: dict) -> str:
    parts = []
    if "picks" in row:
        parts.append(f"picks {row['picks']}; |bf16 - fp32| logprob: hit {row['hit_error_on_its_pick']:.4f}, cold "
                     f"{row['cold_error_on_the_hit_pick']:.4f} (the hit's token), {row['cold_error_on_its_pick']:.4f} "
                     f"(its own); fp32's cold pick - hit pick {row['fp32_cold_pick_minus_hit_pick']:.4f}")
    for key, what in (("fp32_hit", "fp32 hit"), ("fp32_prefilled_hit", "fp32 hit after a prefilled first turn"),
                      ("fp32_chunk_control", "fp32 cold in other chunks")):
        if key in row:
            cached = f" ({row[key]['cached_tokens']} cached)" if "cached_tokens" in row[key] else ""
            parts.append(f"{what}{cached} against fp32 cold: same pick {row[key]['same_pick']}, logprob difference "
                         f"{row[key]['difference']:.2e}")
    if "after_breaking_ties" in row:
        b = row["after_breaking_ties"]
        parts.append(f"after breaking {len(b['ties'])} router ties under 1e-6: prefilled hit against cold: same pick "
                     f"{b['same_pick']}, logprob difference {b['difference']:.2e}")
    if row.get("router_gaps", {}).get("layers"):
        g = row["router_gaps"]["layers"]
        parts.append(f"router ties: smallest k-th gap {min(x['min_all'] for x in g):.2e} (the last tokens "
                     f"{min(x['min_last'] for x in g):.2e}), {sum(x['under_1e-6'] for x in g)} token-layers under "
                     f"1e-6, {sum(x['under_1e-4'] for x in g)} under 1e-4")
    return "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="kimi-linear-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--turn", type=int, default=32768, help="tokens of the second turn")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--fp32-hit", action="store_true", help="also an fp32 hit against an fp32 cold prefill")
    p.add_argument("--chunk-control", type=int, default=None,
                   help="with --fp32-hit: also an fp32 cold prefill in chunks of this many tokens (the bench's are "
                        "8,192), against the fp32 cold one: how far rounding alone moves the first token")
    p.add_argument("--prefilled-hit", action="store_true",
                   help="with --fp32-hit: also an fp32 hit whose first turn (prompt and reply) was prefilled as one "
                        "prompt instead of decoded: the cache's restore without the decode path")
    p.add_argument("--skip-bf16", action="store_true", help="only the fp32 comparisons")
    p.add_argument("--router-gaps", action="store_true",
                   help="with --fp32-hit: per MoE layer, how close the fp32 turn's routers came to a tie at the k-th "
                        "expert (the gap between the k-th and (k+1)-th biased score): a tie that rounding flips "
                        "changes a token's experts, a jump no rounding bound covers")
    p.add_argument("--break-ties", action="store_true",
                   help="with --prefilled-hit, last: at every token and MoE layer of the fp32 turn whose k-th and "
                        "(k+1)-th biased router scores lie within 1e-6, lower the (k+1)-th expert's bias by 1e-3 "
                        "(this changes the model), then the prefilled hit against the cold prefill again")
    p.add_argument("--dense", action="store_true",
                   help="the config with a dense MLP in every layer (no router): no top-k tie can flip, so what is "
                        "left between a hit and a cold prefill is rounding or the cache")
    p.add_argument("--ieee", action="store_true",
                   help="fp32 without TF32 on the GPU: Triton's default dot precision and fla's explicit TF32 one "
                        "(SOLVE_TRIL_DOT_PRECISION, KDA's intra-chunk solve) set to ieee, cuBLAS and cuDNN without "
                        "TF32 (the MLA prefill's attention is PyTorch's SDPA, whose fp32 kernels these do not set)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.ieee:  # after openk3 points fla at its shipped configs (before fla's first import), before any kernel
        select_kda_backend(a.device)  # compiles: Triton reads both settings when it compiles a kernel
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        import fla.ops.kda.chunk_intra
        import triton.language as tl
        fla.ops.kda.chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    config = a.config
    if a.dense:
        dense = get_config(a.config)
        dense = dense.replace(first_k_dense_replace=dense.num_hidden_layers)
        config = str(Path(tempfile.mkdtemp(prefix="hit_vs_fp32_")) / "config.json")  # a few KB, left in /tmp
        dense.save(config)
    args = vs.parse_args(["--config", config, "--device", a.device, "--dtype", "bfloat16", "--skip-transformers",
                          "--ttft-len", str(a.turn)])
    rng = random.Random(0)
    out = {"hardware": vs.hardware(args.device), "config": a.config, "dense": a.dense, "ieee": a.ieee, "turn": a.turn,
           "command": " ".join(sys.argv),
           "conversations": []}
    with tempfile.TemporaryDirectory() as workdir:
        model, ckpt, _ = vs.build_checkpoint(args, Path(workdir))
        ref_model = load_pretrained(ckpt, device=args.device, dtype=torch.float32).eval()
    V, L = model.config.vocab_size, a.turn
    ckpt_pages = vs.PagePool(model.config, 2, args.page_size, "meta", torch.bfloat16).checkpoint_pages
    pages = 3 * -(-L // args.page_size) + (L // 2048 + 4) * ckpt_pages  # as the bench's prefix-hit part
    warm = vs.engine_for(model, args, 1, num_pages=pages)
    cold = vs.engine_for(model, args, 1, num_pages=pages, prefix_cache=False)
    ref = vs.engine_for(ref_model, args, 1, num_pages=pages, prefix_cache=False)
    ref_warm = vs.engine_for(ref_model, args, 1, num_pages=pages) if a.fp32_hit else None
    prefilled = vs.engine_for(ref_model, args, 1, num_pages=pages) if a.fp32_hit and a.prefilled_hit else None
    control = None
    if a.fp32_hit and a.chunk_control:
        other = argparse.Namespace(**{**vars(args), "prefill_chunk": a.chunk_control})
        control = vs.engine_for(ref_model, other, 1, num_pages=pages, prefix_cache=False)
    for i in range(a.conversations):
        first = vs.random_prompts(1, L - args.ttft_user_len - args.ttft_reply_len, V, rng)[0]
        user = vs.random_prompts(1, args.ttft_user_len, V, rng)[0]
        row = {}
        if not a.skip_bf16:
            row = bf16_row(warm, cold, ref, first, user, args)
        if ref_warm is not None:
            reply32 = ref_warm.generate([first], vs.greedy(args.ttft_reply_len))[0].output
            turn32 = first + reply32 + user
            hit32 = ref_warm.generate([turn32], vs.greedy(1))[0]
            cold32 = ref.generate([turn32], vs.greedy(1))[0]
            same, cold_lp = logprob_pair(hit32, cold32, ref, turn32)
            row["fp32_hit"] = {"cached_tokens": hit32.cached_tokens, "same_pick": same,
                               "hit_logprob": hit32.logprobs[0], "cold_logprob_of_the_hit_pick": cold_lp,
                               "difference": abs(hit32.logprobs[0] - cold_lp)}
            if prefilled is not None:
                prefilled.generate([first + reply32], vs.greedy(1))  # the first turn, prefilled as one prompt
                hitp = prefilled.generate([turn32], vs.greedy(1))[0]
                same, cold_lp = logprob_pair(hitp, cold32, ref, turn32)
                row["fp32_prefilled_hit"] = {"cached_tokens": hitp.cached_tokens, "same_pick": same,
                                             "difference": abs(hitp.logprobs[0] - cold_lp)}
            if a.router_gaps:
                row["router_gaps"] = router_gaps(ref_model, turn32, args.ttft_user_len + 1)
            if control is not None:
                ctrl = control.generate([turn32], vs.greedy(1))[0]
                same, ctrl_lp = logprob_pair(cold32, ctrl, control, turn32)
                row["fp32_chunk_control"] = {"prefill_chunk": a.chunk_control, "same_pick": same,
                                             "difference": abs(ctrl_lp - cold32.logprobs[0])}
            if a.break_ties and prefilled is not None:  # last: it changes the model
                row["after_breaking_ties"] = break_ties_and_compare(ref_model, args, pages, first + reply32, turn32)
        out["conversations"].append(row)
        intra = sys.modules.get("fla.ops.kda.chunk_intra")  # what the kernels used, as a check on --ieee
        out["fla_solve_tril_dot_precision"] = str(getattr(intra, "SOLVE_TRIL_DOT_PRECISION", None))
        vs.write_json(a.out, out)
        print(f"conversation {i}: {summary(row)}", flush=True)


if __name__ == "__main__":
    main()
