"""RL: the budget penalty and effort tiers, group advantages, the clipped token-level loss, a bandit step, partial
rollouts resumed from snapshots, and `openk3 rl` end to end."""

import json
import math
import random

import pytest
import torch

from openk3.cli import main
from openk3.posttrain.envs import make_task
from openk3.posttrain.policy import load_policy, make_engine
from openk3.posttrain.rl import TAU, budget_reward, clipped_pg_loss, group_advantages, pad_batch, update, RLArgs
from openk3.posttrain.rollout import RolloutLimits, Trajectory, advance, start_trajectory


def hand_made(task_reward, reasoning, effort, group=0, tokens=6):
    t = Trajectory(task=make_task("general", random.Random(0)), effort=effort, seed=0, group=group)
    t.tokens = list(range(10, 10 + tokens))
    t.written = [False, False] + [True] * (tokens - 2)
    t.logprobs = [0.0, 0.0] + [-1.0] * (tokens - 2)
    t.versions = [-1, -1] + [0] * (tokens - 2)
    t.reward, t.success, t.reasoning_tokens, t.done = task_reward, task_reward > 0, reasoning, True
    return t


def test_budget_penalty_and_effort_tiers():
    assert TAU["low"] < TAU["high"] < TAU["max"]
    b0 = 20.0
    # 25 reasoning tokens: over budget at low (15) but not at high (30) or max (60)
    assert budget_reward(1.0, 25, b0, TAU["low"]) == (-1.0, True)
    assert budget_reward(1.0, 25, b0, TAU["high"]) == (1.0, False)
    assert budget_reward(0.0, 25, b0, TAU["max"]) == (0.0, False)
    # 45 tokens: penalised at high, fine at max; exactly at the limit is not over
    assert budget_reward(1.0, 45, b0, TAU["high"]) == (-1.0, True)
    assert budget_reward(1.0, 45, b0, TAU["max"]) == (1.0, False)
    assert budget_reward(1.0, 30, b0, 1.5) == (1.0, False) and budget_reward(1.0, 31, b0, 1.5) == (-1.0, True)
    with pytest.raises(ValueError, match="b0"):
        budget_reward(1.0, 3, 0.0, 1.0)


def test_update_applies_the_penalty_to_hand_made_trajectories(policy_dir):
    policy, tok, _ = load_policy(policy_dir)
    reference = load_policy(policy_dir)[0].eval()
    from openk3.train.optim import build_optimizer

    opt = build_optimizer(policy, lr=1e-4, weight_decay=0.0, head_dims={"kda": 16, "mla_q": 24, "mla_kv": 32})
    b0 = {make_task("general", random.Random(0)).id: 10.0}
    trajs = [hand_made(1.0, 5, "low"), hand_made(1.0, 9, "low"), hand_made(0.0, 5, "low"), hand_made(1.0, 30, "low")]
    args = RLArgs("", "", "general", "low")
    m = update(policy, reference, opt, trajs, b0, TAU["low"], version=0, args=args, pad_id=tok.pad_id)
    # limit 7.5: the second and fourth are over budget -> rewards 1, -1, 0, -1
    assert m["budget_penalised"] == 0.5 and m["reward"] == pytest.approx(-0.25) and m["success"] == 0.75
    assert math.isfinite(m["loss"]) and m["staleness"] == 0.0


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], [0, 0, 0, 0, 1, 1])
    mean, std = 0.75, math.sqrt(0.1875)
    assert adv[:4] == pytest.approx([(r - mean) / (std + 1e-6) for r in (1.0, 0.0, 1.0, 1.0)])
    assert adv[4:] == [0.0, 0.0]  # a group with one reward teaches nothing


def test_clipped_loss_matches_its_formula_by_hand():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, False]])
    loss, clipped = clipped_pg_loss(logp, old, adv, mask, clip=0.2)
    # token 0: min(1.5 * 1, 1.2 * 1) = 1.2; token 1: min(0.5 * -1, 0.8 * -1) = -0.8; token 2 masked
    assert float(loss) == pytest.approx(-(1.2 - 0.8) / 2)
    assert float(clipped) == 1.0


