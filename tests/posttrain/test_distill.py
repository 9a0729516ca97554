"""MOPD: the token reward against its formula, teacher scoring and weight sync in the engine, `openk3 distill`."""

import json
import random

import pytest
import torch

from openk3.cli import main
from openk3.posttrain.distill import COMBOS, mopd_rewards, teacher_dirs
from openk3.posttrain.policy import load_policy, make_engine
from openk3.serve.engine import Engine, EngineConfig, SamplingParams
from tests.serve.test_cache import small_model


def test_mopd_reward_equals_its_formula_by_hand():
    teacher = torch.tensor([-1.0, -3.0, -0.5, -0.1])
    student = torch.tensor([-2.0, -0.5, -0.6, -9.0])
    # log p_t - log p_s = 1.0, -2.5, 0.1, 8.9; clipped to [-2, 2]
    assert mopd_rewards(teacher, student, 2.0).tolist() == pytest.approx([1.0, -2.0, 0.1, 2.0])
    with pytest.raises(ValueError, match="R=0"):
        mopd_rewards(teacher, student, 0)


def test_engine_score_equals_a_full_forward():
    model = small_model()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=64, prefill_chunk=5, hash_interval=4))
    tokens = [random.Random(0).randrange(256) for _ in range(23)]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)[:-1]
    want = want.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    got = torch.tensor(engine.score(tokens))
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4
    assert engine.pool.available == 63 and engine.pool.reserved == 0  # its pages are given back
    with pytest.raises(ValueError, match="at least 2"):
        engine.score([1])


def test_load_weights_drops_the_prefix_cache():
    a, b = small_model(seed=0), small_model(seed=1)
    cfg = EngineConfig(page_size=4, num_pages=128, hash_interval=4, checkpoint_interval=8)
    engine = Engine(a, cfg)
    prompt = [random.Random(1).randrange(256) for _ in range(17)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    (first,) = engine.generate([prompt], greedy)
    longer = prompt + first.output + [5, 6]
    assert engine.stats()["cached_blocks"] > 0
    engine.load_weights(b.state_dict())
    assert engine.stats()["cached_blocks"] == 0 and engine.stats()["weight_loads"] == 1
    (got,) = engine.generate([longer], greedy)
    (want,) = Engine(small_model(seed=1), cfg).generate([longer], greedy)
    assert got.cached_tokens == 0 and got.output == want.output
    assert max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs)) < 1e-4
    engine.submit(prompt, greedy)
    with pytest.raises(RuntimeError, match="while requests are running"):
        engine.load_weights(a.state_dict())


def test_teacher_dirs_names_the_missing_policies(tmp_path):
    with pytest.raises(FileNotFoundError, match="general-low, general-high"):
        teacher_dirs(tmp_path)


@pytest.mark.slow
def test_distill_command_reports_every_domain_and_effort(policy_dir, tmp_path):
    teachers = tmp_path / "teachers"
    teachers.mkdir()
    for d, e in COMBOS:
        (teachers / f"{d}-{e}").symlink_to(policy_dir)
    out = tmp_path / "distill"
    main(["distill", "--student", str(policy_dir), "--teachers", str(teachers), "--out", str(out), "--iterations", "1",
          "--samples", "1", "--chunk-tokens", "8", "--max-turn-tokens", "8", "--eval-prompts", "1"])
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # every teacher is the student itself: the first reverse KL is 0 (the engine scores what it sampled)
    assert abs(row["reverse_kl"]) < 1e-4 and set(row["by_combo"]) == {f"{d}-{e}" for d, e in COMBOS}
    report = json.loads((out / "report.json").read_text())
    assert set(report["results"]) == {f"{d}-{e}" for d, e in COMBOS}
    assert set(report["results"]["agent-max"]) == {"sft", "teacher", "student"}
    assert (out / "report.md").is_file() and (out / "plots" / "report.png").is_file()
    model, tok, _ = load_policy(out)
    assert make_engine(model.eval(), 64).score([1, 2, 3])
