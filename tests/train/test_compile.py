"""Regional torch.compile (openk3/train/compile.py): compiled training steps equal eager ones, nothing recompiles
for shapes it has seen, checkpoints keep their names.

The fast tests use backend="aot_eager": dynamo's graphs through AOTAutograd (forward and backward traced, the
graph breaks and guards real), without code generation, so fp32 results match eager to rounding. One slow test
runs Inductor's generated C++ where a compiler is present."""

import copy
import json
import shutil

import pytest
import torch

from openk3 import cli
from openk3.config import _schedule, tiny
from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import load_pretrained, save_pretrained
from openk3.train.compile import compile_layers, compiled_graphs
from openk3.train.trainer import check_args, train
from tests.helpers import rel_err
from tests.train.test_train import args_for, make_workdir


def tiny_4():
    """`tiny` (every K3 feature) in 4 layers: KDA, KDA, MLA, MLA (AttnRes blocks of 2; the first layer dense)."""
    c = tiny()
    return c.replace(num_hidden_layers=4, linear_attn_config=dict(vars(c.linear_attn_config), **_schedule(4, 3, True)))


def kimi_linear_tiny():
    """`tiny` without the K3 additions (the Kimi-Linear family): softplus decay, low-rank output gate, SwiGLU, plain
    MoE with a scaling factor, no AttnRes, no gated MLA, no QAT; 4 layers, the 4th MLA as in kimi-linear-1.5b."""
    c = tiny()
    lac = dict(vars(c.linear_attn_config), use_full_rank_gate=False, gate_lower_bound=None, **_schedule(4, 4, True))
    return c.replace(num_hidden_layers=4, hidden_act="silu", attn_res_block_size=None, mla_use_output_gate=False,
                     routed_expert_hidden_size=None, latent_moe_use_norm=False, quantization_config=None,
                     routed_scaling_factor=2.5, linear_attn_config=lac)


CONFIGS = {"tiny_4": tiny_4, "kimi_linear_tiny": kimi_linear_tiny}
B, T = 2, 24
# packed documents over the B*T = 48 tokens; every row start (0, 24) is a document start
PACKINGS = [[0, 10, 24, 31, 48], [0, 5, 24, 48], [0, 3, 7, 24, 30, 40, 48]]


def train_step(model, ids, cu):
    """Forward with router and AttnRes records, backward -> (loss, {name: grad}, router, attnres, graphs compiled)."""
    before = compiled_graphs()
    res = model(ids, labels=ids.roll(-1, 1), cu_seqlens=cu, record=True, record_attnres=True)
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return res.loss.detach(), grads, res.router, res.attnres, compiled_graphs() - before


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def runs(request):
    """Five training steps eager and compiled (aot_eager) from the same weights: one packing three times (the same
    shapes), then two new numbers of documents. After each step the eager model takes an SGD step and the compiled
    one its new weights (copied in place), so every step starts both from the same, changed, weights."""
    torch.manual_seed(0)
    eager = K3ForCausalLM(CONFIGS[request.param]())
    compiled = copy.deepcopy(eager)
    info = compile_layers(compiled, "aot_eager")
    opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    results = {"eager": [], "compiled": []}
    for cu in [PACKINGS[0]] * 3 + PACKINGS[1:]:
        ids = torch.randint(0, eager.config.vocab_size, (B, T), generator=gen)
        results["compiled"].append(train_step(compiled, ids, torch.tensor(cu)))
        results["eager"].append(e := train_step(eager, ids, torch.tensor(cu)))
        for n, p in eager.named_parameters():
            p.grad = e[1].get(n)
        opt.step()
        eager.zero_grad()  # the recorded gradients must not take the next step's
        compiled.load_state_dict(eager.state_dict())
    return {**results, "model": compiled, "info": info}


