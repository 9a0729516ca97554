"""Expert parallelism: MoonEP and the plain all-to-all on 4 gloo ranks equal the one-process MoE, forward and
backward, for a balanced and a deliberately skewed router; MoonEP gives every rank exactly S*K rows."""

import pytest
import torch

from openk3.ops.moe import moe_experts_loop
from openk3.ops.situ import situ_glu
from openk3.parallel.expert import PLANS, ep_moe_experts, home_rank, load_imbalance, plan_slots
from tests.helpers import rel_err
from tests.parallel.dist import init_gloo, spawn_results

R, S, K, E, D, F = 4, 13, 3, 8, 8, 12  # awkward: 13 tokens a rank, 39 slots; D, F multiples of 4 (grouped mm)
ROUTERS = ("balanced", "skewed")


def act(gate, up):
    return situ_glu(gate, up, 4.0, 25.0)


def case(router: str):
    """Inputs of all ranks together: x [R*S, D], idx [R*S, K], w [R*S, K], expert stacks, output cotangent."""
    torch.manual_seed(0 if router == "balanced" else 1)
    scores = torch.rand(R * S, E)
    if router == "skewed":  # experts 0 and 1 (both homed on rank 0) win almost every token
        scores[:, :2] += 1.0
    idx = scores.topk(K, dim=1).indices
    w = torch.rand(R * S, K) + 0.1
    x = torch.randn(R * S, D)
    w1, w2, w3 = torch.randn(E, F, D) * 0.5, torch.randn(E, D, F) * 0.5, torch.randn(E, F, D) * 0.5
    return x, idx, w, w1, w2, w3, torch.randn(R * S, D)


def _worker(rank: int, world: int, out) -> None:
    init_gloo()
    results = {}
    per = E // world
    for router in ROUTERS:
        x, idx, w, w1, w2, w3, dy = case(router)
        rows, home = slice(rank * S, (rank + 1) * S), slice(rank * per, (rank + 1) * per)
        for plan in PLANS:
            leaves = [t[s].clone().requires_grad_() for t, s in ((x, rows), (w, rows), (w1, home), (w2, home),
                                                                  (w3, home))]
            xr, wr, w1r, w2r, w3r = leaves
            stats = {}
            y = ep_moe_experts(xr, idx[rows], wr, w1r, w2r, w3r, act, plan=plan, stats=stats)
            (y * dy[rows]).sum().backward()
            mine = [y.detach()] + [t.grad for t in leaves]
            gathered = [[torch.empty_like(t) for _ in range(world)] for t in mine]
            for g, t in zip(gathered, mine):
                torch.distributed.all_gather(g, t.contiguous())
            results[router, plan] = {"y": torch.cat(gathered[0]), "dx": torch.cat(gathered[1]),
                                     "dw": torch.cat(gathered[2]), "dw1": torch.cat(gathered[3]),
                                     "dw2": torch.cat(gathered[4]), "dw3": torch.cat(gathered[5]), **stats}
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory) -> dict:
    return spawn_results(R, _worker, tmp_path_factory.mktemp("ep"), weights_only=False)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("router", ROUTERS)
def test_expert_parallel_equals_one_process(ep_results, router, plan):
    """Forward and backward (tokens, routing weights, every expert's weights) against the loop reference on all
    R*S tokens in one process. Under MoonEP with the skewed router the home experts' gradients include those of
    their replicas, summed back."""
    x, idx, w, w1, w2, w3, dy = case(router)
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    y = moe_experts_loop(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], act)
    (y * dy).sum().backward()
    got = ep_results[router, plan]
    assert rel_err(got["y"], y) < 1e-5
    for key, leaf in zip(("dx", "dw", "dw1", "dw2", "dw3"), leaves):
        assert rel_err(got[key], leaf.grad) < 1e-5, key
    if router == "skewed" and plan == "moonep":
        assert sum(got["replicas"]) > 0  # the test really went through replicas


def test_moonep_balances_a_skewed_router(ep_results):
    """The load-imbalance report (docs/parallel.md): rows computed per rank, max / mean."""
    plain, moon = ep_results["skewed", "plain"], ep_results["skewed", "moonep"]
    assert moon["received"] == [S * K] * R and load_imbalance(moon["received"]) == 1.0
    assert load_imbalance(plain["received"]) > 2.0  # rank 0 holds the two favourite experts
    assert sum(plain["received"]) == sum(moon["received"]) == R * S * K
    assert ep_results["balanced", "moonep"]["received"] == [S * K] * R


@pytest.mark.parametrize("seed", range(20))
def test_plan_gives_every_rank_exactly_its_slots(seed):
    """Random and extreme loads: every rank gets exactly S*K slots, each expert's pieces cover its load once, no
    replica sits on its home rank, and at most E/R replicas land on one rank (spec section 8)."""
    g = torch.Generator().manual_seed(seed)
    ranks, experts, slots = [2, 4, 8][seed % 3], 16, 24
    skew = torch.linspace(0, 6 * (seed % 4), experts)
    counts = torch.stack([torch.multinomial(torch.softmax(skew, 0), slots, replacement=True, generator=g)
                          .bincount(minlength=experts) for _ in range(ranks)])
    sp = plan_slots(counts, "moonep")
    per = experts // ranks
    assert sp.received == [slots] * ranks
    for e in range(experts):
        pieces = [p for p in sp.pieces if p.expert == e]
        assert sum(p.count for p in pieces) == int(counts[:, e].sum())
        assert all(a.start + a.count == b.start for a, b in zip(pieces, pieces[1:]))
    for r in range(ranks):
        replicas = sp.replicas(r, per)
        assert all(home_rank(e, per) != r for e in replicas) and len(replicas) <= per
    plain = plan_slots(counts, "plain")
    assert plain.received == [int(counts[:, r * per:(r + 1) * per].sum()) for r in range(ranks)]


def test_plan_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="7 experts cannot be split evenly over 2"):
        plan_slots(torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="same S\\*K pairs on every rank"):
        plan_slots(torch.tensor([[1, 2], [3, 3]]))
    with pytest.raises(ValueError, match="plan='even'"):
        plan_slots(torch.ones(2, 2, dtype=torch.long), "even")
