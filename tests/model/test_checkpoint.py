"""Checkpoint format (K3_SPEC sections 5 and 6): names, storage dtypes and shapes, shards and index, MXFP4 experts,
bit-identical round trips, clear errors, atomic saves."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from openk3.config import kimi_k3, kimi_linear_48b, tiny
from openk3.model import checkpoint
from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import (init_checkpoint, iter_checkpoint_tensors, load_pretrained, name_map, read_index,
                                     save_pretrained)
from openk3.ops.mxfp import dequantize_mxfp4, fake_quant_mxfp4, quantize_mxfp4

SMALL_SHARDS = 200_000  # bytes: the tiny model (~4 MB in fp32) splits into many shards
FP32_STORED = ("o_norm.weight", "conv1d.weight", "dt_bias", "A_log", "e_score_correction_bias")


def kimi_linear_tiny():
    """A tiny config of the Kimi-Linear family: no K3 field set, so Kimi-Linear's names and config.json."""
    return tiny().replace(
        hidden_act="silu", attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
        q_lora_rank=None, mla_use_output_gate=False, routed_scaling_factor=2.446, quantization_config=None,
        linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None})


def make_model(config, dtype=torch.float32, seed=0, mxfp4_exact=True) -> K3ForCausalLM:
    """A model with every tensor random, including the ones the init sets to constants (norms, AttnRes queries,
    router bias). With `mxfp4_exact`, MXFP4 experts are made representable so a round trip is exact."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            noise = torch.randn(t.shape, generator=g)
            if name.endswith(("norm.weight", "_res_norm.weight")):
                t.copy_(1 + 0.2 * noise)
            elif name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                t.copy_(0.3 * noise)
            if mxfp4_exact and config.mxfp4_experts and name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                t.copy_(fake_quant_mxfp4(t))
    return model


def headers(path) -> dict:
    return {n: (i.dtype, list(i.shape)) for n, i in read_index(path).items()}


def rewrite_tensor(path, name, tensor):
    """Replace (tensor given) or delete (None) one tensor of a saved checkpoint, keeping the index consistent.
    A new name goes into the first shard."""
    index_file = path / checkpoint.INDEX_NAME
    index = json.loads(index_file.read_text())
    file = index["weight_map"].get(name, sorted(set(index["weight_map"].values()))[0])
    tensors = load_file(path / file)
    if tensor is None:
        del tensors[name]
        del index["weight_map"][name]
    else:
        tensors[name] = tensor
        index["weight_map"][name] = file
    save_file(tensors, path / file, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


def file_bytes(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ------------------------------------------------------------------------------------------- names

def test_k3_names_dtypes_and_shapes(tmp_path):
    """Spec section 6 names for every layer kind, in a bf16 model: fp32 where the spec says, MXFP4 experts."""
    c = tiny()  # layers 0, 1, 3, 4 KDA and 2, 5 MLA; layer 0 dense, the rest MoE; H=4 KDA heads of 32
    save_pretrained(make_model(c, torch.bfloat16), tmp_path / "ck", max_shard_bytes=SMALL_SHARDS)
    h = headers(tmp_path / "ck")
    P = "language_model.model.layers."
    F, De, D, E = c.moe_intermediate_size, c.expert_dim, c.hidden_size, c.num_experts
    expected = {
        "language_model.model.embed_tokens.weight": ("BF16", [c.vocab_size, D]),
        "language_model.model.norm.weight": ("BF16", [D]),
        "language_model.lm_head.weight": ("BF16", [c.vocab_size, D]),
        "language_model.model.output_attn_res_norm.weight": ("BF16", [D]),
        "language_model.model.output_attn_res_proj.weight": ("BF16", [1, D]),
        # every layer
        P + "0.input_layernorm.weight": ("BF16", [D]),
        P + "0.post_attention_layernorm.weight": ("BF16", [D]),
        P + "4.self_attention_res_norm.weight": ("BF16", [D]),
        P + "4.self_attention_res_proj.weight": ("BF16", [1, D]),
        P + "4.mlp_res_norm.weight": ("BF16", [D]),
        P + "4.mlp_res_proj.weight": ("BF16", [1, D]),
        # KDA
        P + "0.self_attn.q_proj.weight": ("BF16", [128, D]),
        P + "0.self_attn.k_conv1d.weight": ("F32", [128, 1, 4]),
        P + "0.self_attn.f_a_proj.weight": ("BF16", [32, D]),
        P + "0.self_attn.f_b_proj.weight": ("BF16", [128, 32]),
        P + "0.self_attn.b_proj.weight": ("BF16", [4, D]),
        P + "0.self_attn.dt_bias": ("F32", [128]),
        P + "0.self_attn.A_log": ("F32", [32]),  # 4 heads padded to head_dim 32
        P + "0.self_attn.o_norm.weight": ("F32", [32]),
        P + "0.self_attn.g_proj.weight": ("BF16", [128, D]),
        P + "0.self_attn.o_proj.weight": ("BF16", [D, 128]),
        # MLA
        P + "5.self_attn.q_a_proj.weight": ("BF16", [64, D]),
        P + "5.self_attn.q_a_layernorm.weight": ("BF16", [64]),
        P + "5.self_attn.q_b_proj.weight": ("BF16", [4 * 48, 64]),
        P + "5.self_attn.kv_a_proj_with_mqa.weight": ("BF16", [32 + 16, D]),
        P + "5.self_attn.kv_a_layernorm.weight": ("BF16", [32]),
        P + "5.self_attn.kv_b_proj.weight": ("BF16", [4 * 64, 32]),
        P + "5.self_attn.g_proj.weight": ("BF16", [128, D]),
        # dense layer 0
        P + "0.mlp.gate_proj.weight": ("BF16", [c.intermediate_size, D]),
        P + "0.mlp.up_proj.weight": ("BF16", [c.intermediate_size, D]),
        P + "0.mlp.down_proj.weight": ("BF16", [D, c.intermediate_size]),
        # MoE
        P + "1.block_sparse_moe.gate.weight": ("BF16", [E, D]),
        P + "1.block_sparse_moe.gate.e_score_correction_bias": ("F32", [E]),
        P + "1.block_sparse_moe.routed_expert_down_proj.weight": ("BF16", [De, D]),
        P + "1.block_sparse_moe.routed_expert_norm.weight": ("BF16", [De]),
        P + "1.block_sparse_moe.routed_expert_up_proj.weight": ("BF16", [D, De]),
        P + "1.block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", [F, D]),
        P + "1.block_sparse_moe.shared_experts.down_proj.weight": ("BF16", [D, F]),
        P + "1.block_sparse_moe.experts.3.w1.weight_packed": ("U8", [F, De // 2]),
        P + "1.block_sparse_moe.experts.3.w1.weight_scale": ("U8", [F, De // 32]),
        P + "1.block_sparse_moe.experts.3.w3.weight_packed": ("U8", [F, De // 2]),
        P + "1.block_sparse_moe.experts.7.w2.weight_packed": ("U8", [De, F // 2]),
        P + "1.block_sparse_moe.experts.7.w2.weight_scale": ("U8", [De, F // 32]),
    }
    assert {n: h.get(n) for n in expected} == expected
    assert all(n.startswith("language_model.") for n in h)
    assert not any(re.search(r"experts\.w\d|experts\.\d+\.w\d\.weight$|layers\.0\.block_sparse_moe", n) for n in h)
    assert sum(bool(re.search(r"\.experts\.\d+\.", n)) for n in h) == 5 * E * 3 * 2  # 5 MoE layers, packed + scale per matrix
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["dtype"]) == (["KimiK3ForConditionalGeneration"],
                                                                        "kimi_k3", "bfloat16")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    assert cfg["text_config"]["model_type"] == "kimi_linear" and "bos_token_id" not in cfg["text_config"]


def test_release_names_match_the_spec():
    """The release config's table gives the spec's shapes (section 6), without building any weights."""
    stored = {s.name: (s.shape, s.dtype) for e in name_map(kimi_k3()) for s in e.stored}
    P = "language_model.model.layers."
    assert stored[P + "0.self_attn.q_proj.weight"] == ((12288, 7168), None)
    assert stored[P + "0.self_attn.q_conv1d.weight"] == ((12288, 1, 4), torch.float32)
    assert stored[P + "0.self_attn.f_a_proj.weight"] == ((128, 7168), None)
    assert stored[P + "0.self_attn.f_b_proj.weight"] == ((12288, 128), None)
    assert stored[P + "0.self_attn.b_proj.weight"] == ((96, 7168), None)
    assert stored[P + "0.self_attn.dt_bias"] == ((12288,), torch.float32)
    assert stored[P + "0.self_attn.A_log"] == ((128,), torch.float32)
    assert stored[P + "0.self_attn.o_norm.weight"] == ((128,), torch.float32)
    assert stored[P + "0.mlp.gate_proj.weight"] == ((33792, 7168), None)
    assert stored[P + "0.self_attention_res_norm.weight"] == ((7168,), None)
    assert stored[P + "0.self_attention_res_proj.weight"] == ((1, 7168), None)
    assert stored[P + "92.self_attn.q_a_proj.weight"] == ((1536, 7168), None)
    assert stored[P + "92.self_attn.q_b_proj.weight"] == ((18432, 1536), None)
    assert stored[P + "91.self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), None)
    assert stored[P + "3.self_attn.kv_a_layernorm.weight"] == ((512,), None)
    assert stored[P + "3.self_attn.kv_b_proj.weight"] == ((24576, 512), None)
    assert stored[P + "1.block_sparse_moe.gate.weight"] == ((896, 7168), None)
    assert stored[P + "1.block_sparse_moe.gate.e_score_correction_bias"] == ((896,), torch.float32)
    assert stored[P + "1.block_sparse_moe.routed_expert_down_proj.weight"] == ((3584, 7168), None)
    assert stored[P + "1.block_sparse_moe.routed_expert_norm.weight"] == ((3584,), None)
    assert stored[P + "1.block_sparse_moe.routed_expert_up_proj.weight"] == ((7168, 3584), None)
    assert stored[P + "1.block_sparse_moe.shared_experts.gate_proj.weight"] == ((6144, 7168), None)
    assert stored[P + "92.block_sparse_moe.experts.895.w1.weight_packed"] == ((3072, 1792), torch.uint8)
    assert stored[P + "92.block_sparse_moe.experts.895.w1.weight_scale"] == ((3072, 112), torch.uint8)
    assert stored[P + "92.block_sparse_moe.experts.0.w2.weight_packed"] == ((3584, 1536), torch.uint8)
    assert stored["language_model.lm_head.weight"] == ((163840, 7168), None)
    assert P + "92.self_attn.A_log" not in stored and P + "3.self_attn.A_log" not in stored  # MLA layers


def test_kimi_linear_names(tmp_path):
    """A Kimi-Linear-style model uses Kimi-Linear's own names (no prefix), A_log [1, 1, H, 1], a bare config."""
    c = kimi_linear_tiny()
    save_pretrained(make_model(c), tmp_path / "ck", max_shard_bytes=SMALL_SHARDS)
    h = headers(tmp_path / "ck")
    D, F = c.hidden_size, c.moe_intermediate_size
    expected = {
        "model.embed_tokens.weight": ("F32", [c.vocab_size, D]),
        "lm_head.weight": ("F32", [c.vocab_size, D]),
        "model.layers.0.self_attn.A_log": ("F32", [1, 1, 4, 1]),
        "model.layers.0.self_attn.q_conv1d.weight": ("F32", [128, 1, 4]),
        "model.layers.0.self_attn.g_a_proj.weight": ("F32", [32, D]),
        "model.layers.0.self_attn.g_b_proj.weight": ("F32", [128, 32]),
        "model.layers.2.self_attn.q_proj.weight": ("F32", [4 * 48, D]),
        "model.layers.1.block_sparse_moe.experts.3.w1.weight": ("F32", [F, D]),
        "model.layers.1.block_sparse_moe.experts.3.w2.weight": ("F32", [D, F]),
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": ("F32", [c.num_experts]),
    }
    assert {n: h.get(n) for n in expected} == expected
    assert not any(n.startswith("language_model.") or "_res_" in n or "weight_packed" in n for n in h)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_linear" and "text_config" not in cfg and cfg["dtype"] == "float32"