def test_compiled_steps_equal_eager(runs):
    """Loss (fp32) within 1e-5 and every gradient within 1e-4 relative at every step, also after the optimizer has
    changed the weights the graphs read; the router and AttnRes records are the eager ones."""
    for step, (e, c) in enumerate(zip(runs["eager"], runs["compiled"])):
        assert rel_err(c[0], e[0]) < 1e-5, (step, c[0], e[0])
        assert c[1].keys() == e[1].keys()  # (layer 0 of an AttnRes model has no mix before its mixer: no gradient)
        worst = max(e[1], key=lambda n: rel_err(c[1][n], e[1][n]))
        assert rel_err(c[1][worst], e[1][worst]) < 1e-4, (step, worst)
        assert len(c[2]) == len(e[2]) == len(runs["model"].moe_layers())
        for (cs, ci), (es, ei) in zip(c[2], e[2]):
            assert torch.equal(ci, ei) and rel_err(cs, es) < 1e-5
        assert (c[3] is None) == (e[3] is None)
        if e[3] is not None:
            assert c[3].keys() == e[3].keys() and all(rel_err(c[3][k], e[3][k]) < 1e-5 for k in e[3])


def test_seen_shapes_do_not_recompile(runs):
    """Graphs compiled per step: the first compiles; the second compiles at most one more (dynamo compiles the frame
    of `DecoderLayer.ffn` on its own once); the third, same shapes, nothing. A new number of packed documents
    recompiles a few graphs with that size symbolic (none where an earlier model of the process did so already:
    the compiled code is shared by every model); the next new number, nothing."""
    graphs = [c[4] for c in runs["compiled"]]
    assert graphs[0] > 0
    assert graphs[1] <= 1 and graphs[2] == 0, graphs
    assert graphs[3] < graphs[0] / 4 and graphs[4] == 0, graphs


def test_state_dict_names_unchanged_and_checkpoints_round_trip(runs, tmp_path):
    """Compiling renames nothing (no `_orig_mod.`): a compiled model's checkpoint is the plain model's, and a
    compiled model loads a plain model's weights."""
    compiled = runs["model"]
    plain = K3ForCausalLM(compiled.config)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert not any("_orig_mod" in n for n, _ in compiled.named_parameters())
    plain.load_state_dict(compiled.state_dict())
    save_pretrained(compiled, tmp_path / "compiled")
    save_pretrained(plain, tmp_path / "plain")
    a = load_pretrained(tmp_path / "compiled", dtype=torch.float32).state_dict()
    b = load_pretrained(tmp_path / "plain", dtype=torch.float32).state_dict()
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    fresh = K3ForCausalLM(compiled.config)
    compiled.load_state_dict(fresh.state_dict())
    assert all(torch.equal(t, compiled.state_dict()[n]) for n, t in fresh.state_dict().items())


def test_compile_layers_refuses_bad_calls(runs):
    with pytest.raises(ValueError, match="already"):
        compile_layers(runs["model"], "aot_eager")
    with pytest.raises(ValueError, match="'nope'"):
        compile_layers(K3ForCausalLM(tiny().replace(num_hidden_layers=1, linear_attn_config={
            "num_heads": 4, "head_dim": 32, "kda_layers": [1], "full_attn_layers": []})), "nope")
    assert runs["info"]["regions"] == runs["model"].config.num_hidden_layers + 1
    assert torch._dynamo.config.recompile_limit >= 2 * runs["model"].config.num_hidden_layers


