"""`openk3 rl`: group-relative policy gradient for one (domain, effort) policy (K3_SPEC section 8).

    openk3 rl --init-from runs/pt/sft --domain coding --effort low --out runs/pt/rl/coding-low --iterations 8

One iteration:
  1. new groups: `--groups` prompts from a fixed pool of `--pool` tasks, `--group-size` samples each, effort set by
     the XTML thinking-effort system message; plus the partial trajectories carried over from the last iteration;
  2. rollouts by the engine (rollout.py) until `--finish-fraction` of them are done; the rest keep their tokens and
     environment snapshots and continue next iteration under the newer policy (partial rollouts);
  3. the reward of a finished trajectory: -1 if its reasoning exceeds tau(effort) x b0(x), else its task reward
     (the budget penalty); b0(x) is the mean reasoning length of the *initial* model on prompt x with no effort
     message, estimated once before training (`--b0-samples` samples per prompt, saved in b0.json);
  4. once every member of a group is done, advantages (r - mean) / std within the group (GRPO);
  5. one update on the complete groups: token-level ratio exp(log pi - log mu) against the policy mu that sampled
     each token (its version is stored per token, so a resumed trajectory mixes versions), clipped PPO surrogate,
     mean over tokens (`clipped_pg_loss`);
  6. the new weights are loaded into the engine, whose prefix cache is dropped (`Engine.load_weights`).
With `--kl-coef C > 0` the loss adds C x KL(pi || pi_init) by the k3 estimator (`kl_k3`); at 0 (the default) the KL
is only reported. Every `--ckpt-every` iterations a checkpoint (checkpoints/step_N: weights, optimizer, RNG, the
partial rollouts with their environment snapshots, the metrics rows) lets `--resume` continue a killed run.

metrics.jsonl, one row per iteration: step, domain, effort, reward, success, reasoning_tokens, budget_penalised,
truncated, staleness (mean policy versions between sampling and training over trained tokens), partial (carried
trajectories), mixed_version (trained trajectories sampled by more than one policy), kl_to_init (mean over trained
tokens of log pi - log pi_init, sampled under the behaviour policy: k1), kl_k3_to_init (the same KL by k3), loss,
pg_loss (without the KL term), clip_frac, grad_norm, trained, elapsed_s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import random
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.posttrain.envs import DOMAINS, make_task
from openk3.posttrain.policy import (add_fields, check_fields, load_policy, load_state, log_metrics, make_engine,
                                     save_policy, save_state, start_run, token_logprobs)
from openk3.posttrain.rollout import RolloutLimits, Trajectory, _seed, advance, start_trajectory
from openk3.text.chat import EFFORTS
from openk3.train.optim import build_optimizer, model_head_dims
from openk3.train.trainer import write_json

# Budget multipliers per effort: a trajectory may reason up to tau x b0(x) tokens. Smaller for lower effort.
# NOTE: measured in the demo (docs/posttrain.md): with high 1.5 and max 3.0 the SFT model's own high and max
# reasoning (1.5x and 3.3x of its no-effort length) was 60-90% penalised, and RL cut reasoning below the low
# tier's; these leave the tiers' typical lengths inside their budgets and penalise the tail.
TAU = {"low": 0.75, "high": 2.0, "max": 4.0}


# ------------------------------------------------------------------------------------------ the math

def budget_reward(task_reward: float, reasoning_tokens: int, b0: float, tau: float) -> tuple[float, bool]:
    """(reward, penalised): -1 when the reasoning is longer than tau x b0, else the task reward."""
    if b0 <= 0 or tau <= 0:
        raise ValueError(f"budget b0={b0}, tau={tau}: both must be > 0")
    over = reasoning_tokens > tau * b0
    return (-1.0 if over else task_reward), over


def group_advantages(rewards: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    """(r - mean of its group) / (std of its group + eps); 0 for a group whose rewards are all equal."""
    by: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by.setdefault(g, []).append(r)
    mean = {g: sum(v) / len(v) for g, v in by.items()}
    stats = {g: (mean[g], math.sqrt(sum((x - mean[g]) ** 2 for x in v) / len(v))) for g, v in by.items()}
    return [0.0 if stats[g][1] < eps else (r - stats[g][0]) / (stats[g][1] + eps) for r, g in zip(rewards, groups)]


def clipped_pg_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """Token-level clipped surrogate (PPO), averaged over the masked tokens of the batch:
    -mean_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t), rho_t = exp(logp_t - old_logp_t).
    logp, old_logp, mask: [B, T]; adv: [B, T] (per token) or [B] (per sequence). -> (loss, fraction clipped)."""
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    n = mask.sum().clamp_min(1)
    clipped = ((ratio - 1).abs() > clip) & mask
    return -(surr * mask).sum() / n, clipped.sum() / n


def kl_k3(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """KL(pi || pi_ref) by Schulman's k3 estimator ("Approximating KL Divergence", 2020), averaged over the masked
    tokens: with d = log pi_ref - log pi on tokens sampled from pi, k3 = exp(d) - 1 - d, which is >= 0 for every
    token (k1 = -d can be negative) and unbiased, with far lower variance than k1 when pi is close to pi_ref (the
    estimator GRPO adds to its loss). Its gradient in log pi is 1 - pi_ref / pi per token.
    NOTE: the tokens here come from the behaviour policy mu (a few versions old at most), not exactly pi."""
    d = ref_logp - logp
    return ((torch.exp(d) - 1 - d) * mask).sum() / mask.sum().clamp_min(1)


def pad_batch(trajs: list[Trajectory], pad_id: int) -> dict[str, Tensor]:
    """Right-padded [B, L] ids and, aligned with the log-probs of ids[:, 1:] ([B, L - 1]): mask (policy-written
    tokens), behaviour log-probs, versions."""
    L = max(len(t.tokens) for t in trajs)
    ids = torch.full((len(trajs), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(trajs), L - 1, dtype=torch.bool)
    old = torch.zeros(len(trajs), L - 1)
    ver = torch.full((len(trajs), L - 1), -1, dtype=torch.long)
    for b, t in enumerate(trajs):
        n = len(t.tokens)
        ids[b, :n] = torch.tensor(t.tokens)
        mask[b, :n - 1] = torch.tensor(t.written[1:])
        old[b, :n - 1] = torch.tensor(t.logprobs[1:])
        ver[b, :n - 1] = torch.tensor(t.versions[1:])
    return {"ids": ids, "mask": mask, "old": old, "versions": ver}


# ------------------------------------------------------------------------------------------ the loop

@dataclass
class RLArgs:
    init_from: str
    out: str
    domain: str
    effort: str
    iterations: int = 8
    groups: int = 4  # prompts per iteration
    group_size: int = 4  # samples per prompt
    pool: int = 32  # distinct training prompts
    b0_samples: int = 2
    lr: float = 3e-4  # NOTE: 1e-3 took the KL to the SFT model to 0.7-1.3 in 5 iterations (demo run 1)
    clip: float = 0.2
    finish_fraction: float = 0.75
    chunk_tokens: int = 32
    max_turn_tokens: int = 96
    max_total_tokens: int = 640
    tau_low: float = TAU["low"]
    tau_high: float = TAU["high"]
    tau_max: float = TAU["max"]
    grad_clip: float = 1.0
    kl_coef: float = 0.0  # weight of the k3 KL to the initial policy in the loss (0: only reported)
    ckpt_every: int = 1  # iterations between resumable checkpoints (checkpoints/step_N)
    keep_last: int = 1
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    resume: bool = False


def check_rl_args(a: RLArgs) -> None:
    if a.domain not in DOMAINS:
        raise ValueError(f"--domain={a.domain!r}: expected one of {list(DOMAINS)}")
    if a.effort not in EFFORTS:
        raise ValueError(f"--effort={a.effort!r}: expected one of {list(EFFORTS)}")
    check_fields(a, counts=("iterations", "groups", "group_size", "pool", "b0_samples", "threads", "ckpt_every",
                            "keep_last"), positive=("lr", "clip"), non_negative=("grad_clip", "kl_coef"))
    if a.group_size < 2:
        raise ValueError(f"--group-size={a.group_size}: group-relative advantages need at least 2 samples")
    if not 0 < a.finish_fraction <= 1:
        raise ValueError(f"--finish-fraction={a.finish_fraction}: must be in (0, 1]")
    if not (0 < a.tau_low < a.tau_high < a.tau_max):
        raise ValueError(f"--tau-low/high/max = {a.tau_low}/{a.tau_high}/{a.tau_max}: need 0 < low < high < max")


def estimate_b0(engine, tokenizer, tasks, samples: int, limits: RolloutLimits, seed: int) -> dict[str, float]:
    """b0(x): the initial model's mean reasoning tokens on each task with no effort message (at least 1)."""
    trajs = [start_trajectory(t, None, tokenizer, seed=_seed(seed, "b0", t.id, j), group=i)
             for i, t in enumerate(tasks) for j in range(samples)]
    advance(engine, tokenizer, trajs, 0, limits)
    b0: dict[str, list[int]] = {}
    for t in trajs:
        b0.setdefault(t.task.id, []).append(t.reasoning_tokens)
    return {k: max(1.0, sum(v) / len(v)) for k, v in b0.items()}


