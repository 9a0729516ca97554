"""Inference caches: the paged MLA pool on ragged batches, KDA checkpoints, speculative rollback, the prefix cache."""

import random

import pytest
import torch

from openk3.config import K3Config, kimi_k3, tiny
from openk3.model import K3ForCausalLM, KimiDeltaAttention
from openk3.serve.cache import (KDAState, PagedSeq, PagePool, PrefixCache, cache_bytes_per_token, cat_kda_states,
                                new_kda_states, paged_cache, rollback_kda, select_kda_rows, split_kda_rows)
from tests.helpers import rel_err


def small_config(family: str = "k3") -> K3Config:
    """Every K3 feature at hidden 64 (KDA layers 1, 2, 4, 5; MLA layers 3, 6), or the Kimi-Linear family."""
    c = tiny(vocab_size=256).replace(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=4,
        num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32,
        linear_attn_config={"num_heads": 2, "head_dim": 16})
    if family == "kimi-linear":
        c = c.replace(hidden_act="silu", attn_res_block_size=None, routed_expert_hidden_size=None,
                      latent_moe_use_norm=False, q_lora_rank=None, mla_use_output_gate=False,
                      routed_scaling_factor=2.446, quantization_config=None,
                      linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None})
    return c


def small_model(family: str = "k3", seed: int = 0, dense: bool = False) -> K3ForCausalLM:
    """`small_config(family)` with random weights; `dense`: every FFN a dense MLP (no MoE layer)."""
    torch.manual_seed(seed)
    config = small_config(family)
    if dense:
        config = config.replace(first_k_dense_replace=config.num_hidden_layers)
    model = K3ForCausalLM(config).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing, so the wiring matters
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    return model


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_paged_ragged_batch_equals_full_forward(family):
    """Rows of different lengths prefilled separately in awkward chunks (B = 1), then decoded together one token at
    a time, then one 3-token step (the speculative verify shape): every logit equals the full forward's."""
    model = small_model(family)
    c = model.config
    pool = PagePool(c, num_pages=64, page_size=4, device="cpu", dtype=torch.float32)
    lengths, chunk, steps = [3, 11, 6], 5, 4
    ids = [torch.randint(0, c.vocab_size, (n + steps + 3,)).tolist() for n in lengths]
    seqs = [PagedSeq(reserved=16) for _ in lengths]
    pool.reserve(16 * len(lengths))
    got = [[] for _ in lengths]
    batch = new_kda_states(c, 0, "cpu", torch.float32)
    with torch.no_grad():
        for b, n in enumerate(lengths):
            kda = new_kda_states(c, 1, "cpu", torch.float32)
            for s in range(0, n, chunk):
                part = ids[b][s:min(n, s + chunk)]
                got[b].append(model(torch.tensor([part]), cache=paged_cache(pool, kda, [seqs[b]], len(part))).logits[0])
                seqs[b].length += len(part)
            batch = cat_kda_states(batch, kda)
        for T in [1] * steps + [3]:
            x = torch.tensor([ids[b][seqs[b].length:seqs[b].length + T] for b in range(len(lengths))])
            logits = model(x, cache=paged_cache(pool, batch, seqs, T)).logits
            for b in range(len(lengths)):
                got[b].append(logits[b])
                seqs[b].length += T
        for b in range(len(lengths)):
            full = model(torch.tensor([ids[b][:seqs[b].length]])).logits[0]
            assert rel_err(torch.cat(got[b]), full) < 1e-4, (family, b)
    # Pages were taken from the reservations only, and page 0 (the padding page) was never handed out.
    assert pool.reserved == 16 * len(lengths) - sum(len(s.pages) for s in seqs)
    assert all(0 not in s.pages for s in seqs)


