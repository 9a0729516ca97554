"""Synthetic SFT trajectories for the three domains (no downloads): a scripted expert solves each task through its
environment, with reasoning whose length follows the thinking effort (low < none < high < max), so that SFT
teaches both the XTML format (think channel, tool calls, responses) and effort-dependent reasoning length, which
the RL budget penalty then acts on.

    openk3 posttrain-data --out runs/pt/sft.jsonl --n 3000      # one JSON object per line:
    {"domain": "agent", "effort": "high", "tools": [...], "messages": [user, assistant, tool, ..., assistant]}
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from openk3.posttrain.envs import DOMAINS, OPS, SIGNS, Task, make_env, make_task
from openk3.text.chat import EFFORTS

SFT_EFFORTS = (None,) + EFFORTS  # None: no thinking-effort message (the default effort)


def _sum_steps(xs: list[int]) -> list[str]:
    steps, total = [], xs[0]
    for x in xs[1:]:
        steps.append(f"{total}+{x}={total + x}.")
        total += x
    return steps


def general_reasoning(xs: list[int], effort: str | None) -> str:
    steps, total = _sum_steps(xs), sum(xs)
    if effort == "low":
        return " ".join(steps)
    if effort is None:
        return " ".join(steps) + f" The answer is {total}."
    check = " ".join(_sum_steps(xs[::-1]))
    if effort == "high":
        return " ".join(steps) + f" Check: {check} The answer is {total}."
    return (f"I add the numbers one at a time. {' '.join(steps)} Now I check in the other order. {check} "
            f"Both give {total}. The answer is {total}.")


def agent_reasoning(turn: int, a: str, b: str, seen: dict, effort: str | None) -> str:
    if turn == 0:
        return {"low": f"Count {a}.", None: f"I need {a} and {b}. First {a}.",
                "high": f"I need the count of {a} and of {b}. First I ask for {a}.",
                "max": f"The store has hidden stock, so I must ask. I need the count of {a} and of {b}, then add "
                       f"them. First I ask for {a}."}[effort]
    if turn == 1:
        n = seen[a]
        return {"low": f"Now {b}.", None: f"{a}: {n}. Now {b}.", "high": f"There are {n} {a}. Now I ask for {b}.",
                "max": f"The tool says {n} {a}. I still need {b}, so I ask for {b} next."}[effort]
    x, y = seen[a], seen[b]
    return {"low": f"{x}+{y}={x + y}.", None: f"{a} {x}, {b} {y}. {x}+{y}={x + y}.",
            "high": f"{a} {x}, {b} {y}. {x}+{y}={x + y}. Check: {y}+{x}={x + y}.",
            "max": f"I have both counts: {a} {x} and {b} {y}. {x}+{y}={x + y}. Check: {y}+{x}={x + y}. "
                   f"The total is {x + y}."}[effort]


def coding_reasoning(op: str, k: int, effort: str | None) -> str:
    sign = SIGNS[op]
    verb = {"plus": "add", "minus": "subtract", "times": "multiply by"}[op]
    if effort == "low":
        return f"return x {sign} {k}."
    if effort is None:
        return f"f must {verb} {k}, so return x {sign} {k}."
    example = f"For x=2 it gives {OPS[op](2, k)}."
    if effort == "high":
        return f"f must {verb} {k}. {example} So return x {sign} {k}."
    return (f"The task asks for f(x) = x {op} {k}, so f must {verb} {k}. {example} For x=0 it gives "
            f"{OPS[op](0, k)}. So the body is return x {sign} {k}.")


def solve(task: Task, effort: str | None) -> list[dict]:
    """The expert's whole conversation for `task`, run through the task's environment (tool results come from it).
    Raises if the expert's answer does not earn reward 1 (except coding, whose sandbox run the tests check)."""
    env = make_env(task.domain)
    messages = env.reset(task)
    spec = task.spec
    if task.domain == "general":
        turns = [{"reasoning_content": general_reasoning(spec["operands"], effort), "content": str(spec["answer"])}]
    elif task.domain == "agent":
        a, b = spec["ask"]
        turns, seen = [], {}
        for turn, item in enumerate((a, b, None)):
            msg = {"reasoning_content": agent_reasoning(turn, a, b, seen, effort), "content": ""}
            if item is not None:
                msg["tool_calls"] = [{"id": f"functions.count:{turn}", "type": "function",
                                      "function": {"name": "count", "arguments": json.dumps({"item": item})}}]
                seen[item] = spec["stock"][item]
            else:
                msg["content"] = str(spec["answer"])
            turns.append(msg)
    else:
        sign = SIGNS[spec["op"]]
        turns = [{"reasoning_content": coding_reasoning(spec["op"], spec["k"], effort),
                  "content": f"def f(x):\n    return x {sign} {spec['k']}"}]
    for msg in turns:
        msg = {"role": "assistant", **msg}
        messages.append(msg)
        if task.domain == "coding":
            break  # the tests run the sandbox; generation does not need to
        result = env.step(msg)
        messages += result.messages
        if result.done and result.reward != 1.0:
            raise AssertionError(f"the scripted expert failed {task.id}: {result.info}")
    return messages


def generate(n: int, seed: int = 0) -> list[dict]:
    """`n` trajectories, domains and efforts in turn (so every mix is balanced), tasks drawn from `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        domain = DOMAINS[i % len(DOMAINS)]
        effort = SFT_EFFORTS[(i // len(DOMAINS)) % len(SFT_EFFORTS)]
        task = make_task(domain, rng)
        rows.append({"domain": domain, "effort": effort, "tools": make_env(domain).tools, "task": task.id,
                     "messages": solve(task, effort)})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def cmd_data(args: argparse.Namespace) -> None:
    if args.n < 1:
        raise ValueError(f"--n={args.n}: must be a positive number of trajectories")
    rows = generate(args.n, args.seed)
    write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} trajectories ({', '.join(DOMAINS)} x effort none/low/high/max) to {args.out}")


def register_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("posttrain-data", description="Write synthetic SFT trajectories for the three domains.")
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--n", type=int, default=3000, help="number of trajectories [3000]")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_data)
