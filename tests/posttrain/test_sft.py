"""SFT: loss only on assistant tokens, packing with document boundaries, and the command end to end."""

import json
import random

import pytest
import torch

from openk3.cli import main
from openk3.model.checkpoint import find_checkpoint
from openk3.posttrain.envs import make_task
from openk3.posttrain.sft import collate, encode_conversation, pack
from openk3.posttrain.synth import generate, solve, write_jsonl
from openk3.text.chat import encode_segments, render_xtml
from openk3.train.data import IGNORE_INDEX

WRITTEN = ("{r}<|close|>think<|sep|><|open|>response<|sep|>{c}<|close|>response<|sep|><|close|>message<|sep|>"
           "<|end_of_msg|>")


def test_targets_are_exactly_what_the_assistant_writes(tokenizer):
    messages = solve(make_task("general", random.Random(0)), "high")
    ids, target = encode_conversation(tokenizer, messages, effort="high")
    assert ids == encode_segments(tokenizer, render_xtml(messages, effort="high", add_generation_prompt=False))
    a = messages[-1]
    assert tokenizer.decode([i for i, t in zip(ids, target) if t]) == WRITTEN.format(r=a["reasoning_content"],
                                                                                   c=a["content"])
    # the context ends with the generation prompt, which the model is given, not asked to write
    first = target.index(True)
    assert tokenizer.decode(ids[:first]).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert ids[:first] == encode_segments(tokenizer, render_xtml(messages[:-1], effort="high"))


def test_tool_results_and_prompts_are_context(tokenizer):
    env_rows = [r for r in generate(6, seed=3) if r["domain"] == "agent"]
    row = env_rows[0]
    ids, target = encode_conversation(tokenizer, row["messages"], tools=row["tools"], effort=row["effort"])
    spans, cur = [], None
    for i, t in enumerate(target + [False]):
        if t and cur is None:
            cur = i
        elif not t and cur is not None:
            spans.append(tokenizer.decode(ids[cur:i]))
            cur = None
    assistants = [m for m in row["messages"] if m["role"] == "assistant"]
    assert len(spans) == len(assistants) == 3
    for span, m in zip(spans, assistants):
        assert span.startswith(m["reasoning_content"]) and span.endswith("<|end_of_msg|>")
        assert "role=" not in span  # no header of any message, no tool result
    context = tokenizer.decode([i for i, t in zip(ids, target) if not t])
    assert 'role="tool"' in context and "# Tools" in context


def test_packing_keeps_documents_apart(tokenizer):
    rng = random.Random(0)
    docs = []
    for _ in range(9):
        n = rng.randrange(3, 40)
        docs.append(([rng.randrange(30, 300) for _ in range(n)], [rng.random() < 0.5 for _ in range(n)]))
    rows = pack(docs, 64, tokenizer.pad_id)
    assert len(rows) < len(docs)  # documents share rows
    seen = []
    for r in rows:
        assert len(r["ids"]) == 64 and r["starts"][0] == 0
        bounds = r["starts"] + [64]
        for s, e in zip(bounds, bounds[1:]):
            seen.append(r["ids"][s:e])
            assert r["labels"][e - 1] == IGNORE_INDEX  # a document's last token predicts nothing across the boundary
    for ids, target in docs:  # every document appears whole, with labels only where the next token is a target
        assert ids in seen
        r = next(r for r in rows for s in r["starts"] if r["ids"][s:s + len(ids)] == ids)
        s = next(s for s in r["starts"] if r["ids"][s:s + len(ids)] == ids)
        want = [ids[t + 1] if target[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        assert r["labels"][s:s + len(ids)] == want
    batch = collate(rows[:2])
    assert batch.cu_seqlens.tolist() == rows[0]["starts"] + [64 + s for s in rows[1]["starts"]] + [128]
    assert batch.seq_ids[0].tolist() == [sum(s <= t for s in rows[0]["starts"]) - 1 for t in range(64)]
    with pytest.raises(ValueError, match="more than --seq-len=64"):
        pack([([1] * 65, [True] * 65)], 64, 0)


def test_sft_command_trains_on_assistant_tokens(policy_dir, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, generate(12, seed=0))
    out = tmp_path / "sft"
    main(["sft", "--init-from", str(policy_dir), "--data", str(data), "--out", str(out), "--steps", "4",
          "--batch-size", "2", "--seq-len", "768", "--log-every", "1", "--lr", "3e-3"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert find_checkpoint(out).name == "final" and (out / "plots" / "loss.png").is_file()
    with pytest.raises(SystemExit):  # a finished run is not overwritten (ValueError -> `openk3 sft: error`)
        main(["sft", "--init-from", str(policy_dir), "--data", str(data), "--out", str(out)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 3}\n')
    with pytest.raises(SystemExit):
        main(["sft", "--init-from", str(policy_dir), "--data", str(bad), "--out", str(tmp_path / "x")])
    bad.write_text(json.dumps(generate(1, seed=0)[0]) + "\n" + '{"messages": [{"role": "robot", "content": "x"}]}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a bad message names its conversation and file, no traceback
        main(["sft", "--init-from", str(policy_dir), "--data", str(bad), "--out", str(tmp_path / "y")])
    assert f"--data {bad}: conversation 2: message 0: unknown role 'robot'" in capsys.readouterr().err
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(SystemExit):
        main(["sft", "--init-from", str(policy_dir), "--data", str(bad), "--out", str(tmp_path / "z")])
    assert "conversation 1 has no assistant message" in capsys.readouterr().err
    assert torch.isfinite(torch.tensor(rows[-1]["loss"]))


def test_length_split_is_the_cheapest_grouping():
    from itertools import combinations

    from openk3.posttrain.sft import length_split

    rng = random.Random(3)
    lengths = [rng.randrange(5, 20) if rng.random() < 0.6 else rng.randrange(60, 100) for _ in range(11)]

    def cost(groups):
        return sum(len(g) * max(lengths[i] for i in g) for g in groups)

    order = sorted(range(11), key=lambda i: lengths[i], reverse=True)
    for parts in (1, 2, 3):
        groups = length_split(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(11)) and len(groups) <= parts
        brute = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (11,))])
                    for k in range(parts) for cuts in combinations(range(1, 11), k))
        assert cost(groups) == brute
    assert cost(length_split(lengths, 3)) < 0.6 * cost([list(range(11))])


def test_split_micro_batches_give_the_loss_and_gradient_of_the_whole_batch(policy_dir, tokenizer):
    from openk3.posttrain.policy import load_policy
    from openk3.posttrain.sft import sft_backward
    from openk3.posttrain.synth import generate

    convs = generate(12, seed=5)
    docs = [encode_conversation(tokenizer, c["messages"], tools=c["tools"], effort=c["effort"]) for c in convs]
    rows = pack(docs, max(len(i) for i, _ in docs) + 37, tokenizer.pad_id)
    assert len(rows) >= 3
    grads, losses = [], []
    for split in (0, 3):
        model = load_policy(policy_dir)[0].train()
        losses.append(sft_backward(model, docs, rows, split, "cpu"))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-4
