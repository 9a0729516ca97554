"""Rollouts: trajectories sampled by the inference engine, stepped through their environments, resumable.

    traj = start_trajectory(task, effort="high", tokenizer=tok, seed=7)     # the XTML prompt, an env snapshot
    advance(engine, tok, [traj, ...], version=3, limits=RolloutLimits(), finish_fraction=0.75)

A `Trajectory` is all the state of an episode as plain data: the conversation's token ids (prompt, generated and
environment tokens), per token whether the policy wrote it, its behaviour log-probability (under the raw logits
of the policy that sampled it, `Request.logprobs`) and that policy's version, and the environment's snapshot.
`advance` generates in chunks of at most `limits.chunk_tokens` tokens per request; after each round it steps the
environments of the turns that ended. It returns once `finish_fraction` of the trajectories are done (K3's
partial rollouts, K3_SPEC section 8): the rest keep their tokens and environment snapshot and continue in a later
call, possibly under a newer policy (their tokens then carry mixed versions). Environments live only inside one
call: each resumes from its snapshot in a fresh environment, as it would on another worker.

NOTE: chunk r of a trajectory samples with the seed (trajectory seed, tokens so far), so a trajectory interrupted
between rounds and resumed under the same policy samples exactly the tokens of an uninterrupted rollout.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from openk3.posttrain.envs import Task, make_env
from openk3.serve.engine import Engine
from openk3.serve.sampler import SamplingParams
from openk3.text.chat import XTML_MARKERS, chat_stop_ids, encode_segments, parse_output_ids, render_xtml


@dataclass
class RolloutLimits:
    chunk_tokens: int = 32  # tokens per request per round (a partial rollout stops between rounds)
    max_turn_tokens: int = 96  # an assistant turn longer than this is truncated (episode over, reward 0)
    max_total_tokens: int = 640  # whole conversation
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.temperature != 1.0:
            # NOTE: Request.logprobs are under the raw logits; the policy gradient needs the sampling distribution's.
            raise ValueError(f"temperature={self.temperature}: rollouts sample at temperature 1, whose log-"
                             f"probabilities are the engine's raw-logit ones")


@dataclass
class Trajectory:
    task: Task
    effort: str | None
    seed: int
    group: int = 0
    tokens: list[int] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)  # the policy generated this token
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob (0.0 for context tokens)
    versions: list[int] = field(default_factory=list)  # policy version that sampled it (-1 for context)
    env_snapshot: dict | None = None
    turn_start: int = 0  # index in `tokens` where the current assistant turn's generated tokens begin
    reasoning_tokens: int = 0  # think-channel tokens over all turns
    in_reasoning: bool = True
    turns: int = 0
    done: bool = False
    reward: float = 0.0  # the task reward (the RL reward adds the budget penalty, rl.py)
    success: bool = False
    truncated: bool = False
    status: str = ""
    started_version: int = 0

    @property
    def generated(self) -> int:
        return sum(self.written)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        return cls(**{**d, "task": Task.from_dict(d["task"])})


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def start_trajectory(task: Task, effort: str | None, tokenizer, seed: int, group: int = 0,
                     version: int = 0) -> Trajectory:
    """A new episode: the environment is reset and snapshotted, the prompt rendered (with the thinking-effort system
    message when `effort` is given) and encoded segment by segment."""
    env = make_env(task.domain)
    messages = env.reset(task)
    ids = encode_segments(tokenizer, render_xtml(messages, tools=env.tools, effort=effort))
    t = Trajectory(task=task, effort=effort, seed=seed, group=group, env_snapshot=env.snapshot(),
                   started_version=version)
    _append_context(t, ids)
    t.turn_start = len(t.tokens)
    return t


def _append_context(t: Trajectory, ids: list[int]) -> None:
    t.tokens += ids
    t.written += [False] * len(ids)
    t.logprobs += [0.0] * len(ids)
    t.versions += [-1] * len(ids)


def _continuation(assistant: dict, replies: list[dict]) -> list:
    """The segments after an assistant message: the environment's tool messages and the next generation prompt.
    Rendered with the assistant message before them (tool names and indices need it), then that part dropped."""
    alone = render_xtml([assistant], add_generation_prompt=False)
    both = render_xtml([assistant] + replies, add_generation_prompt=True)
    if both[:len(alone)] != alone:
        raise AssertionError("the tool messages' rendering does not extend the assistant message's")
    return both[len(alone):]


def _end(t: Trajectory, reward: float, status: str, truncated: bool = False) -> None:
    t.done, t.reward, t.success, t.status, t.truncated = True, reward, reward > 0, status, truncated
    t.env_snapshot = None


def advance(engine: Engine, tokenizer, trajs: list[Trajectory], version: int, limits: RolloutLimits,
            finish_fraction: float = 1.0, max_rounds: int | None = None) -> int:
    """Generate until at least `finish_fraction` of `trajs` are done (or `max_rounds` rounds ran); returns the
    rounds run. Unfinished trajectories keep their snapshot for the next call."""
    if not 0 < finish_fraction <= 1:
        raise ValueError(f"finish_fraction={finish_fraction}: must be in (0, 1]")
    stops = chat_stop_ids(tokenizer)
    markers = {tokenizer.token_id(m) for m in XTML_MARKERS}
    envs = {}
    for t in trajs:
        if not t.done and len(t.tokens) >= limits.max_total_tokens:
            raise ValueError(f"the prompt of task {t.task.id} has {len(t.tokens)} tokens, no room below "
                             f"--max-total-tokens={limits.max_total_tokens}; raise it")
        if not t.done:
            envs[id(t)] = env = make_env(t.task.domain)
            env.restore(t.env_snapshot)
    rounds = 0
    need = finish_fraction * len(trajs)
    while sum(t.done for t in trajs) < need - 1e-9 and (max_rounds is None or rounds < max_rounds):
        active = [t for t in trajs if not t.done]
        params = []
        for t in active:
            left = min(limits.chunk_tokens, limits.max_turn_tokens - (len(t.tokens) - t.turn_start),
                       limits.max_total_tokens - len(t.tokens))
            params.append(SamplingParams(max_tokens=left, temperature=limits.temperature,
                                         seed=_seed(t.seed, len(t.tokens)), stop_token_ids=stops))
        reqs = engine.generate([t.tokens for t in active], params)
        rounds += 1
        for t, req in zip(active, reqs):
            if req.error is not None:
                raise RuntimeError(f"the engine failed a rollout of {t.task.id}: {req.error}")
            for tok in req.output:
                if t.in_reasoning and tok in markers:
                    t.in_reasoning = False  # reasoning ends at the first marker (K3_SPEC section 9)
                elif t.in_reasoning:
                    t.reasoning_tokens += 1
            t.tokens += req.output
            t.written += [True] * len(req.output)
            t.logprobs += req.logprobs
            t.versions += [version] * len(req.output)
            if req.finish_reason == "stop":
                _finish_turn(t, envs[id(t)], tokenizer, limits)
            elif len(t.tokens) - t.turn_start >= limits.max_turn_tokens or len(t.tokens) >= limits.max_total_tokens:
                _end(t, 0.0, "truncated", truncated=True)
    for t in trajs:
        if not t.done:
            t.env_snapshot = envs[id(t)].snapshot()
    return rounds


def _finish_turn(t: Trajectory, env, tokenizer, limits: RolloutLimits) -> None:
    env_tools = env.tools
    parsed = parse_output_ids(tokenizer, t.tokens[t.turn_start:], tools_declared=bool(env_tools))
    message = {"role": "assistant", "reasoning_content": parsed.reasoning_content, "content": parsed.content,
               "tool_calls": parsed.tool_calls}
    result = env.step(message)
    t.turns += 1
    if result.done:
        _end(t, result.reward, result.info.get("status", ""))
        return
    ids = encode_segments(tokenizer, _continuation({k: v for k, v in message.items() if v}, result.messages))
    if len(t.tokens) + len(ids) >= limits.max_total_tokens:
        _end(t, 0.0, "truncated", truncated=True)
        return
    _append_context(t, ids)
    t.turn_start, t.in_reasoning = len(t.tokens), True
