"""Tasks and environments with verifiable rewards in K3's three post-training domains (K3_SPEC section 8):

    general   addition of two digits; the response must be the sum
    agent     a store with hidden stock: the model calls the `count` tool (in XTML) for two items, reads the
              results and answers their total; the stock is hidden state only the tool reveals
    coding    write `f(x)`; the response's code is run against hidden tests in the subprocess sandbox (sandbox.py)

    task = make_task("agent", random.Random(0))
    env = make_env(task.domain)
    messages = env.reset(task)                 # the conversation's first messages (OpenAI-style dicts)
    result = env.step(assistant_message)       # StepResult(messages, reward, done, info)
    snap = env.snapshot(); env2 = make_env("agent"); env2.restore(snap)   # resume a partial rollout elsewhere

Snapshots are plain data (dicts of ints and strings): an unfinished episode is resumed in the next RL iteration
from its snapshot, on any environment worker, instead of being replayed (K3's AgentENV).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import asdict, dataclass

from openk3.posttrain.sandbox import run_python

DOMAINS = ("general", "agent", "coding")
ITEMS = ("apples", "pears", "plums", "figs", "limes", "kiwis")
SIGNS = {"plus": "+", "minus": "-", "times": "*"}
OPS = {"plus": (lambda x, k: x + k), "minus": (lambda x, k: x - k), "times": (lambda x, k: x * k)}
CODING_TESTS = (0, 1, 2, 5, -3)


@dataclass
class Task:
    """One prompt of a domain. `spec` holds what the checker needs (the sum; the hidden stock; the function)."""

    domain: str
    id: str
    prompt: str
    spec: dict

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Task:
        return Task(**d)


def make_task(domain: str, rng: random.Random) -> Task:
    """A random task of `domain` drawn from `rng`."""
    if domain == "general":
        xs = [rng.randrange(1, 10) for _ in range(2)]
        return Task("general", "g-" + "+".join(map(str, xs)), f"Compute {' + '.join(map(str, xs))}.",
                    {"operands": xs, "answer": sum(xs)})
    if domain == "agent":
        stock = {item: rng.randrange(0, 10) for item in ITEMS}
        a, b = rng.sample(ITEMS, 2)
        return Task("agent", f"a-{a}-{b}-" + "".join(str(stock[i]) for i in ITEMS),
                    f"How many {a} and {b} are there in total?", {"stock": stock, "ask": [a, b],
                                                                   "answer": stock[a] + stock[b]})
    if domain == "coding":
        op, k = rng.choice(sorted(OPS)), rng.randrange(1, 10)
        return Task("coding", f"c-{op}-{k}", f"Write a Python function f(x) that returns x {op} {k}.",
                    {"op": op, "k": k})
    raise ValueError(f"unknown domain {domain!r}; expected one of {list(DOMAINS)}")


@dataclass
class StepResult:
    messages: list[dict]  # what the environment says next (tool results); empty when the episode is done
    reward: float
    done: bool
    info: dict


class Env:
    """reset / step / snapshot / restore. The state is one dict (`self.state`) of plain data, so a snapshot is a
    copy of it. Subclasses implement `_step`."""

    domain = ""
    tools: list | None = None
    max_turns = 1

    def __init__(self):
        self.state: dict | None = None

    def reset(self, task: Task) -> list[dict]:
        if task.domain != self.domain:
            raise ValueError(f"a {task.domain!r} task given to the {self.domain!r} environment")
        self.state = {"task": task.to_dict(), "turn": 0, "done": False, "log": []}
        return [{"role": "user", "content": task.prompt}]

    @property
    def task(self) -> Task:
        return Task.from_dict(self.state["task"])

    def step(self, message: dict) -> StepResult:
        """Take the assistant's message ({"content", "reasoning_content", "tool_calls"}): the environment's reply."""
        if self.state is None or self.state["done"]:
            raise RuntimeError("step() on an environment that is not running: call reset() (or restore()) first")
        self.state["turn"] += 1
        result = self._step(message)
        if not result.done and self.state["turn"] >= self.max_turns:
            result = StepResult([], 0.0, True, {**result.info, "status": "out of turns"})
        self.state["done"] = result.done
        self.state["log"].append({"turn": self.state["turn"], "reward": result.reward, **result.info})
        return result

    def _step(self, message: dict) -> StepResult:
        raise NotImplementedError

    def snapshot(self) -> dict:
        return copy.deepcopy(self.state)

    def restore(self, snapshot: dict) -> None:
        if snapshot.get("task", {}).get("domain") != self.domain:
            raise ValueError(f"a snapshot of a {snapshot.get('task', {}).get('domain')!r} episode restored into the "
                             f"{self.domain!r} environment")
        self.state = copy.deepcopy(snapshot)


def _answer(message: dict) -> str:
    return (message.get("content") or "").strip()


class GeneralEnv(Env):
    domain = "general"

    def _step(self, message: dict) -> StepResult:
        ok = _answer(message) == str(self.task.spec["answer"])
        return StepResult([], float(ok), True, {"status": "correct" if ok else "wrong"})


COUNT_TOOL = {"type": "function", "function": {
    "name": "count", "description": "How many of an item the store has.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}


class AgentEnv(Env):
    """The store: `count(item)` returns the hidden stock of an item; the answer is the asked items' total."""

    domain = "agent"
    tools = [COUNT_TOOL]
    max_turns = 4

    def _step(self, message: dict) -> StepResult:
        calls = message.get("tool_calls") or []
        if not calls:
            ok = _answer(message) == str(self.task.spec["answer"])
            return StepResult([], float(ok), True, {"status": "correct" if ok else "wrong"})
        stock = self.task.spec["stock"]
        replies = []
        for call in calls:
            fn = call["function"]
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if fn["name"] != "count" or not isinstance(args, dict) or args.get("item") not in stock:
                result = f"error: count needs item, one of {', '.join(ITEMS)}"
            else:
                result = str(stock[args["item"]])
            replies.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return StepResult(replies, 0.0, False, {"status": "tool", "calls": len(calls)})


def coding_tests(spec: dict) -> str:
    """The hidden tests of a coding task (asserts on f). NOTE: the exact type first: a result whose __eq__ always
    says True would otherwise pass every test (the sandbox runs the tests with the genuine builtins)."""
    fn = OPS[spec["op"]]
    return "".join(f"assert type(f({x})) is int and f({x}) == {fn(x, spec['k'])}\n" for x in CODING_TESTS)


def extract_code(text: str) -> str:
    """The code in a response: the body of its first ``` fence, else the whole text."""
    start = text.find("```")
    if start < 0:
        return text
    body = text[start + 3:]
    newline = body.find("\n")
    body = body[newline + 1:] if newline >= 0 else ""
    end = body.find("```")
    return body if end < 0 else body[:end]


class CodingEnv(Env):
    domain = "coding"

    def __init__(self, time_limit: float = 2.0, memory_mb: int = 256):
        super().__init__()
        self.time_limit, self.memory_mb = time_limit, memory_mb

    def _step(self, message: dict) -> StepResult:
        result = run_python(extract_code(_answer(message)), coding_tests(self.task.spec), time_limit=self.time_limit,
                            memory_mb=self.memory_mb)
        return StepResult([], float(result.passed), True, {"status": result.status})


ENVS = {"general": GeneralEnv, "agent": AgentEnv, "coding": CodingEnv}


def make_env(domain: str) -> Env:
    if domain not in ENVS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {list(DOMAINS)}")
    return ENVS[domain]()