def test_policy_gradient_moves_a_bandit_toward_the_rewarded_action():
    torch.manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    p_prev = torch.softmax(logits, 0)[2].item()
    for _ in range(3):
        logp_all = torch.log_softmax(logits, 0)
        actions = torch.multinomial(logp_all.exp().detach(), 16, replacement=True)
        rewards = (actions == 2).float().tolist()
        adv = torch.tensor(group_advantages(rewards, [0] * 16))
        logp = logp_all[actions][:, None]
        loss, _ = clipped_pg_loss(logp, logp.detach(), adv, torch.ones(16, 1, dtype=torch.bool), clip=0.2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        p = torch.softmax(logits, 0)
        assert p[2].item() > p_prev  # every step moves probability toward the rewarded action
        p_prev = p[2].item()
    assert p[2].item() == p.max().item() and p[2].item() > 0.4


LIMITS = RolloutLimits(chunk_tokens=4, max_turn_tokens=14, max_total_tokens=400)


def test_partial_rollout_resume_equals_an_uninterrupted_rollout(policy_dir):
    model, tok, _ = load_policy(policy_dir)
    engine = make_engine(model.eval(), 400, max_batch=4)
    tasks = [make_task("agent", random.Random(i)) for i in range(2)] + [make_task("general", random.Random(9))]
    whole = [start_trajectory(t, "high", tok, seed=11 + i) for i, t in enumerate(tasks)]
    advance(engine, tok, whole, 0, LIMITS)
    assert all(t.done for t in whole)
    parts = [start_trajectory(t, "high", tok, seed=11 + i) for i, t in enumerate(tasks)]
    assert advance(engine, tok, parts, 0, LIMITS, max_rounds=2) == 2
    assert not any(t.done for t in parts) and all(t.env_snapshot is not None for t in parts)
    parts = [Trajectory(**{**t.to_dict(), "task": t.task}) for t in parts]  # plain data: a copy resumes as well
    advance(engine, tok, parts, 0, LIMITS)
    for a, b in zip(whole, parts):
        assert a.tokens == b.tokens and a.written == b.written and a.versions == b.versions
        assert a.reasoning_tokens == b.reasoning_tokens and a.status == b.status
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_resumed_rollout_continues_under_the_new_policy(policy_dir, tokenizer):
    model, tok, _ = load_policy(policy_dir)
    engine = make_engine(model.eval(), 400, max_batch=2)
    (t,) = [start_trajectory(make_task("general", random.Random(1)), "low", tok, seed=5)]
    advance(engine, tok, [t], 0, LIMITS, max_rounds=1)
    with torch.no_grad():
        new = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    engine.load_weights(new)
    advance(engine, tok, [t], 1, LIMITS)
    gen = [v for v, w in zip(t.versions, t.written) if w]
    assert gen[:4] == [0] * 4 and set(gen[4:]) == {1}
    b = pad_batch([t], tok.pad_id)
    assert b["mask"].sum() == len(gen) and b["versions"][b["mask"]].tolist() == gen


def test_rl_command_writes_metrics_and_plots(policy_dir, tmp_path, capsys):
    out = tmp_path / "rl"
    main(["rl", "--init-from", str(policy_dir), "--out", str(out), "--domain", "agent", "--effort", "max",
          "--iterations", "2", "--groups", "2", "--group-size", "2", "--pool", "2", "--b0-samples", "1",
          "--chunk-tokens", "6", "--max-turn-tokens", "12", "--finish-fraction", "0.5", "--kl-coef", "0.1"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if r["trained"]]
    assert trained
    for key in ("reward", "success", "reasoning_tokens", "budget_penalised", "effort", "domain", "truncated",
                "staleness", "kl_to_init", "partial"):
        assert key in trained[0], key
    assert rows[0]["effort"] == "max" and rows[0]["domain"] == "agent"
    assert (out / "plots" / "rl.png").is_file() and (out / "b0.json").is_file()
    assert (out / "checkpoints" / "final" / "config.json").is_file()
    assert json.loads((out / "args.json").read_text())["kl_coef"] == 0.1
    with pytest.raises(SystemExit):
        main(["rl", "--init-from", str(policy_dir), "--out", str(out), "--domain", "agent", "--effort", "max",
              "--resume"])
    assert "already holds a finished run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rl", "--init-from", str(policy_dir), "--out", str(tmp_path / "x"), "--domain", "agent",
              "--effort", "medium"])