@pytest.mark.parametrize("make_config", [tiny, kimi_linear_tiny])
def test_name_map_covers_the_model_once(make_config):
    c = make_config()
    entries = name_map(c)
    state = K3ForCausalLM(c).state_dict()
    covered = {(e.model_name, e.expert) for e in entries}
    expected = {(n, i) for n, t in state.items()
                for i in (range(t.shape[0]) if re.search(r"experts\.w[123]$", n) else [None])}
    assert covered == expected and len(entries) == len(expected)
    names = [s.name for e in entries for s in e.stored]
    assert len(names) == len(set(names))


# ----------------------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_config", [tiny, kimi_linear_tiny])
def test_save_load_bit_identical(tmp_path, make_config, dtype):
    model = make_model(make_config(), dtype)
    save_pretrained(model, tmp_path / "a", max_shard_bytes=SMALL_SHARDS)
    loaded = load_pretrained(tmp_path / "a")
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for name, t in before.items():
        # the fp32-stored tensors stay fp32 in the loaded model, holding the same values
        assert after[name].dtype == (torch.float32 if name.endswith(FP32_STORED) else dtype), name
        assert torch.equal(after[name].to(dtype), t), name
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # the config comes back (plus the checkpoint's "dtype", which a Kimi-Linear-style config keeps as an extra)
    assert {k: v for k, v in loaded.config.to_dict().items() if k != "dtype"} == model.config.to_dict()
    # saving the loaded model again writes the same shards, index and config
    save_pretrained(loaded, tmp_path / "b", max_shard_bytes=SMALL_SHARDS)
    a, b = file_bytes(tmp_path / "a"), file_bytes(tmp_path / "b")
    assert json.loads(a.pop("config.json")) == json.loads(b.pop("config.json"))
    assert a == b


