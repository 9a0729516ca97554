"""Muon, QK-Clip, Quantile Balancing and the FSDP2 bf16 policy on 2 gloo ranks equal their one-process versions.

One spawn of 2 CPU processes (tests/parallel/dist.py) runs all four on the ranks (starting processes costs seconds
on a busy 2-core machine); rank 0 writes what they computed to a file, and each test compares its part with the
same computation done here in one process.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from openk3.model.model import K3ForCausalLM
from openk3.parallel.fsdp import apply_fsdp
from openk3.train import balance
from openk3.train import optim
from openk3.train.optim import Muon, newton_schulz_cost, owners_by_cost, qk_clip_mla_, shard_rows
from tests.parallel.dist import init_gloo, spawn_results
from tests.train.test_train import small_config


def _bf16_model_and_batch():
    torch.manual_seed(3)
    model = K3ForCausalLM(small_config())
    model.reset_parameters(seed=3)
    return model, torch.randint(0, model.config.vocab_size, (2, 24))


def _fsdp_bf16() -> dict:
    model, ids = _bf16_model_and_batch()
    apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), param_dtype=torch.bfloat16)
    dtypes = {}
    attn = model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a: dtypes.update(A_log=m.A_log.dtype, o_norm=m.o_norm.weight.dtype))
    attn.q_proj.register_forward_pre_hook(lambda m, a: dtypes.update(q_proj=m.weight.dtype))
    loss = model(ids, labels=ids.roll(-1, 1)).loss
    loss.backward()
    return {"loss": loss.detach(), "dtypes": {k: str(v) for k, v in dtypes.items()},
            "grad_dtype": str(attn.q_proj.weight.grad.dtype), "master_dtype": str(attn.q_proj.weight.dtype)}


def test_fsdp_bf16_policy_computes_like_a_bf16_model_with_fp32_islands(sharded_results):
    """apply_fsdp(param_dtype=bf16): linear weights are gathered in bf16 while A_log and o_norm (the release's fp32
    tensors) stay fp32, masters and gradients fp32; the loss is bit-equal to a model cast to bf16 by
    `K3ForCausalLM.cast` (which keeps the same fp32 islands), and not the fp32 loss."""
    got = sharded_results["bf16"]
    assert got["dtypes"] == {"A_log": "torch.float32", "o_norm": "torch.float32", "q_proj": "torch.bfloat16"}
    assert got["grad_dtype"] == got["master_dtype"] == "torch.float32"
    model, ids = _bf16_model_and_batch()
    fp32 = model(ids, labels=ids.roll(-1, 1)).loss.detach()
    bf16 = model.cast(torch.bfloat16)(ids, labels=ids.roll(-1, 1)).loss.detach()
    assert torch.equal(got["loss"], bf16) and not torch.equal(got["loss"], fp32)


def _worker(rank: int, world: int, out) -> None:
    init_gloo()
    results = {"muon": _sharded_muon(), "qk_clip": _sharded_qk_clip(),
               "histogram": _all_reduced_histograms(rank, world), "bf16": _fsdp_bf16()}
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> dict:
    return spawn_results(2, _worker, tmp_path_factory.mktemp("collectives"))


# awkward sizes: 9 and 5 rows do not split evenly over 2 ranks (FSDP2 pads the last shard)
HEADS, HEAD_ROWS, COLS = 3, 3, 7


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(COLS, 5, bias=False)
        self.heads = nn.Linear(COLS, HEADS * HEAD_ROWS, bias=False)  # Per-Head Muon rows
        self.experts = nn.Parameter(torch.randn(3, 4, COLS))  # 3 experts: 2 on rank 0, 1 on rank 1, no gather


def toy_and_grads(seed: int = 0) -> tuple[Toy, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = Toy()
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    return model, grads


def muon_steps(model: Toy, grads: dict, steps: int = 3) -> None:
    opt = Muon([{"params": [model.a.weight, model.experts], "head_dim": None},
                {"params": [model.heads.weight], "head_dim": HEAD_ROWS}], lr=0.05, weight_decay=0.1)
    for step in range(steps):
        for n, p in model.named_parameters():
            g = grads[n] * (step + 1)
            p.grad = DTensor.from_local(g, p.device_mesh, [torch.distributed.tensor.Replicate()]).redistribute(
                p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()
        opt.step()


def _sharded_muon() -> dict:
    model, grads = toy_and_grads()
    fully_shard(model)
    assert isinstance(model.a.weight, DTensor)
    shapes = []  # the blocks this rank orthogonalised
    exchanges = []
    orthogonalize, all_to_all = optim.orthogonalize, dist.all_to_all_single
    optim.orthogonalize = lambda m, *a: shapes.append(tuple(m.shape)) or orthogonalize(m, *a)
    dist.all_to_all_single = lambda *a, **k: exchanges.append(1) or all_to_all(*a, **k)
    try:
        muon_steps(model, grads)
    finally:
        optim.orthogonalize, dist.all_to_all_single = orthogonalize, all_to_all
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, shapes)
    return {"weights": {n: p.full_tensor() for n, p in model.named_parameters()}, "shapes": every_rank,
            "exchanges": len(exchanges)}


def test_muon_on_sharded_parameters_equals_unsharded(sharded_results):
    """Muon's update of FSDP2-sharded matrices (whole matrix and Per-Head blocks, uneven shards) is the one-process
    update exactly, with each sharded matrix orthogonalised on one rank only (the costlier `a` on rank 0, the three
    head blocks on rank 1) and two all-to-alls a step. An expert stack's shards hold whole experts and are
    orthogonalised where they are (2 experts on rank 0, 1 on rank 1): also exact."""
    model, grads = toy_and_grads()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    muon_steps(model, grads)
    sharded = sharded_results["muon"]
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n])
        assert torch.equal(sharded["weights"][n], p.detach()), n
    steps = 3
    assert sharded["shapes"] == [[(1, 5, COLS), (2, 4, COLS)] * steps, [(HEADS, HEAD_ROWS, COLS), (1, 4, COLS)] * steps]
    assert sharded["exchanges"] == 2 * steps


def test_newton_schulz_owners_balance_the_cost():
    # in decreasing cost to the least-loaded rank: 5 -> 0, 4 -> 1, 3 -> 1 (4 < 5), 2 -> 0 (5 < 7), 1 -> 0 (a tie)
    assert owners_by_cost([5, 1, 4, 2, 3], 2) == [0, 0, 1, 0, 1]
    costs = [newton_schulz_cost(torch.Size(s), h) for s, h in (((5, COLS), None), ((HEADS * HEAD_ROWS, COLS), HEAD_ROWS))]
    assert costs == [5 * 5 * (2 * COLS + 5), HEADS * HEAD_ROWS ** 2 * (2 * COLS + HEAD_ROWS)]
    assert shard_rows(9, 2) == [5, 4] and shard_rows(5, 4) == [2, 2, 1, 0] and shard_rows(2, 4) == [1, 1, 0, 0]


def _qk_clip_inputs():
    torch.manual_seed(1)
    H, nope, rope, v, dim, lora = 3, 4, 2, 3, 5, 6
    q = torch.randn(H * (nope + rope), dim)
    kv = torch.randn(H * (nope + v), lora)
    return q, kv, torch.tensor([50.0, 200.0, 400.0]), dict(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)


def _sharded_qk_clip() -> dict:
    q, kv, max_logit, dims = _qk_clip_inputs()
    model = nn.Module()
    model.q, model.kv = nn.Parameter(q), nn.Parameter(kv)
    fully_shard(model)
    with torch.no_grad():
        qk_clip_mla_(model.q, model.kv, max_logit, 100.0, **dims)
    return {"q": model.q.full_tensor(), "kv": model.kv.full_tensor()}


def test_qk_clip_on_sharded_weights_equals_unsharded(sharded_results):
    q, kv, max_logit, dims = _qk_clip_inputs()
    q0 = q.clone()
    qk_clip_mla_(q, kv, max_logit, 100.0, **dims)
    sharded = sharded_results["qk_clip"]
    assert not torch.equal(q, q0)
    assert torch.equal(sharded["q"], q) and torch.equal(sharded["kv"], kv)


# ----------------------------------------------------------------------------------------- Quantile Balancing

LAYERS, TOKENS, EXPERTS, K, BINS = 3, 101, 8, 2, 64


def _scores_and_biases():
    torch.manual_seed(2)
    scores = torch.sigmoid(torch.randn(LAYERS, TOKENS, EXPERTS) * 2 + torch.linspace(-1, 1, EXPERTS))
    biases = torch.randn(LAYERS, EXPERTS) * 0.05
    return scores, biases


def _all_reduced_histograms(rank: int, world: int) -> dict:
    scores, biases = _scores_and_biases()
    hists = [balance.QuantileHistogram(biases[i], K, BINS) for i in range(LAYERS)]
    mine = torch.tensor_split(torch.arange(TOKENS), world)[rank]  # uneven: 51 and 50 tokens
    for i, h in enumerate(hists):
        h.update(scores[i, mine])
    calls = []
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        balance.all_reduce_histograms_(hists)
    finally:
        dist.all_reduce = all_reduce
    return {"counts": [h.counts for h in hists], "bias": [h.bias() for h in hists], "calls": len(calls)}


def test_histogram_all_reduce_equals_one_process(sharded_results):
    """Every layer's histogram summed over 2 ranks with ONE all-reduce is the histogram of all the tokens in one
    process, so the new biases are identical."""
    got = sharded_results["histogram"]
    assert got["calls"] == 1
    scores, biases = _scores_and_biases()
    for i in range(LAYERS):
        h = balance.QuantileHistogram(biases[i], K, BINS)
        h.update(scores[i])
        assert torch.equal(got["counts"][i], h.counts)
        assert torch.equal(got["bias"][i], h.bias())
        # and the histogram reading is within two bins of the exact update (balance.py's bound)
        assert (h.bias() - balance.quantile_balance_exact(scores[i], biases[i], K)).abs().max() <= 2 * h.bin_width
