"""Resuming `openk3 rl` and `openk3 distill`: a run killed after k iterations and resumed to N equals an
uninterrupted run of N (metrics rows and weights), with rl's partial rollouts carried through the checkpoint; and
the run directory's rules (a finished run is not overwritten, an unfinished one needs --resume, settings fixed)."""

import dataclasses
import json

import pytest
import torch

from openk3.model.checkpoint import CHECKPOINTS, LATEST
from openk3.posttrain import distill as distill_mod
from openk3.posttrain import rl as rl_mod
from openk3.posttrain.distill import COMBOS, DistillArgs, distill
from openk3.posttrain.policy import load_policy, load_state, start_run
from openk3.posttrain.rl import RLArgs, rl


class Killed(Exception):
    pass


def kill_at(monkeypatch, module, step):
    """The process dies while writing iteration `step`'s checkpoint (its metrics row is already logged)."""
    real = module.save_state

    def save_state(run_dir, at, *args):
        if at == step:
            raise Killed
        return real(run_dir, at, *args)

    monkeypatch.setattr(module, "save_state", save_state)


def rows_of(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("elapsed_s")
    return rows


def assert_same_weights(a_dir, b_dir):
    a, b = load_policy(a_dir)[0].state_dict(), load_policy(b_dir)[0].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        err = float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12))
        assert err < 1e-5, (k, err)


def rl_args(policy_dir, out, **kw):
    # NOTE: chosen (seed 3) so that the random policy stops some turns early: the checkpoint of iteration 4 then
    # holds partial rollouts, and iteration 3's update moved the weights (the optimizer's state matters after it)
    return RLArgs(init_from=str(policy_dir), out=str(out), domain="agent", effort="low", iterations=5, groups=2,
                  group_size=3, pool=3, b0_samples=1, chunk_tokens=4, max_turn_tokens=24, finish_fraction=0.25,
                  tau_low=1.0, lr=1e-3, seed=3, **kw)


@pytest.mark.slow
def test_rl_killed_and_resumed_equals_an_uninterrupted_run(policy_dir, tmp_path, monkeypatch):
    whole = rl(rl_args(policy_dir, tmp_path / "whole"))
    assert whole["rows"][2]["partial"] > 0  # the checkpoint below carries partial rollouts ...
    assert any(r.get("grad_norm", 0) > 0 for r in whole["rows"][:3])  # ... and the optimizer's moments

    run = tmp_path / "killed"
    kill_at(monkeypatch, rl_mod, 4)
    with pytest.raises(Killed):
        rl(rl_args(policy_dir, run))
    assert len(rows_of(run)) == 4  # iteration 4 was logged, its checkpoint never written
    state = load_state(run / CHECKPOINTS / "step_000003")
    assert state["step"] == 3 and len(state["carry"]) == whole["rows"][2]["partial"]
    assert all(t["env_snapshot"] is not None for t in state["carry"])
    with pytest.raises(ValueError, match="--resume"):  # an unfinished run is not silently restarted
        rl(rl_args(policy_dir, run))
    with pytest.raises(ValueError, match="cannot change --lr"):
        rl(dataclasses.replace(rl_args(policy_dir, run, resume=True), lr=2e-3))

    monkeypatch.undo()
    resumed = rl(rl_args(policy_dir, run, resume=True))
    assert rows_of(run) == rows_of(tmp_path / "whole")
    assert [r["step"] for r in resumed["rows"]] == [1, 2, 3, 4, 5]
    assert_same_weights(tmp_path / "whole", run)
    assert (run / CHECKPOINTS / LATEST).read_text().strip() == "final"
    assert not list((run / CHECKPOINTS).glob("step_*"))  # a finished run keeps only its final checkpoint
    with pytest.raises(ValueError, match="already holds a finished run"):
        rl(rl_args(policy_dir, run, resume=True))


def distill_args(policy_dir, teachers, out, **kw):
    return DistillArgs(student=str(policy_dir), teachers=str(teachers), out=str(out), iterations=3, samples=1,
                       chunk_tokens=8, max_turn_tokens=8, eval_prompts=0, lr=1e-3, **kw)


@pytest.mark.slow
def test_distill_killed_and_resumed_equals_an_uninterrupted_run(policy_dir, tmp_path, monkeypatch):
    teachers = tmp_path / "teachers"
    teachers.mkdir()
    teacher, tok, _ = load_policy(policy_dir)
    with torch.no_grad():  # teachers that differ from the student, so the student moves
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    from openk3.model.checkpoint import save_pretrained

    save_pretrained(teacher, tmp_path / "teacher")
    tok.save(tmp_path / "teacher")
    for d, e in COMBOS:
        (teachers / f"{d}-{e}").symlink_to(tmp_path / "teacher")
    distill(distill_args(policy_dir, teachers, tmp_path / "whole"))

    run = tmp_path / "killed"
    kill_at(monkeypatch, distill_mod, 2)
    with pytest.raises(Killed):
        distill(distill_args(policy_dir, teachers, run))
    monkeypatch.undo()
    distill(distill_args(policy_dir, teachers, run, resume=True))
    assert rows_of(run) == rows_of(tmp_path / "whole")
    assert_same_weights(tmp_path / "whole", run)


def test_run_directory_rules(tmp_path):
    with pytest.raises(ValueError, match="holds no checkpoint to resume from"):
        start_run(tmp_path / "new", {"lr": 1.0}, resume=True)
    run_dir, ckpt = start_run(tmp_path / "new", {"lr": 1.0})
    assert ckpt is None and json.loads((run_dir / "args.json").read_text()) == {"lr": 1.0}


def test_unfinished_teachers_are_named(policy_dir, tmp_path):
    (tmp_path / "general-low" / CHECKPOINTS).mkdir(parents=True)
    (tmp_path / "general-low" / CHECKPOINTS / LATEST).write_text("step_000002\n")
    with pytest.raises(FileNotFoundError, match=r"general-low \(unfinished"):
        distill_mod.teacher_dirs(tmp_path)