def test_load_in_another_dtype(tmp_path):
    model = make_model(tiny(), torch.bfloat16)
    save_pretrained(model, tmp_path / "ck")
    loaded = load_pretrained(tmp_path / "ck", dtype=torch.float32)
    assert loaded.lm_head.weight.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.float())


def test_shards_and_index(tmp_path):
    model = make_model(tiny())
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=SMALL_SHARDS)
    ck = tmp_path / "ck"
    index = json.loads((ck / checkpoint.INDEX_NAME).read_text())
    shard_files = sorted(p.name for p in ck.glob("*.safetensors"))
    n = len(shard_files)
    assert n > 3
    assert shard_files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    for file in shard_files:
        tensors = load_file(ck / file)
        assert all(index["weight_map"][name] == file for name in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= SMALL_SHARDS or len(tensors) == 1, file
        total += size
    assert set(index["weight_map"]) == {name for name, _ in iter_checkpoint_tensors(ck)}
    assert index["metadata"]["total_size"] == total


# -------------------------------------------------------------------------------------------- MXFP4

def test_mxfp4_experts_store_quantised_values(tmp_path):
    """Experts that are not MXFP4-representable come back as dequantize(quantize(w)); the stored bytes are the
    E2M1 codes two a byte (low nibble = even column) and the E8M0 scales."""
    model = make_model(tiny(), mxfp4_exact=False)
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=SMALL_SHARDS)
    w2 = model.model.layers[4].block_sparse_moe.experts.w2.detach()  # [E, D, F]
    codes, scales = quantize_mxfp4(w2[5])
    stored = dict(iter_checkpoint_tensors(tmp_path / "ck"))
    packed = stored["language_model.model.layers.4.block_sparse_moe.experts.5.w2.weight_packed"]
    assert torch.equal(packed & 0x0F, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(stored["language_model.model.layers.4.block_sparse_moe.experts.5.w2.weight_scale"], scales)

    loaded = load_pretrained(tmp_path / "ck")
    for i in range(1, 6):
        for w in ("w1", "w2", "w3"):
            original = getattr(model.model.layers[i].block_sparse_moe.experts, w).detach()
            got = getattr(loaded.model.layers[i].block_sparse_moe.experts, w).detach()
            want = torch.stack([dequantize_mxfp4(*quantize_mxfp4(original[e])) for e in range(original.shape[0])])
            assert torch.equal(got, want), (i, w)
            assert not torch.equal(got, original)  # the test really went through a lossy quantisation


# ------------------------------------------------------------------------------------------- errors

@pytest.fixture
def saved_tiny(tmp_path):
    path = tmp_path / "ck"
    save_pretrained(make_model(tiny()), path, max_shard_bytes=SMALL_SHARDS)
    return path


Q = "language_model.model.layers.0.self_attn.q_proj.weight"
SCALE = "language_model.model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"


@pytest.mark.parametrize("name, tensor, problem", [
    (Q, None, "1 tensor(s) missing"),
    ("language_model.model.layers.0.self_attn.surprise.weight", torch.randn(3), "1 tensor(s) unexpected"),
    (Q, torch.randn(128, 127), "with the wrong shape"),
    (SCALE, torch.randn(64, 2), "with the wrong dtype"),
])
def test_mismatched_checkpoint_names_the_tensor(saved_tiny, name, tensor, problem):
    rewrite_tensor(saved_tiny, name, tensor)
    with pytest.raises(ValueError, match=re.escape(problem)) as err:
        load_pretrained(saved_tiny)
    assert name in str(err.value) and str(saved_tiny) in str(err.value)


def test_non_text_tensors_are_skipped(saved_tiny):
    """The release also holds the vision tower, outside `language_model.`: not an error for the text model."""
    rewrite_tensor(saved_tiny, "vision_tower.patch_embed.weight", torch.randn(4, 4))
    load_pretrained(saved_tiny)


def test_index_disagreeing_with_shards(saved_tiny):
    index = json.loads((saved_tiny / checkpoint.INDEX_NAME).read_text())
    file = index["weight_map"][Q]
    tensors = load_file(saved_tiny / file)
    del tensors[Q]
    save_file(tensors, saved_tiny / file)
    with pytest.raises(ValueError, match=re.escape(Q)):
        load_pretrained(saved_tiny)


def test_nonzero_a_log_padding(saved_tiny):
    name = "language_model.model.layers.3.self_attn.A_log"
    rewrite_tensor(saved_tiny, name, torch.rand(32) + 0.5)
    with pytest.raises(ValueError, match=re.escape(name) + ".*padding"):
        load_pretrained(saved_tiny)


def test_bad_config(tmp_path, saved_tiny):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        load_pretrained(tmp_path / "nowhere")
    config_file = saved_tiny / "config.json"
    good = json.loads(config_file.read_text())
    config_file.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(config_file)) + ".*not valid JSON"):
        load_pretrained(saved_tiny)
    config_file.write_text(json.dumps({**good, "text_config": {**good["text_config"], "hidden_size": -3}}))
    with pytest.raises(ValueError, match=re.escape(str(config_file)) + ".*hidden_size=-3"):
        load_pretrained(saved_tiny)
    config_file.unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in checkpoint directory " + re.escape(str(saved_tiny))):
        load_pretrained(saved_tiny)


