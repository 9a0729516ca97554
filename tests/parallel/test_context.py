"""Context parallelism on 4 gloo ranks equals the unsplit rows, forward and backward, for a KDA and an MLA layer.

Two packed rows of 4 x 11 tokens. Row 0 has documents that start inside a segment (7, 25, 26, 38), one that spans
three segments ([7, 25): the fold passes through a whole segment's M), one that ends exactly at a segment boundary
([26, 33)), a one-token document, and one that starts exactly at a boundary (33). Row 1 (its own packing, as in a
training batch) ends its first document exactly at the first boundary (11) and runs one from 15 to the end, across
three boundaries. Awkward sizes throughout.
"""

import pytest
import torch

from openk3.model.model import GatedMLA, K3ForCausalLM, KimiDeltaAttention, segment_positions
from openk3.parallel.context import apply_context_parallel, kda_context_parallel, local_rows, mla_context_parallel
from openk3.train.data import IGNORE_INDEX
from openk3.train.trainer import MLAMaxLogits, global_loss_share, sum_over_ranks
from tests.helpers import rel_err
from tests.parallel.dist import init_gloo, spawn_results
from tests.train.test_train import small_config

R, L, B = 4, 11, 2
ROW0 = [0, 7, 25, 26, 33, 38]
ROW1 = [0, 11, 15]
CU = torch.tensor(ROW0 + [R * L + c for c in ROW1] + [B * R * L])  # over the flattened B x R L tokens
LAYERS = ("kda", "mla")


def layer_and_inputs(kind: str, config=None):
    torch.manual_seed(5)
    config = config or small_config()
    layer = KimiDeltaAttention(config) if kind == "kda" else GatedMLA(config)
    for p in layer.parameters():  # fresh random values everywhere (the zero / one inits would hide terms)
        p.data = torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.2)
    if kind == "kda":
        layer.A_log.data = torch.rand_like(layer.A_log) + 0.5
    x = torch.randn(B, R * L, config.hidden_size)
    return layer, x, torch.randn(B, R * L, config.hidden_size)


def full_forward(layer, kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "kda":
        return layer(x, cu_seqlens=CU.to(x.device), pos=segment_positions(CU, B * R * L).view(B, R * L).to(x.device))
    doc = torch.zeros(B * R * L, dtype=torch.long)
    doc[CU[1:-1]] = 1
    doc = doc.cumsum(0).view(B, R * L)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(R * L, R * L, dtype=torch.bool).tril()
    return layer(x, mask=mask[:, None].to(x.device))


def _worker(rank: int, world: int, out) -> None:
    init_gloo()
    results = {}
    for kind in LAYERS:
        layer, x, dy = layer_and_inputs(kind)
        rows = slice(rank * L, (rank + 1) * L)
        xr = x[:, rows].clone().requires_grad_()
        cp = kda_context_parallel if kind == "kda" else mla_context_parallel
        y = cp(layer, xr, CU)
        (y * dy[:, rows]).sum().backward()
        ys = [torch.empty_like(y) for _ in range(world)]
        torch.distributed.all_gather(ys, y.detach().contiguous())
        dxs = [torch.empty_like(xr) for _ in range(world)]
        torch.distributed.all_gather(dxs, xr.grad.contiguous())
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        for g in grads.values():  # parameters are replicated: their gradient is the sum over the segments
            torch.distributed.all_reduce(g)
        results[kind] = {"y": torch.cat(ys, 1), "dx": torch.cat(dxs, 1), "grads": grads}
    results["model"] = _model_worker(rank, world)
    if rank == 0:
        torch.save(results, out)


def model_and_batch():
    """The small training model (2 KDA layers, 1 MLA, AttnRes, MoE) with its MLA queries scaled up (so QK-Clip's
    max logits are not all alike), and a packed batch of B rows with CU's packing and some ignored labels."""
    torch.manual_seed(7)
    model = K3ForCausalLM(small_config())
    model.reset_parameters(seed=7)
    with torch.no_grad():
        model.model.layers[2].self_attn.q_b_proj.weight.mul_(30)
    ids = torch.randint(0, model.config.vocab_size, (B, R * L))
    labels = ids.roll(-1, 1)
    labels[:, ::5] = IGNORE_INDEX
    return model, ids, labels


def _model_worker(rank: int, world: int) -> dict:
    """The whole model under `apply_context_parallel`, as the trainer runs it (without FSDP: the parameter
    gradients are summed here): the loss of every rank's slice weighted to the whole batch's mean."""
    model, ids, labels = model_and_batch()
    cp = apply_context_parallel(model, None)
    max_logits = MLAMaxLogits(model, cp)
    ids, labels, cu = local_rows(ids, labels, CU, rank, world)
    with cp.packing(CU):
        loss = model(ids, labels=labels, cu_seqlens=cu).loss
        share = global_loss_share(labels, world)
        (loss * share / world).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        torch.distributed.all_reduce(g)
    maxima = max_logits.max_H[0].clone()  # this rank's queries; MLAMaxLogits.clip_ max-reduces over the ranks
    torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
    with torch.no_grad():
        plain = model(ids, labels=labels, cu_seqlens=cu).loss  # outside `packing`: the slice alone, as a model
    return {"loss": sum_over_ranks(loss * share / world), "grads": grads, "max_logits": maxima,
            "plain_loss": sum_over_ranks(plain * share / world)}


def test_the_model_under_context_parallelism_equals_the_whole_rows(cp_results):
    """`apply_context_parallel` on the whole model (KDA, MLA, AttnRes, MoE): loss, every parameter gradient and
    QK-Clip's max logits per head equal one process on the unsplit rows; outside `packing` the mixers are the
    ordinary ones (each slice alone: another loss)."""
    model, ids, labels = model_and_batch()
    max_logits = MLAMaxLogits(model)
    loss = model(ids, labels=labels, cu_seqlens=CU).loss
    loss.backward()
    got = cp_results["model"]
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert abs(got["plain_loss"] - loss.item()) > 1e-3
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(got["grads"][name], p.grad) < 1e-5, name
    assert rel_err(got["max_logits"], max_logits.max_H[0]) < 1e-6
    assert got["max_logits"].unique().numel() == got["max_logits"].numel() > 1


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> dict:
    return spawn_results(R, _worker, tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("kind", LAYERS)
def test_context_parallel_equals_the_unsplit_row(cp_results, kind):
    layer, x, dy = layer_and_inputs(kind)
    x = x.clone().requires_grad_()
    y = full_forward(layer, kind, x)
    (y * dy).sum().backward()
    got = cp_results[kind]
    assert rel_err(got["y"], y) < 1e-5
    assert rel_err(got["dx"], x.grad) < 1e-5
    for name, p in layer.named_parameters():
        assert rel_err(got["grads"][name], p.grad) < 1e-5, name


def test_the_fold_matters(cp_results):
    """Segment 1 run alone (its documents cut at its start) is far from the true output the fold gives: without
    the incoming state and the conv halo the test above would fail."""
    layer, x, _ = layer_and_inputs("kda")
    y = full_forward(layer, "kda", x)
    alone = layer(x[:1, L:2 * L], cu_seqlens=torch.tensor([0, L]), pos=torch.arange(L)[None])
    assert rel_err(alone, y[:1, L:2 * L]) > 1e-2
    assert rel_err(cp_results["kda"]["y"][:, L:2 * L], y[:, L:2 * L]) < 1e-5