def test_paged_long_chunks_take_the_maskless_expanded_path():
    """A batch-1 prompt prefilled in chunks longer than ABSORB_MAX_TOKENS over pages it ends inside: the layout
    builds no mask, the latents come back cut to the real keys, and the logits equal one full forward; rows of
    different lengths still get their dense mask."""
    model = small_model("k3", seed=7)
    c = model.config
    pool = PagePool(c, num_pages=32, page_size=8, device="cpu", dtype=torch.float32)
    pool.reserve(12)
    seq = PagedSeq(reserved=12)
    ids = torch.randint(0, c.vocab_size, (1, 62))
    kda = new_kda_states(c, 1, "cpu", torch.float32)
    parts = []
    with torch.no_grad():
        for s, e in [(0, 19), (19, 44), (44, 62)]:
            cache = paged_cache(pool, kda, [seq], e - s)
            mla = next(layer for layer in cache.layers if not isinstance(layer, KDAState))
            assert mla.layout.mask is None and mla.layout.keys == e
            parts.append(model(ids[:, s:e], cache=cache).logits)
            seq.length = e
        full = model(ids).logits
    assert rel_err(torch.cat(parts, dim=1), full) < 2e-5
    other = PagedSeq(reserved=4)
    pool.reserve(4)
    ragged = paged_cache(pool, kda, [seq, other], 1)
    mla = next(layer for layer in ragged.layers if not isinstance(layer, KDAState))
    lat, mask = mla.append(torch.randn(2, 1, c.kv_lora_rank + c.qk_rope_head_dim))
    assert mask is not None and mask.shape == (2, 1, 1, lat.shape[1]) and lat.shape[1] == 64
    assert mask[0, 0, 0].sum() == 63 and mask[1, 0, 0].sum() == 1