class ScriptedEngine:
    """Stands in for the engine in `advance`: writes the scripted expert's agent episode (two tool calls, then the
    answer), at most max_tokens tokens per request, continuing wherever the prompt's current turn stands."""

    def __init__(self, tok, task):
        from openk3.posttrain.synth import solve
        from openk3.text.chat import END, encode_segments, render_xtml

        self.gen = encode_segments(tok, render_xtml([]))  # the generation prompt
        self.turns = [encode_segments(tok, render_xtml([m], add_generation_prompt=False))[len(self.gen):]
                      for m in solve(task, "low") if m["role"] == "assistant"]
        self.end = tok.token_id(END)

    def generate(self, prompts, params):
        from types import SimpleNamespace

        out = []
        for prompt, p in zip(prompts, params):
            n_end = prompt.count(self.end)
            g = len(self.gen)
            start = max(i + g for i in range(len(prompt) - g + 1) if prompt[i:i + g] == self.gen)  # the turn's start
            turn = self.turns[(n_end - self.n0) // 2]
            done = len(prompt) - start
            ids = turn[done:done + p.max_tokens]
            out.append(SimpleNamespace(output=ids, logprobs=[-0.1 * (done + i) for i in range(len(ids))],
                                       error=None, finish_reason="stop" if ids[-1] == self.end else "length"))
        return out


def test_partial_rollout_resumes_across_tool_turns_from_snapshots(tokenizer):
    task = make_task("agent", random.Random(7))
    limits = RolloutLimits(chunk_tokens=7, max_turn_tokens=200, max_total_tokens=2000)
    engine = ScriptedEngine(tokenizer, task)
    whole = start_trajectory(task, "low", tokenizer, seed=3)
    engine.n0 = whole.tokens.count(engine.end)
    advance(engine, tokenizer, [whole], 0, limits)
    assert whole.done and whole.reward == 1.0 and whole.turns == 3 and whole.status == "correct"
    part = start_trajectory(task, "low", tokenizer, seed=3)
    calls, cut_after_tool = 0, False
    while not part.done:  # one round per call: every call resumes in a fresh environment from the snapshot
        advance(engine, tokenizer, [part], calls, limits, max_rounds=1)
        cut_after_tool |= not part.done and part.turns >= 1 and part.env_snapshot["turn"] == part.turns
        calls += 1
    assert cut_after_tool and calls > 3
    assert part.tokens == whole.tokens and part.written == whole.written and part.logprobs == whole.logprobs
    assert part.reward == 1.0 and part.turns == 3 and part.reasoning_tokens == whole.reasoning_tokens
    assert len(set(v for v, w in zip(part.versions, part.written) if w)) == calls  # a version per call


def test_bad_settings_name_the_flag():
    from openk3.posttrain.distill import DistillArgs, distill
    from openk3.posttrain.rl import check_rl_args
    from openk3.posttrain.sft import SFTArgs, sft

    # a negative --grad-clip would reach clip_grad_norm_, which then flips the gradient's sign
    for bad, message in ((dict(grad_clip=-1.0), "--grad-clip=-1.0: must be >= 0"),
                         (dict(clip=float("nan")), "--clip=nan: must be > 0"), (dict(pool=0), "--pool=0")):
        with pytest.raises(ValueError, match=message):
            check_rl_args(RLArgs("", "", "general", "low", **bad))
    with pytest.raises(ValueError, match="--grad-clip=-0.5"):
        sft(SFTArgs("", "", "", grad_clip=-0.5))
    with pytest.raises(ValueError, match="--warmup=1.0"):
        sft(SFTArgs("", "", "", warmup=1.0))
    with pytest.raises(ValueError, match="--clip=0.0: must be > 0"):
        distill(DistillArgs("", "", "", clip=0.0))


def test_kl_k3_against_a_hand_computation():
    from openk3.posttrain.rl import kl_k3

    # pi = 0.5 and 0.2, pi_ref = 0.25 and 0.4 (ratios pi_ref / pi = 0.5 and 2); the third token is masked out
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    kl = kl_k3(logp, ref, mask)
    # k3 = r - 1 - log r: (0.5 - 1 + log 2) + (2 - 1 - log 2) = 0.5 over 2 tokens
    assert float(kl.detach()) == pytest.approx(0.25, rel=1e-6)
    kl.backward()  # d k3 / d log pi = 1 - r, over 2 tokens
    assert logp.grad.tolist()[0] == pytest.approx([0.25, -0.5, 0.0], rel=1e-6)
    assert float(kl_k3(ref, ref, mask)) == 0.0


def test_kl_coef_adds_the_k3_term_and_zero_leaves_the_loss_alone(policy_dir):
    from openk3.train.optim import build_optimizer

    b0 = {make_task("general", random.Random(0)).id: 10.0}
    trajs = [hand_made(1.0, 5, "low"), hand_made(1.0, 9, "low"), hand_made(0.0, 5, "low"), hand_made(1.0, 30, "low")]
    heads = {"kda": 16, "mla_q": 24, "mla_kv": 32}
    out = {}
    for coef in (0.0, 0.5):
        policy, tok, _ = load_policy(policy_dir)
        reference = load_policy(policy_dir)[0].eval()
        with torch.no_grad():  # a policy away from its reference, so the KL is not 0
            for p in reference.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        opt = build_optimizer(policy, lr=1e-4, weight_decay=0.0, head_dims=heads)
        args = RLArgs("", "", "general", "low", kl_coef=coef)
        out[coef] = update(policy, reference, opt, trajs, b0, TAU["low"], version=0, args=args, pad_id=tok.pad_id)
    assert out[0.0]["loss"] == out[0.0]["pg_loss"] and out[0.0]["kl_k3_to_init"] > 0
    assert out[0.5]["pg_loss"] == pytest.approx(out[0.0]["pg_loss"], rel=1e-6)
    assert out[0.5]["loss"] == pytest.approx(out[0.5]["pg_loss"] + 0.5 * out[0.5]["kl_k3_to_init"], rel=1e-5)
    assert out[0.5]["grad_norm"] != pytest.approx(out[0.0]["grad_norm"], rel=1e-3)  # the term reaches the gradient
    with pytest.raises(ValueError, match="--kl-coef=-1"):
        from openk3.posttrain.rl import check_rl_args

        check_rl_args(RLArgs("", "", "general", "low", kl_coef=-1.0))


def test_a_prompt_longer_than_the_token_limit_is_named(policy_dir):
    policy, tok, _ = load_policy(policy_dir)
    t = start_trajectory(make_task("agent", random.Random(0)), "high", tok, seed=0)
    with pytest.raises(ValueError, match=f"has {len(t.tokens)} tokens, no room below --max-total-tokens=20"):
        advance(make_engine(policy.eval(), 64), tok, [t], 0, RolloutLimits(max_total_tokens=20))