def rl(args: RLArgs) -> dict:
    """Train one policy; returns {"run_dir", "rows": the metrics rows, "wall_s"}. With `args.resume` a killed run
    continues from its last checkpoint: weights, optimizer, RNG, the partial rollouts (unfinished trajectories with
    their environment snapshots, finished ones waiting for their group), the policy version and the metrics."""
    check_rl_args(args)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    policy, tokenizer, init_dir = load_policy(args.init_from, args.device)
    run_dir, ckpt = start_run(args.out, dataclasses.asdict(args), resume=args.resume)
    tau = {"low": args.tau_low, "high": args.tau_high, "max": args.tau_max}[args.effort]
    limits = RolloutLimits(args.chunk_tokens, args.max_turn_tokens, args.max_total_tokens)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    engine = make_engine(copy.deepcopy(policy).eval(), args.max_total_tokens,
                         max_batch=args.groups * args.group_size * 2)
    rng = random.Random(args.seed)
    pool = [make_task(args.domain, rng) for _ in range(args.pool)]
    state = load_state(ckpt) if ckpt else None
    b0 = state["b0"] if state else estimate_b0(engine, tokenizer, pool, args.b0_samples, limits, args.seed)
    write_json(run_dir / "b0.json", b0)
    print(f"rl {args.domain}/{args.effort}: b0 mean {sum(b0.values()) / len(b0):.1f} reasoning tokens over "
          f"{len(pool)} prompts, tau {tau}; from {init_dir}", flush=True)

    policy.train()
    opt = build_optimizer(policy, lr=args.lr, weight_decay=0.0, head_dims=model_head_dims(policy.config))
    version, carry, waiting, next_group, rows, start, elapsed_before = 0, [], [], 0, [], 0, 0.0
    if state:
        policy.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        engine.load_weights(policy.state_dict())
        version, next_group, rows, start = state["version"], state["next_group"], state["rows"], state["step"]
        carry = [Trajectory.from_dict(d) for d in state["carry"]]
        waiting = [Trajectory.from_dict(d) for d in state["waiting"]]
        elapsed_before = state["elapsed_s"]
        print(f"rl: resumed from {ckpt} at iteration {start} (policy version {version}, {len(carry)} partial "
              f"trajectories)", flush=True)
    for it in range(start, args.iterations):
        fresh = []
        for _ in range(args.groups):
            task = pool[rng.randrange(len(pool))]
            fresh += [start_trajectory(task, args.effort, tokenizer, seed=_seed(args.seed, next_group, j),
                                       group=next_group, version=version) for j in range(args.group_size)]
            next_group += 1
        batch = carry + fresh
        advance(engine, tokenizer, batch, version, limits, args.finish_fraction)
        carry = [t for t in batch if not t.done]
        waiting += [t for t in batch if t.done]
        pending = {t.group for t in carry}
        ready = [t for t in waiting if t.group not in pending]
        waiting = [t for t in waiting if t.group in pending]
        row = {"step": it + 1, "domain": args.domain, "effort": args.effort, "partial": len(carry),
               "trained": len(ready)}
        if ready:
            row.update(update(policy, reference, opt, ready, b0, tau, version, args, tokenizer.pad_id))
            version += 1
            engine.load_weights(policy.state_dict())
        row["elapsed_s"] = elapsed_before + time.time() - t0
        rows.append(row)
        log_metrics(run_dir, row)
        print(f"rl {args.domain}/{args.effort} iter {it + 1}/{args.iterations}: "
              + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        if (it + 1) % args.ckpt_every == 0 and it + 1 < args.iterations:
            save_state(run_dir, it + 1, policy, tokenizer, args, {
                "step": it + 1, "version": version, "next_group": next_group, "rows": rows, "b0": b0,
                "carry": [t.to_dict() for t in carry], "waiting": [t.to_dict() for t in waiting],
                "elapsed_s": row["elapsed_s"], "model": policy.state_dict(), "optimizer": opt.state_dict(),
                "rng": {"python": rng.getstate(), "torch": torch.get_rng_state()}})
    save_policy(run_dir, policy, tokenizer)
    from openk3.posttrain import plots

    plots.plot_rl(run_dir)
    return {"run_dir": str(run_dir), "rows": rows, "wall_s": time.time() - t0}


def update(policy, reference, opt, trajs: list[Trajectory], b0: dict, tau: float, version: int, args: RLArgs,
           pad_id: int) -> dict:
    """One policy-gradient step on complete groups; returns the iteration's metrics."""
    rewards, penalised = [], []
    for t in trajs:
        r, p = budget_reward(t.reward, t.reasoning_tokens, b0[t.task.id], tau)
        rewards.append(r)
        penalised.append(p)
    adv = torch.tensor(group_advantages(rewards, [t.group for t in trajs]))
    b = pad_batch(trajs, pad_id)
    ids, mask = b["ids"].to(args.device), b["mask"].to(args.device)
    logp = token_logprobs(policy, ids)
    with torch.no_grad():
        ref_logp = token_logprobs(reference, ids)
    pg_loss, clip_frac = clipped_pg_loss(logp, b["old"].to(args.device),
                                         adv.to(args.device)[:, None].expand_as(logp), mask, args.clip)
    kl = kl_k3(logp, ref_logp, mask)
    loss = pg_loss + args.kl_coef * kl if args.kl_coef else pg_loss  # 0: exactly the loss without the term
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip or float("inf")))
    opt.step()
    opt.zero_grad()
    n = mask.sum().clamp_min(1)
    m = mask.cpu()
    return {"reward": sum(rewards) / len(rewards), "success": sum(t.success for t in trajs) / len(trajs),
            "reasoning_tokens": sum(t.reasoning_tokens for t in trajs) / len(trajs),
            "budget_penalised": sum(penalised) / len(trajs), "truncated": sum(t.truncated for t in trajs) / len(trajs),
            "staleness": float((version - b["versions"])[m].float().mean()) if m.any() else 0.0,
            "mixed_version": sum(len({v for v, w in zip(t.versions, t.written) if w}) > 1 for t in trajs),
            "kl_to_init": float(((logp.detach() - ref_logp) * mask).sum() / n), "kl_k3_to_init": float(kl.detach()),
            "train_infer_logp_gap": float(((logp.detach() - b["old"].to(logp.device)).abs() * mask).sum() / n),
            "loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()), "clip_frac": float(clip_frac),
            "grad_norm": grad_norm,
            "b0_mean": sum(b0[t.task.id] for t in trajs) / len(trajs)}


def register_commands(sub: argparse._SubParsersAction) -> None:
    d = RLArgs("", "", "general", "high")
    p = sub.add_parser("rl", description="GRPO with a token-budget penalty and partial rollouts, for one "
                                         "(domain, effort) policy.")
    p.add_argument("--init-from", required=True, metavar="DIR", help="checkpoint or run directory (the SFT model)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--domain", required=True, choices=DOMAINS)
    p.add_argument("--effort", required=True, choices=EFFORTS)
    add_fields(p, d, exclude=("init_from", "out", "domain", "effort", "device", "resume"))
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.set_defaults(fn=lambda ns: rl(RLArgs(**{k: v for k, v in vars(ns).items() if k not in ("fn", "command")})))