# ------------------------------------------------------------------------------------------- atomic

def test_failed_save_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    old_model, new_model = make_model(tiny(), seed=1), make_model(tiny(), seed=2)
    save_pretrained(old_model, path, max_shard_bytes=SMALL_SHARDS)
    (path / "notes.txt").write_text("written by the user")
    before = file_bytes(path)

    calls = []
    real_save_file = checkpoint.save_file

    def failing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(new_model, path, max_shard_bytes=SMALL_SHARDS)
    assert len(calls) == 3
    assert file_bytes(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left behind

    # a successful save replaces the checkpoint (fewer, larger shards: no stale shard may remain) and keeps the
    # user's file
    monkeypatch.undo()
    save_pretrained(new_model, path)
    assert (path / "notes.txt").read_text() == "written by the user"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json", "notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert torch.equal(load_pretrained(path).lm_head.weight, new_model.lm_head.weight)


def test_save_refuses_a_file_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_pretrained(make_model(tiny()), tmp_path / "f")
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        save_pretrained(make_model(tiny()), tmp_path / "ck", max_shard_bytes=0)


# --------------------------------------------------------------------------------------------- init

def test_init_checkpoint(tmp_path):
    c = tiny()
    init_checkpoint(c, tmp_path / "a", seed=3)
    init_checkpoint(c, tmp_path / "b", seed=3)
    init_checkpoint(c, tmp_path / "c", seed=4)
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    assert file_bytes(tmp_path / "a") != file_bytes(tmp_path / "c")
    reference = K3ForCausalLM(c)
    reference.reset_parameters(3)
    loaded = load_pretrained(tmp_path / "a").state_dict()
    for name, t in reference.state_dict().items():
        want = fake_quant_mxfp4(t) if re.search(r"experts\.w[123]$", name) else t
        assert torch.equal(loaded[name], want), name


def test_init_checkpoint_with_tokenizer_is_one_atomic_write(tmp_path, monkeypatch):
    from openk3.text.tokenizer import Tokenizer, train_bpe

    tok = train_bpe(["def f(x): return x + 1"] * 20, 300)
    init_checkpoint(tiny(), tmp_path / "ok", seed=0, tokenizer=tok)
    assert Tokenizer.from_path(tmp_path / "ok").vocab_size == tok.vocab_size

    def killed(self, path):
        raise KeyboardInterrupt  # the run is stopped while the tokenizer is being written
    monkeypatch.setattr(type(tok), "save", killed)
    with pytest.raises(KeyboardInterrupt):
        init_checkpoint(tiny(), tmp_path / "cut", seed=0, tokenizer=tok)
    assert list(tmp_path.iterdir()) == [tmp_path / "ok"]  # no half-written checkpoint, no temporary left behind
    with pytest.raises(KeyboardInterrupt):  # an existing checkpoint stays whole
        init_checkpoint(tiny(), tmp_path / "ok", seed=1, tokenizer=tok)
    assert Tokenizer.from_path(tmp_path / "ok").vocab_size == tok.vocab_size and load_pretrained(tmp_path / "ok")


def test_init_checkpoint_refuses_large_configs(tmp_path):
    with pytest.raises(ValueError, match="4.912e\\+10 parameters"):
        init_checkpoint(kimi_linear_48b(), tmp_path / "big", seed=0)
    assert not (tmp_path / "big").exists()


# ------------------------------------------------------------------ release-exact loading (hand-written files)

RELEASE_FP32 = FP32_STORED


def write_release_style(path, config, a_log_shape=None, a_log_pad=0.0) -> dict:
    """Write `config` with random weights as the release does, by hand (not save_pretrained): `language_model.`
    names, bf16 everywhere except the fp32 tensors of spec section 6 (stored with values bf16 cannot hold), experts
    unstacked, A_log zero padded to [128] (or `a_log_shape`). Returns the tensors written."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, t in K3ForCausalLM(config).state_dict().items():
        t = 1 + 0.2 * torch.randn(t.shape, generator=g) if name.endswith("norm.weight") else t.clone()
        fp32 = name.endswith(RELEASE_FP32)
        t = (t + 1e-4 * torch.randn(t.shape, generator=g)) if fp32 else t.bfloat16()
        m = re.fullmatch(r"(.*\.experts)\.(w[123])", name)
        if m:
            for e in range(t.shape[0]):
                tensors[f"language_model.{m[1]}.{e}.{m[2]}.weight"] = t[e].clone()
            continue
        if name.endswith("A_log"):
            H = t.shape[0]
            if a_log_shape is None:
                padded = torch.full((128,), a_log_pad)
                padded[:H] = t
                t = padded
            else:
                t = t.reshape(a_log_shape)
        if name.startswith("output_attn_res_"):
            name = "model." + name
        tensors["language_model." + name] = t.contiguous()
    half = sorted(tensors)[: len(tensors) // 2]
    shards = {"model-00001-of-00002.safetensors": {n: tensors[n] for n in half},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in half}}
    path.mkdir()
    for file, part in shards.items():
        save_file(part, path / file, metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return tensors


def release_like_config():
    """tiny with 4 KDA heads of dim 16 (so A_log [128] pads 124 zeros) and plain bf16 experts."""
    return tiny().replace(quantization_config=None, linear_attn_config={"head_dim": 16})


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_release_fp32_tensors_stay_fp32(tmp_path, dtype):
    written = write_release_style(tmp_path / "ck", release_like_config())
    model = load_pretrained(tmp_path / "ck", dtype=dtype)
    state = model.state_dict()
    n_fp32 = 0
    for name, t in state.items():
        if name.endswith(RELEASE_FP32):
            n_fp32 += 1
            assert t.dtype == torch.float32, name
            stored = written["language_model." + name]
            assert torch.equal(t, stored.reshape(-1)[: t.numel()].view(t.shape)), name
        elif not re.search(r"experts\.w[123]$", name):
            assert t.dtype == torch.bfloat16, name
    assert n_fp32 > 0 and any(n.endswith("o_norm.weight") for n in state)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_cast_keeps_release_fp32_tensors():
    model = make_model(tiny())
    before = {n: t.clone() for n, t in model.state_dict().items()}
    assert model.cast(torch.bfloat16) is model
    for name, t in model.state_dict().items():
        if name.endswith(RELEASE_FP32):
            assert t.dtype == torch.float32 and torch.equal(t, before[name]), name
        else:
            assert t.dtype == torch.bfloat16, name


@pytest.mark.parametrize("a_log_shape", [None, (1, 1, 4, 1)])
def test_a_log_release_shapes(tmp_path, a_log_shape):
    written = write_release_style(tmp_path / "ck", release_like_config(), a_log_shape=a_log_shape)
    model = load_pretrained(tmp_path / "ck")
    name = "model.layers.0.self_attn.A_log"
    assert torch.equal(model.get_parameter(name), written["language_model." + name].reshape(-1)[:4])


def test_a_log_nonzero_release_padding(tmp_path):
    write_release_style(tmp_path / "ck", release_like_config(), a_log_pad=0.5)
    with pytest.raises(ValueError, match=r"language_model\.model\.layers\.\d\.self_attn\.A_log.*padding"):
        load_pretrained(tmp_path / "ck")


def test_a_log_too_short(tmp_path):
    write_release_style(tmp_path / "ck", release_like_config(), a_log_shape=(2, 2))
    with pytest.raises(ValueError, match=r"self_attn\.A_log \[2, 2\]"):
        load_pretrained(tmp_path / "ck")


# ------------------------------------------------------------------------------------------ unreadable files

def first_shard(path):
    return path / sorted(set(json.loads((path / checkpoint.INDEX_NAME).read_text())["weight_map"].values()))[0]


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_unreadable_shard_names_the_file(saved_tiny, damage):
    shard = first_shard(saved_tiny)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        torch.save({"w": torch.zeros(3)}, shard)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(shard)) + ".*not a readable safetensors"):
        load_pretrained(saved_tiny)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(shard))):
        list(iter_checkpoint_tensors(saved_tiny))


def test_garbage_tokenizer_names_the_file(saved_tiny, capsys):
    from openk3.cli import main

    (saved_tiny / "tokenizer.json").write_text("{garbage")
    with pytest.raises(ValueError, match=re.escape(str(saved_tiny / "tokenizer.json"))):
        checkpoint.load_for_inference(saved_tiny)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(saved_tiny), "--prompt", "hi", "--max-tokens", "3"])
    assert e.value.code == 2 and str(saved_tiny / "tokenizer.json") in capsys.readouterr().err


def test_cli_reports_an_unreadable_shard(saved_tiny, capsys):
    from openk3.cli import main

    from openk3.text.tokenizer import train_bpe

    train_bpe(["def f(x): return x"] * 20, 300).save(saved_tiny)
    shard = first_shard(saved_tiny)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(saved_tiny), "--prompt", "hi", "--max-tokens", "3"])
    assert e.value.code == 2 and str(shard) in capsys.readouterr().err
