"""`openk3 distill`: Multi-Teacher On-Policy Distillation (MOPD, K3_SPEC section 8) of the nine (domain, effort)
policies into one student, and the report that compares them.

    openk3 distill --student runs/pt/sft --teachers runs/pt/rl --out runs/pt/distill --iterations 8

`--teachers ROOT` holds one run directory per policy, ROOT/<domain>-<effort> (what `openk3 rl` writes there).
One iteration: for every domain and effort the student samples `--samples` trajectories on `--prompts` prompts
(effort through the thinking-effort system message); the matching teacher, served by its own engine, scores the
student's tokens (`Engine.score`); each student-written token y_t gets the reward

    r_t = clip(log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t), -R, R)

(a per-token reverse-KL reward, positive where the teacher likes the token more than the student does), used as a
per-token advantage in the same clipped surrogate as RL (`rl.clipped_pg_loss`), against the log-probs of the
student that sampled it. After training, every teacher, the starting student and the distilled student are
evaluated on held-out prompts of each domain and effort: task success and mean reasoning tokens
(report.json, report.md, plots/report.png). Every `--ckpt-every` iterations a checkpoint (weights, optimizer, RNG,
the iteration) lets `--resume` continue a killed run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from openk3.model.checkpoint import CHECKPOINTS, LATEST, find_checkpoint
from openk3.posttrain.envs import DOMAINS, make_task
from openk3.posttrain.policy import (add_fields, check_fields, is_finished, load_policy, load_state, log_metrics,
                                     make_engine, save_policy, save_state, start_run, token_logprobs)
from openk3.posttrain.rl import clipped_pg_loss, pad_batch
from openk3.posttrain.rollout import RolloutLimits, _seed, advance, start_trajectory
from openk3.text.chat import EFFORTS
from openk3.train.optim import build_optimizer, model_head_dims
from openk3.train.trainer import write_json, write_text_atomic

COMBOS = [(d, e) for d in DOMAINS for e in EFFORTS]


def mopd_rewards(teacher_logp: Tensor, student_logp: Tensor, R: float) -> Tensor:
    """clip(log p_teacher - log p_student, -R, R), elementwise."""
    if R <= 0:
        raise ValueError(f"R={R}: the reward clip must be > 0")
    return (teacher_logp - student_logp).clamp(-R, R)


def teacher_dirs(root: str | Path) -> dict[tuple[str, str], Path]:
    """ROOT/<domain>-<effort> for all nine policies (finished run directories or checkpoints); an error names every
    one that is missing or unfinished."""
    root = Path(root)
    found, missing = {}, []
    for d, e in COMBOS:
        run = root / f"{d}-{e}"
        # NOTE: not find_checkpoint alone: a killed `openk3 rl` run names its last step checkpoint
        if (run / CHECKPOINTS / LATEST).is_file() and not is_finished(run):
            missing.append(f"{d}-{e} (unfinished: resume it with `openk3 rl --resume`)")
            continue
        try:
            found[(d, e)] = find_checkpoint(run)
        except FileNotFoundError:
            missing.append(f"{d}-{e}")
    if missing:
        raise FileNotFoundError(f"--teachers {root}: no finished policy for {', '.join(missing)} "
                                f"(expected run directories {root}/<domain>-<effort> from `openk3 rl`)")
    return found


@dataclass
class DistillArgs:
    student: str
    teachers: str
    out: str
    iterations: int = 8
    prompts: int = 1  # per domain and effort per iteration
    samples: int = 2  # per prompt
    reward_clip: float = 5.0  # R
    lr: float = 1e-3
    clip: float = 0.2
    chunk_tokens: int = 32
    max_turn_tokens: int = 96
    max_total_tokens: int = 640
    eval_prompts: int = 16  # held-out prompts per domain and effort for the report (0 = no report)
    grad_clip: float = 1.0
    ckpt_every: int = 1  # iterations between resumable checkpoints (checkpoints/step_N)
    keep_last: int = 1
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    resume: bool = False


def evaluate(engine, tokenizer, tasks_by_domain: dict, combos: list[tuple[str, str]], limits: RolloutLimits,
             seed: int) -> dict[str, dict]:
    """Success rate, mean reasoning tokens and truncated fraction of one policy on held-out tasks, per
    "<domain>-<effort>" of `combos` (sampled at temperature 1 with fixed seeds, so every model sees the same prompts
    and seeds). All the combos' rollouts advance together: one batch of rounds, not one after another (the report
    rates the SFT start and the student on all nine combos)."""
    runs = {}
    for domain, effort in combos:
        runs[f"{domain}-{effort}"] = [start_trajectory(t, effort, tokenizer, seed=_seed(seed, "eval", i))
                                      for i, t in enumerate(tasks_by_domain[domain])]
    advance(engine, tokenizer, [t for trajs in runs.values() for t in trajs], 0, limits)
    return {name: {"success": sum(t.success for t in trajs) / len(trajs),
                   "reasoning_tokens": sum(t.reasoning_tokens for t in trajs) / len(trajs),
                   "truncated": sum(t.truncated for t in trajs) / len(trajs), "n": len(trajs)}
            for name, trajs in runs.items()}


def distill(args: DistillArgs) -> dict:
    check_fields(args, counts=("iterations", "prompts", "samples", "threads", "ckpt_every", "keep_last"),
                 positive=("reward_clip", "lr", "clip"), non_negative=("grad_clip", "eval_prompts"))
    t0 = time.time()
    torch.set_num_threads(args.threads)
    dirs = teacher_dirs(args.teachers)
    student, tokenizer, student_dir = load_policy(args.student, args.device)
    run_dir, ckpt = start_run(args.out, dataclasses.asdict(args), resume=args.resume)
    limits = RolloutLimits(args.chunk_tokens, args.max_turn_tokens, args.max_total_tokens)
    teachers = {}
    for combo, d in dirs.items():
        model, tok, _ = load_policy(d, args.device)
        if tok.fingerprint() != tokenizer.fingerprint():
            raise ValueError(f"teacher {d} has a different tokenizer from the student {student_dir}")
        # batch room for the report's evaluation rollouts; scoring runs one sequence at a time
        teachers[combo] = make_engine(model.eval().requires_grad_(False), args.max_total_tokens,
                                      max_batch=max(args.eval_prompts, 1))
    initial = copy.deepcopy(student).eval().requires_grad_(False)
    n_rollouts = len(COMBOS) * args.prompts * args.samples
    # room for the training rollouts and for the report's rollouts of all nine combos at once
    engine = make_engine(copy.deepcopy(student).eval(), args.max_total_tokens,
                         max_batch=max(n_rollouts, len(COMBOS) * args.eval_prompts))
    student.train()
    opt = build_optimizer(student, lr=args.lr, weight_decay=0.0, head_dims=model_head_dims(student.config))
    rng = random.Random(args.seed)
    start, elapsed_before = 0, 0.0
    if ckpt:
        state = load_state(ckpt)
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        engine.load_weights(student.state_dict())
        start, elapsed_before = state["step"], state["elapsed_s"]
        print(f"distill: resumed from {ckpt} at iteration {start}", flush=True)
    for it in range(start, args.iterations):
        trajs = []
        for d, e in COMBOS:
            for p in range(args.prompts):
                task = make_task(d, rng)
                trajs += [start_trajectory(task, e, tokenizer, seed=_seed(args.seed, it, d, e, p, j))
                          for j in range(args.samples)]
        advance(engine, tokenizer, trajs, it, limits)
        b = pad_batch(trajs, tokenizer.pad_id)
        mask = b["mask"]
        teacher_lp = torch.zeros_like(b["old"])
        for i, t in enumerate(trajs):
            teacher_lp[i, :len(t.tokens) - 1] = torch.tensor(teachers[(t.task.domain, t.effort)].score(t.tokens))
        reward = mopd_rewards(teacher_lp, b["old"], args.reward_clip) * mask
        logp = token_logprobs(student, b["ids"].to(args.device))
        loss, clip_frac = clipped_pg_loss(logp, b["old"].to(args.device), reward.to(args.device),
                                          mask.to(args.device), args.clip)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(student.parameters(), args.grad_clip or float("inf")))
        opt.step()
        opt.zero_grad()
        engine.load_weights(student.state_dict())
        n = mask.sum().clamp_min(1)
        row = {"step": it + 1, "reverse_kl": float(((b["old"] - teacher_lp) * mask).sum() / n),
               "token_reward": float(reward.sum() / n), "loss": float(loss.detach()), "clip_frac": float(clip_frac),
               "grad_norm": grad_norm, "success": sum(t.success for t in trajs) / len(trajs),
               "reasoning_tokens": sum(t.reasoning_tokens for t in trajs) / len(trajs),
               "by_combo": {f"{d}-{e}": _combo_kl([t for t in trajs if (t.task.domain, t.effort) == (d, e)],
                                                  trajs, b["old"] - teacher_lp, mask) for d, e in COMBOS},
               "elapsed_s": elapsed_before + time.time() - t0}
        log_metrics(run_dir, row)
        print(f"distill iter {it + 1}/{args.iterations}: reverse KL {row['reverse_kl']:.4f}, token reward "
              f"{row['token_reward']:.4f}, success {row['success']:.2f}", flush=True)
        if (it + 1) % args.ckpt_every == 0 and it + 1 < args.iterations:
            save_state(run_dir, it + 1, student, tokenizer, args, {
                "step": it + 1, "elapsed_s": row["elapsed_s"], "model": student.state_dict(),
                "optimizer": opt.state_dict(), "rng": {"python": rng.getstate(), "torch": torch.get_rng_state()}})
    save_policy(run_dir, student, tokenizer)
    report = None
    if args.eval_prompts > 0:
        report = make_report(args, run_dir, tokenizer, initial, engine, teachers, limits)
    return {"run_dir": str(run_dir), "report": report, "wall_s": time.time() - t0}


def _combo_kl(mine, trajs, diff, mask) -> float:
    rows = [trajs.index(t) for t in mine]
    m = mask[rows]
    return float((diff[rows] * m).sum() / m.sum().clamp_min(1))


def make_report(args: DistillArgs, run_dir: Path, tokenizer, initial, student_engine, teachers, limits) -> dict:
    """Every teacher on its own domain and effort, the starting student (SFT) and the distilled student on all."""
    rng = random.Random(args.seed + 1_000_003)  # held out: not the training stream's tasks
    tasks = {d: [make_task(d, rng) for _ in range(args.eval_prompts)] for d in DOMAINS}
    # the SFT start and the student on all nine combos at once (a batch of 9 x eval_prompts), each teacher on its own
    sft_engine = make_engine(initial, args.max_total_tokens, max_batch=len(COMBOS) * args.eval_prompts)
    sft = evaluate(sft_engine, tokenizer, tasks, COMBOS, limits, args.seed)
    student = evaluate(student_engine, tokenizer, tasks, COMBOS, limits, args.seed)
    results = {}
    for d, e in COMBOS:
        name = f"{d}-{e}"
        results[name] = {"sft": sft[name], "student": student[name],
                         "teacher": evaluate(teachers[(d, e)], tokenizer, tasks, [(d, e)], limits, args.seed)[name]}
    report = {"eval_prompts": args.eval_prompts, "results": results}
    write_json(run_dir / "report.json", report)
    write_text_atomic(run_dir / "report.md", report_table(report))
    from openk3.posttrain import plots

    (run_dir / "plots").mkdir(exist_ok=True)
    plots.plot_report(report, run_dir / "plots" / "report.png")
    print(report_table(report))
    return report


def report_table(report: dict) -> str:
    lines = [f"success rate / mean reasoning tokens on {report['eval_prompts']} held-out prompts per row",
             "", "| domain-effort | SFT start | teacher (RL) | distilled student |", "|---|---|---|---|"]
    for combo, r in report["results"].items():
        cells = [f"{r[m]['success']:.2f} / {r[m]['reasoning_tokens']:.1f}" for m in ("sft", "teacher", "student")]
        lines.append(f"| {combo} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def register_commands(sub: argparse._SubParsersAction) -> None:
    d = DistillArgs("", "", "")
    p = sub.add_parser("distill", description="Multi-teacher on-policy distillation of the nine domain/effort "
                                              "policies into one student; then a per domain/effort report.")
    p.add_argument("--student", required=True, metavar="DIR", help="the student's starting checkpoint (the SFT model)")
    p.add_argument("--teachers", required=True, metavar="ROOT", help="directory with <domain>-<effort> RL runs")
    p.add_argument("--out", required=True, help="run directory")
    add_fields(p, d, exclude=("student", "teachers", "out", "device", "resume"))
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.set_defaults(fn=lambda ns: distill(DistillArgs(**{k: v for k, v in vars(ns).items()
                                                        if k not in ("fn", "command")})))
