"""bf16 compute over fp32 masters without autocast (train/precision.py, issue #11): the copy computes exactly as a
model cast to bf16, its gradients reach the masters in fp32 (accumulated over micro-batches), the optimizer's
updates come back rounded, and the trainer's `--dtype bf16` (copy mode, the default in one process) resumes
exactly and keeps fp32 checkpoints."""

import copy
import json

import pytest
import torch

from openk3.config import tiny
from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import ARGS_FILE
from openk3.model.model import keeps_fp32
from openk3.train.compile import compile_layers
from openk3.train.optim import build_optimizer, model_head_dims
from openk3.train.precision import BF16Compute
from openk3.train.trainer import MLAMaxLogits, TrainArgs, bf16_mode, check_args, train

from .test_train import args_for, make_workdir, small_config


def _model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(small_config())
    model.reset_parameters(seed=seed)
    return model


def _batch(seed: int, V: int, B: int = 2, T: int = 24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, ids.roll(-1, 1)


def test_the_copy_is_a_bf16_cast_sharing_the_fp32_tensors():
    model = _model()
    bf16 = BF16Compute(model)
    cast = copy.deepcopy(model).cast(torch.bfloat16)
    masters = dict(model.named_parameters())
    for name, p in bf16.model.named_parameters():
        if keeps_fp32(name):
            assert p is masters[name] and p.dtype == torch.float32, name
        else:
            assert p is not masters[name] and p.dtype == torch.bfloat16, name
            assert torch.equal(p, masters[name].detach().bfloat16()), name
    for (name, b), (_, mb) in zip(bf16.model.named_buffers(), model.named_buffers()):
        assert b is mb, name  # the router's correction bias: the balancer's updates need no copy
    assert len(bf16.pairs) == sum(not keeps_fp32(n) for n, _ in model.named_parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters are untouched
    ids, labels = _batch(1, model.config.vocab_size)
    assert torch.equal(bf16.model(ids, labels=labels).loss, cast(ids, labels=labels).loss)


def test_gradients_accumulate_in_fp32_on_the_masters():
    """Two micro-batches: each master's .grad is the fp32 sum of the copy's two bf16 gradients (the fp32-kept tensors
    accumulate in place, as shared parameters); the copy's gradients are freed after each."""
    model = _model(1)
    bf16 = BF16Compute(model)
    reference = copy.deepcopy(bf16.model)  # the same bf16 weights: its gradients, micro-batch by micro-batch
    by_name = dict(reference.named_parameters())
    expected = {}
    for seed in (2, 3):
        ids, labels = _batch(seed, model.config.vocab_size)
        bf16.model(ids, labels=labels).loss.backward()
        bf16.accumulate_grads()
        assert all(c.grad is None for _, c in bf16.pairs)
        reference.zero_grad(set_to_none=True)
        reference(ids, labels=labels).loss.backward()
        for name, p in by_name.items():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad.float()
    checked = 0
    for name, p in model.named_parameters():
        if name not in expected:
            assert p.grad is None, name
            continue
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
        checked += 1
    assert checked > len(bf16.pairs) // 2


def test_an_optimizer_step_on_the_masters_reaches_the_copy():
    model = _model(2)
    bf16 = BF16Compute(model)
    opt = build_optimizer(model, lr=1e-2, head_dims=model_head_dims(model.config))
    ids, labels = _batch(4, model.config.vocab_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf16.model(ids, labels=labels).loss.backward()
    bf16.accumulate_grads()
    opt.step()
    opt.zero_grad()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) // 2
    masters = dict(model.named_parameters())
    stale = [n for n, p in bf16.model.named_parameters() if not torch.equal(p, masters[n].detach().to(p.dtype))]
    assert stale  # not refreshed yet: the copy still holds the old rounding
    bf16.refresh()
    for name, p in bf16.model.named_parameters():
        assert torch.equal(p, masters[name].detach().to(p.dtype)), name


def test_qk_clip_watches_the_copy_and_clips_the_masters():
    """MLAMaxLogits(masters, runs=copy): the copy's forwards give the maxima, the clip scales the masters' q and
    kv_b rows, and `refresh` carries them into the copy. NOTE: the trainer test's tau (5.0) never clips the small
    model (its max logit is ~0.05), so this one sets tau below the measured maximum."""
    model = _model(3)
    bf16 = BF16Compute(model)
    max_logits = MLAMaxLogits(model, runs=bf16.model)
    assert max_logits.layers
    ids, _ = _batch(5, model.config.vocab_size)
    with torch.no_grad():
        model(ids)  # a forward of the masters is not watched
    assert all(m is None for m in max_logits.max_H)
    with torch.no_grad():
        bf16.model(ids)
    assert all(m is not None for m in max_logits.max_H)
    tau = 0.5 * min(float(m.max()) for m in max_logits.max_H)
    attn = max_logits.layers[0]
    q_name = "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj"
    before = getattr(attn, q_name).weight.detach().clone()
    max_logits.clip_(tau)
    assert not torch.equal(getattr(attn, q_name).weight, before)  # the master was clipped
    i = next(i for i, layer in enumerate(model.model.layers) if layer.self_attn is attn)
    copied = bf16.model.model.layers[i].self_attn
    assert torch.equal(getattr(copied, q_name).weight, before.bfloat16())  # the copy waits for refresh
    bf16.refresh()
    assert torch.equal(getattr(copied, q_name).weight, getattr(attn, q_name).weight.detach().bfloat16())


def test_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="fp32 master parameters"):
        BF16Compute(_model().cast(torch.bfloat16))
    compiled = _model()
    compile_layers(compiled, "eager")
    with pytest.raises(ValueError, match="before compiling"):
        BF16Compute(compiled)


def test_bf16_mode_defaults_and_errors(tmp_path):
    config = str(tmp_path / "config.json")
    small_config().save(config)
    assert bf16_mode(TrainArgs(config=config, dtype="bf16"), distributed=False) == "copy"
    assert bf16_mode(TrainArgs(config=config, dtype="fp32"), distributed=False) is None
    assert bf16_mode(TrainArgs(config=config, dtype="bf16", device="cuda"), distributed=True) == "autocast"
    with pytest.raises(ValueError, match="needs --device cuda"):
        bf16_mode(TrainArgs(config=config, dtype="bf16"), distributed=True)
    with pytest.raises(ValueError, match="--bf16-mode=copy runs in one process"):
        bf16_mode(TrainArgs(config=config, dtype="bf16", bf16_mode="copy"), distributed=True)
    with pytest.raises(ValueError, match="--config=tiny-vl has a vision tower"):  # the error names what refuses
        bf16_mode(TrainArgs(config="tiny-vl", dtype="bf16", bf16_mode="copy"), distributed=False)
    assert bf16_mode(TrainArgs(config="tiny-vl", dtype="bf16", device="cuda"), distributed=False) == "autocast"
    with pytest.raises(ValueError, match="--bf16-mode='half'"):
        check_args(TrainArgs(config=config, dtype="bf16", bf16_mode="half"))
    with pytest.raises(ValueError, match="this run has --dtype fp32"):
        check_args(TrainArgs(config=config, bf16_mode="copy"))
    with pytest.raises(ValueError, match="autocast runs under CUDA autocast"):
        check_args(TrainArgs(config=config, dtype="bf16", bf16_mode="autocast"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("bf16"))


def test_trainer_bf16_copy_resumes_exactly_and_saves_fp32_masters(workdir):
    """`--dtype bf16` on the CPU (copy mode): 6 steps in one go == 4 steps, then --resume for 2 (same losses, same
    fp32 masters: the copy is rebuilt from the loaded masters); with QK-Clip on, whose hooks watch the copy and whose
    clip changes the masters. The losses follow the fp32 run's to bf16 accuracy and fall."""
    full = train(args_for(workdir, "full", dtype="bf16", steps=6, qk_clip=5.0))
    train(args_for(workdir, "split", dtype="bf16", steps=6, stop_at=4, qk_clip=5.0))
    split = train(args_for(workdir, "split", dtype="bf16", steps=6, qk_clip=5.0), resume=True)
    fp32 = train(args_for(workdir, "fp32", steps=6, qk_clip=5.0))
    assert split.losses == full.losses[4:]
    a = torch.load(workdir / "full/checkpoints/step_000006/trainer_state.pt", weights_only=True)["model"]
    b = torch.load(workdir / "split/checkpoints/step_000006/trainer_state.pt", weights_only=True)["model"]
    assert all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
    c = torch.load(workdir / "fp32/checkpoints/step_000006/trainer_state.pt", weights_only=True)["model"]
    assert any(not torch.equal(a[k], c[k]) for k in a)  # it did compute in bf16
    for x, y in zip(full.losses, fp32.losses):
        assert abs(x - y) < 0.05 * abs(y), (full.losses, fp32.losses)
    assert full.losses[-1] < full.losses[0]
    assert json.loads((workdir / "full" / ARGS_FILE).read_text())["bf16_mode"] == "copy"