@pytest.mark.parametrize("page_size", [1, 5, 8])
def test_layout_writes_every_new_token_where_its_position_says(page_size):
    """`PagedLayout.build` writes runs of positions per page; the reference is the per-token rule: position pos of
    a row goes to page pages[pos // page_size] at offset pos % page_size. Ragged rows (empty, ending inside a page,
    ending on a boundary) and chunks that cross several pages."""
    from openk3.serve.cache import PagedLayout
    rng = random.Random(page_size)
    for T in (1, 3, 17, 40):
        lengths = [0, page_size - 1, 2 * page_size, rng.randrange(60)]
        seqs = [PagedSeq(pages=rng.sample(range(1, 500), -(-(L + T) // page_size)), length=L) for L in lengths]
        lay = PagedLayout.build(seqs, T, page_size, "cpu")
        want = [(s.pages[pos // page_size], pos % page_size) for s in seqs for pos in range(s.length, s.length + T)]
        assert list(zip(lay.write_page.tolist(), lay.write_offset.tolist())) == want
        P = -(-(max(lengths) + T) // page_size)
        assert lay.read_pages.tolist() == [s.pages[:P] + [0] * (P - len(s.pages[:P])) for s in seqs]
        assert lay.keys == max(lengths) + T and lay.mask is not None


def test_batch_rows_join_and_leave():
    c = small_config()
    a, b = new_kda_states(c, 2, "cpu", torch.float32), new_kda_states(c, 1, "cpu", torch.float32)
    for s in a + b:
        s.recurrent.normal_()
        s.conv.normal_()
    both = cat_kda_states(a, b)
    picked = select_kda_rows(both, [2, 0])
    for x, y, z in zip(picked, a, b):
        assert torch.equal(x.recurrent[0], z.recurrent[0]) and torch.equal(x.recurrent[1], y.recurrent[0])
        assert torch.equal(x.conv[0], z.conv[0]) and torch.equal(x.conv[1], y.conv[0])


def test_split_rows_are_each_rows_own_states():
    """A prefill group's states split into its rows' batch-1 states (views): each equals its row, and writing one
    row's state in place (as the next chunk's forward does) leaves the other rows alone. Fresh states start at zero,
    each layer its own."""
    c = small_config()
    fresh = new_kda_states(c, 3, "cpu", torch.float32)
    assert len(fresh) == c.layer_types.count("kda") and all(not s.recurrent.any() and not s.conv.any() for s in fresh)
    for s in fresh:
        s.recurrent.normal_()
        s.conv.normal_()
    before = [KDAState(s.recurrent.clone(), s.conv.clone()) for s in fresh]
    rows = split_kda_rows(fresh)
    assert len(rows) == 3 and all(len(r) == len(fresh) for r in rows)
    for b, row in enumerate(rows):
        for x, whole in zip(row, before):
            assert x.recurrent.shape[0] == 1 and torch.equal(x.recurrent[0], whole.recurrent[b])
            assert torch.equal(x.conv[0], whole.conv[b])
    rows[1][0].recurrent.add_(1.0)
    rows[1][-1].conv.zero_()
    assert torch.equal(rows[0][0].recurrent[0], before[0].recurrent[0])
    assert torch.equal(rows[2][0].recurrent[0], before[0].recurrent[2])
    assert torch.equal(rows[0][-1].conv[0], before[-1].conv[0]) and torch.equal(rows[2][-1].conv[0], before[-1].conv[2])
    assert torch.equal(rows[1][0].recurrent[0], before[0].recurrent[1] + 1.0)
    assert torch.equal(fresh[0].recurrent[1], before[0].recurrent[1] + 1.0)  # views of the batch, not copies
    assert torch.equal(fresh[1].recurrent, before[1].recurrent)  # another layer's state is its own memory
    zero = new_kda_states(c, 2, "cpu", torch.float32)
    zero[0].recurrent.fill_(1.0)
    zero[0].conv.fill_(1.0)
    assert all(not s.recurrent.any() and not s.conv.any() for s in zero[1:])
    n = c.num_hidden_layers
    no_kda = c.replace(linear_attn_config={"kda_layers": [], "full_attn_layers": list(range(1, n + 1))})
    assert no_kda.layer_types == ["mla"] * n
    assert new_kda_states(no_kda, 1, "cpu", torch.float32) == [] == new_kda_states(no_kda, 0, "cpu", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_is_exact_and_immutable(dtype):
    c = small_config()
    pool = PagePool(c, num_pages=200, page_size=4, device="cpu", dtype=dtype)
    assert pool.checkpoint_pages > 1
    scattered = pool.alloc(2 * pool.checkpoint_pages)
    pool.release(scattered[::2])  # the checkpoint lands on pages that are not contiguous
    pages = pool.alloc(pool.checkpoint_pages)
    states = new_kda_states(c, 3, "cpu", dtype)
    for s in states:
        s.recurrent.normal_()
        s.conv.copy_(torch.randn(s.conv.shape))
    pool.write_checkpoint(states, 1, pages)
    restored = pool.read_checkpoint(pages)
    for s, r in zip(states, restored):
        assert r.conv.dtype == dtype and r.recurrent.dtype == torch.float32
        assert torch.equal(r.recurrent[0], s.recurrent[1]) and torch.equal(r.conv[0], s.conv[1])
        r.recurrent.add_(1.0)  # a request extending its copy must not touch the stored checkpoint
    assert torch.equal(pool.read_checkpoint(pages)[0].recurrent[0], states[0].recurrent[1])


def test_pool_accounting_and_errors():
    pool = PagePool(small_config(), num_pages=6, page_size=4, device="cpu", dtype=torch.float32)
    assert pool.available == 5  # page 0 is never handed out
    pool.reserve(3)
    with pytest.raises(RuntimeError, match="asked for 3 pages, 2 available"):
        pool.alloc(3)
    p = pool.alloc(2, from_reserve=True)
    assert pool.reserved == 1 and pool.available == 2
    pool.mla[p[0]] = 7.0
    q = pool.copy_page(p[0])
    assert torch.equal(pool.mla[q], pool.mla[p[0]]) and q not in p
    pool.retain([q])
    pool.release([q])
    assert q not in pool.free
    pool.release([q])
    assert q in pool.free
    assert pool.mla[pool.alloc(1)[0]].abs().sum() == 0  # handed out zeroed
    with pytest.raises(ValueError, match="page_size=0"):
        PagePool(small_config(), num_pages=6, page_size=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no MLA layer"):
        PagePool(small_config().replace(num_hidden_layers=2, linear_attn_config={"kda_layers": [1, 2],
                                                                                 "full_attn_layers": []}),
                 num_pages=6, page_size=4, device="cpu", dtype=torch.float32)


def test_rollback_equals_running_only_the_kept_tokens():
    """KDA rollback from the kept per-token inputs equals a forward over only the kept tokens, per row, for keeps of
    0, some and all (recurrent state and conv tail)."""
    c = small_config()
    torch.manual_seed(1)
    layer = KimiDeltaAttention(c)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    B, T = 3, 5
    x = torch.randn(B, T, c.hidden_size)
    start = new_kda_states(c, B, "cpu", torch.float32)[0]
    start.recurrent.normal_(std=0.1)
    start.conv.normal_()
    keep = torch.tensor([0, 2, 5])
    with torch.no_grad():
        state = KDAState(start.recurrent, start.conv)
        layer(x, state=state, keep_inputs=True)
        assert state.inputs["k"].shape == (B, T, 2, 16)
        rollback_kda(state, start, state.inputs, keep)
        for b, n in enumerate(keep.tolist()):
            want = KDAState(start.recurrent[b:b + 1], start.conv[b:b + 1])
            if n:
                layer(x[b:b + 1, :n], state=want)
            assert rel_err(state.recurrent[b], want.recurrent[0]) < 1e-5
            assert rel_err(state.conv[b], want.conv[0]) < 1e-6  # the same raw projections, other matmul shapes


def test_cache_bytes_match_the_spec():
    """K3: 576 latent values per token per MLA layer, 27 KiB per token over 24 layers in bf16, about 4x less than
    MLA in every layer; the KDA state is 6 MiB per layer (H x d x d fp32) plus the conv tail."""
    sizes = cache_bytes_per_token(kimi_k3())
    assert sizes["mla_bytes_per_token"] == 24 * 576 * 2 == 27 * 1024
    assert sizes["all_mla_bytes_per_token"] / sizes["mla_bytes_per_token"] == 93 / 24
    assert sizes["kda_state_bytes"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2)
    assert sizes["all_mha_bytes_per_token"] == 93 * 96 * (192 + 128) * 2
    pool = PagePool(tiny(), num_pages=2, page_size=8, device="meta", dtype=torch.bfloat16)
    assert pool.page_bytes / 8 == cache_bytes_per_token(tiny())["mla_bytes_per_token"]


# ------------------------------------------------------------------------------------------ prefix cache

class FakeRequest:
    """Stands in for a request: its tokens, pages holding distinct latents, and random KDA states."""

    def __init__(self, cache: PrefixCache, tokens: list[int], salt: str | None = None):
        pool = cache.pool
        self.tokens, self.salt = tokens, salt
        match = cache.lookup(tokens, salt)
        cache.pin(match)
        self.seq = PagedSeq(reserved=pool.pages_for(len(tokens)))
        pool.reserve(self.seq.reserved)
        self.path, self.restored = cache.use(match, len(tokens), salt, self.seq)
        self.match_length = match.length
        self.states = new_kda_states(pool.config, 1, "cpu", torch.float32)

    def run_to(self, cache: PrefixCache, n: int, checkpoint: bool) -> None:
        """'Compute' tokens up to n (write their latents and states), then publish a checkpoint there or just the
        blocks."""
        pool = cache.pool
        self.seq.grow(pool, n)
        for pos in range(self.seq.length, n):
            pool.mla[self.seq.pages[pos // pool.page_size], :, pos % pool.page_size] = float(self.tokens[pos])
        self.seq.length = n
        for s in self.states:
            s.recurrent.fill_(float(n))
        make_room = lambda k: all(pool.available >= k or cache.evict_one() for _ in range(1000))
        if checkpoint:
            cache.checkpoint(self.path, self.tokens, self.seq, self.states, 0, make_room)
        else:
            cache.publish_blocks(self.path, self.tokens, n, self.seq)

    def finish(self, cache: PrefixCache) -> None:
        cache.release(self.path)
        self.seq.free(cache.pool)


def make_cache(page_size: int = 4, hash_interval: int = 8, num_pages: int = 400) -> PrefixCache:
    return PrefixCache(PagePool(small_config(), num_pages, page_size, "cpu", torch.float32), hash_interval)


def test_match_is_cut_back_to_the_deepest_checkpoint():
    """The spec's example scaled down (hash every 8 tokens, 35 matching tokens): with checkpoints every 8 the request
    resumes at 32; without the one at 32 it resumes at 24; and a full match still leaves one token to compute."""
    cache = make_cache()
    tokens = list(range(100, 140))
    a = FakeRequest(cache, tokens)
    for n in (8, 16, 24, 32):
        a.run_to(cache, n, checkpoint=True)
    a.run_to(cache, 40, checkpoint=False)
    a.finish(cache)
    prompt = tokens[:35] + [1, 2, 3]
    assert cache.lookup(prompt, None).length == 32
    assert cache.lookup(tokens[:33], None).length == 32
    assert cache.lookup(tokens[:32], None).length == 24  # 32 would leave nothing to compute
    node32 = cache.lookup(prompt, None).nodes[-1]
    cache.pool.release(node32.checkpoint)
    node32.checkpoint = None
    assert cache.lookup(prompt, None).length == 24
    assert cache.lookup([7] + tokens[1:], None).length == 0


def test_hit_shares_pages_copies_the_partial_page_and_restores_a_copy():
    cache = make_cache(page_size=4, hash_interval=6)  # boundaries fall inside pages
    tokens = list(range(50, 80))
    a = FakeRequest(cache, tokens)
    a.run_to(cache, 18, checkpoint=True)
    a.run_to(cache, 25, checkpoint=True)  # a turn end between boundaries: a tail node
    b = FakeRequest(cache, tokens[:25] + [9, 9])
    assert b.match_length == 25 and len(b.path.tails) == 1
    assert b.seq.pages[:6] == a.seq.pages[:6]  # pages 0..5 (tokens 0..23) are shared
    assert b.seq.pages[6] != a.seq.pages[6]  # page 6 holds token 24 and beyond: copied
    pool = cache.pool
    latents = torch.cat([pool.mla[p, 0, :, 0] for p in b.seq.pages])[:25]
    assert latents.tolist() == [float(t) for t in tokens[:25]]
    assert all(float(r.recurrent.max()) == 25.0 for r in b.restored)
    b.restored[0].recurrent.add_(1)  # the stored checkpoint is untouched
    assert float(pool.read_checkpoint(b.path.tails[0].checkpoint)[0].recurrent.max()) == 25.0
    assert cache.counters()["hit_tokens"] == 25


def test_salt_keeps_tenants_apart():
    cache = make_cache()
    tokens = list(range(20))
    a = FakeRequest(cache, tokens, salt="tenant-a")
    a.run_to(cache, 16, checkpoint=True)
    a.finish(cache)
    assert cache.lookup(tokens, "tenant-a").length == 16
    assert cache.lookup(tokens, "tenant-b").length == 0
    assert cache.lookup(tokens, None).length == 0


def test_lru_refreshes_only_what_was_used_and_evicts_dependents():
    cache = make_cache()
    tokens = list(range(200, 240))
    a = FakeRequest(cache, tokens)
    a.run_to(cache, 8, checkpoint=True)
    a.run_to(cache, 24, checkpoint=True)
    a.finish(cache)
    # A later hit resumes at 24: blocks 0..2 and the checkpoint at 24 are refreshed, the one at 8 is not.
    b = FakeRequest(cache, tokens[:30])
    assert b.match_length == 24
    b.finish(cache)
    n8 = cache.lookup(tokens[:9], None).nodes[-1]
    n24 = cache.lookup(tokens[:25], None).nodes[-1]
    assert n8.checkpoint_used < n24.checkpoint_used
    assert cache.evict_one() and n8.checkpoint is None and n24.checkpoint is not None
    # Evicting goes leaf first: the leaf block (with its checkpoint) goes before its parents.
    before = cache.pool.available
    assert cache.evict_one() and n24.key not in cache.nodes
    assert cache.pool.available == before + cache.pool.checkpoint_pages + 2  # block 2 (tokens 16..23): 2 pages
    assert cache.lookup(tokens[:30], None).length == 0  # nothing left to resume from
    while cache.evict_one():
        pass
    assert not cache.nodes and cache.pool.available == cache.pool.num_pages - 1
    assert cache.counters()["evictions"] == 2 + 3  # checkpoints at 8 and 24, blocks 0..2


def test_pinned_prefixes_are_never_evicted():
    cache = make_cache()
    tokens = list(range(30))
    a = FakeRequest(cache, tokens)
    a.run_to(cache, 16, checkpoint=True)  # a is still running: its blocks are pinned
    assert cache.evict_one()  # only the checkpoint of a pinned node may go
    assert not cache.evict_one()
    assert len(cache.nodes) == 2
    a.finish(cache)
    assert cache.evict_one() and cache.evict_one() and not cache.nodes


def test_matched_checkpoint_survives_the_admission_that_uses_it():
    """An admission pins the match and its checkpoint together before making room, so making room cannot evict the
    state it is about to restore, even when that is the least recently used item."""
    cache = make_cache(num_pages=40)  # room for about one checkpoint
    old, new = list(range(20)), list(range(100, 120))
    a = FakeRequest(cache, old)
    a.run_to(cache, 16, checkpoint=True)
    a.finish(cache)
    match = cache.lookup(old, None)
    cache.pin(match)
    c = FakeRequest(cache, new)
    c.run_to(cache, 16, checkpoint=True)  # needs room; the pinned checkpoint is not a candidate
    assert match.nodes[-1].checkpoint is not None
    assert c.path.blocks[-1].checkpoint is None  # it declined instead
    cache.unpin(match)