def test_bf16_autocast_step_traces_and_matches():
    """The recipe's precision (fp32 parameters, bf16 autocast; here the CPU's autocast): the MoE's grouped matmul
    then runs in bf16 inside the graph. The loss equals eager's within 1e-5; the gradients, rounded to bf16 at
    different places, within 5e-2 (norm, relative) of eager's."""
    from tests.helpers import rel_norm_err

    torch.manual_seed(0)
    eager = K3ForCausalLM(kimi_linear_tiny())
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, "aot_eager")
    ids = torch.randint(0, eager.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c, e = (train_step(m, ids, torch.tensor(PACKINGS[0])) for m in (compiled, eager))
    assert rel_err(c[0], e[0]) < 1e-5
    assert c[1].keys() == e[1].keys() and max(rel_norm_err(c[1][n], e[1][n]) for n in e[1]) < 5e-2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_inductor_step_matches_eager():
    """Inductor's generated code (fused, its reductions reordered): one step of a 2-layer Kimi-Linear-family model
    (a dense KDA layer, an MoE MLA layer: the fewest graphs that cover both mixers and both FFNs) in fp32 within 1e-5
    (loss) and 1e-3 (each gradient) relative of eager."""
    torch.manual_seed(0)
    c = kimi_linear_tiny()
    eager = K3ForCausalLM(c.replace(num_hidden_layers=2, linear_attn_config=dict(
        vars(c.linear_attn_config), **_schedule(2, 2, True))))
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, "inductor")
    ids = torch.randint(0, eager.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor(PACKINGS[0])
    e, c = train_step(eager, ids, cu), train_step(compiled, ids, cu)
    assert rel_err(c[0], e[0]) < 1e-5
    assert max(rel_err(c[1][n], e[1][n]) for n in e[1]) < 1e-3


def test_train_compile_flag(tmp_path):
    """`openk3 train --compile aot_eager` logs the eager run's losses (fp32), checkpoints under the
    usual names (and evaluates eagerly, `eager_stance`); a bad backend is named."""
    work = make_workdir(tmp_path)
    eager = train(args_for(work, "eager", steps=2, ckpt_every=2, eval_every=2))
    args = args_for(work, "compiled", steps=2, ckpt_every=2, eval_every=2)
    argv = ["train", "--no-progress", "--no-sample", "--compile", "aot_eager"]
    for name in ("config", "data", "vocab_size", "steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "eval_tokens", "ckpt_every", "val_fraction", "out"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cli.main(argv)
    rows = [json.loads(l) for l in (work / "compiled/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(eager.losses) == 2
    # the first loss within 1e-5; the later ones within 1e-4, after optimizer steps on gradients ~1e-6 apart
    assert abs(rows[0]["loss"] - eager.losses[0]) <= 1e-5 * eager.losses[0]
    assert all(abs(r["loss"] - l) <= 1e-4 * l for r, l in zip(rows, eager.losses)), (rows, eager.losses)
    assert abs(rows[-1]["val_loss"] - eager.final_eval["loss"]) <= 1e-4 * eager.final_eval["loss"]
    a = torch.load(work / "eager/checkpoints/step_000002/trainer_state.pt", weights_only=True)["model"]
    b = torch.load(work / "compiled/checkpoints/step_000002/trainer_state.pt", weights_only=True)["model"]
    assert list(a) == list(b)
    with pytest.raises(ValueError, match="--compile='nope'"):
        check_args(args_for(work, "bad", compile="nope"))


def test_compile_default_is_inductor_for_one_cuda_process_only():
    """`openk3 train`'s --compile default (trainer.compile_backend): Inductor for a text model in one CUDA process,
    eager on the CPU, under torchrun and for a vision config; "off" and an explicit backend are taken as given."""
    from openk3.train.trainer import TrainArgs, compile_backend
    assert compile_backend(TrainArgs(device="cuda", config="tiny"), distributed=False) == "inductor"
    assert compile_backend(TrainArgs(device="cuda", config="tiny"), distributed=True) is None
    assert compile_backend(TrainArgs(device="cpu", config="tiny"), distributed=False) is None
    assert compile_backend(TrainArgs(device="cuda", config="tiny-vl"), distributed=False) is None
    assert compile_backend(TrainArgs(device="cuda", config="tiny", compile="off"), distributed=False) is None
    assert compile_backend(TrainArgs(device="cpu", config="tiny", compile="aot_eager"), distributed=False) == "aot_eager"
