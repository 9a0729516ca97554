"""K3ForConditionalGeneration: media slots filled by vision vectors, and the whole release layout (text + vision in one
index) saved and loaded bit-identically."""

import json

import pytest
import torch
from safetensors import safe_open

from openk3.config import K3Config, tiny_vl
from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import init_checkpoint, load_pretrained, read_index, save_pretrained
from openk3.ops.mxfp import fake_quant_mxfp4
from openk3.text.tokenizer import train_bpe
from openk3.vision.model import K3ForConditionalGeneration, build_model, expand_media_pads, grid_tokens
from tests.helpers import rel_err

PAD = tiny_vl().media_placeholder_token_id
GRIDS = torch.tensor([[1, 4, 6], [1, 2, 2]])  # 6 and 1 vision vectors


def random_model(config=None, seed=0, dtype=torch.float32) -> K3ForConditionalGeneration:
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(config or tiny_vl()).cast(dtype)  # the fp32-stored tensors stay fp32
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            noise = torch.randn(t.shape, generator=g)
            t.copy_((1 + 0.2 * noise) if "norm" in name else noise * 0.05)
            if name.endswith(("experts.w1", "experts.w2", "experts.w3")):  # MXFP4-representable: exact round trip
                t.copy_(fake_quant_mxfp4(t))
    return model


def prompt(text_ids: list[list[int]], counts: list[int]) -> torch.Tensor:
    """Rows of ids where PAD marks an image (one pad each), expanded to one pad per vision vector."""
    flat, rows, k = [], [], 0
    for row in text_ids:
        n = row.count(PAD)
        rows.append(expand_media_pads(row, PAD, counts[k:k + n]))
        k += n
    assert len({len(r) for r in rows}) == 1
    return torch.tensor(rows)


def images(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24 + 4, 3, 14, 14, generator=g)


def test_vision_vectors_fill_the_media_slots_in_order():
    model = random_model().eval()
    counts = grid_tokens(GRIDS, model.config.vision_config)
    assert counts == [6, 1]
    ids = prompt([[105, 106, PAD, 107, 108, 109, 110, 111, 112], [113, 114, 115, 116, PAD] + list(range(117, 126))],
                 counts)
    pv = images()
    features = model.image_features(pv, GRIDS)
    assert [f.shape for f in features] == [(6, 128), (1, 128)]
    embeds = model.embed_with_images(ids, features)
    slots = (ids == PAD).nonzero().tolist()
    vectors = torch.cat(features)
    for k, (b, t) in enumerate(slots):
        assert torch.equal(embeds[b, t], vectors[k])
    text = ids != PAD
    assert torch.equal(embeds[text], model.model.embed_tokens(ids)[text])

    with torch.no_grad():
        out = model(ids, pixel_values=pv, grid_thws=GRIDS)
        again = model(ids, image_features=features)
        other = model(ids, pixel_values=images(seed=1), grid_thws=GRIDS)
    assert torch.equal(out.logits, again.logits)
    # causal: positions before each row's first image do not see it; later ones do
    # (to rounding: the batch's other tokens change, and with them the grouping of the MoE's matmuls)
    assert rel_err(out.logits[0, :2], other.logits[0, :2]) < 1e-5
    assert rel_err(out.logits[1, :4], other.logits[1, :4]) < 1e-5
    assert rel_err(out.logits[0, 2:], other.logits[0, 2:]) > 1e-2


def test_gradients_reach_the_vision_tower():
    model = random_model()
    counts = grid_tokens(GRIDS, model.config.vision_config)
    ids = prompt([[5, PAD, 6, PAD, 7, 8]], counts)
    labels = torch.full_like(ids, -100)
    labels[0, -3:] = torch.tensor([6, 7, 8])
    out = model(ids, labels=labels, pixel_values=images(), grid_thws=GRIDS)
    out.loss.backward()
    for name in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.1.wqkv.weight", "mm_projector.proj.0.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_slot_count_must_match_the_images():
    model = random_model().eval()
    ids = torch.tensor([[5, PAD, 6, PAD, PAD]])
    with pytest.raises(ValueError, match="3 <\\|media_pad\\|>.*7 vision vectors"):
        model(ids, pixel_values=images(), grid_thws=GRIDS)
    with pytest.raises(ValueError, match="3 <\\|media_pad\\|>.*0 vision vectors"):
        model(ids, image_features=[])
    with torch.no_grad():  # without images it is the text model, pads embedded as tokens
        assert torch.equal(model(ids).logits, K3ForCausalLM.forward(model, ids).logits)
    with pytest.raises(ValueError, match="come together"):
        model(ids, pixel_values=images())


def test_build_model_picks_the_class():
    assert type(build_model(tiny_vl())) is K3ForConditionalGeneration
    assert type(build_model(tiny_vl().replace(vision_config=None, media_placeholder_token_id=None))).__name__ == \
        "K3ForCausalLM"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_layout_round_trip_is_bit_identical(tmp_path, dtype):
    model = random_model(dtype=dtype).eval()
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=300_000)
    infos = read_index(tmp_path / "ck")
    names = list(infos)
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in infos and "mm_projector.post_norm.weight" in infos
    assert "language_model.model.embed_tokens.weight" in infos
    assert not any(n.startswith("language_model.vision") or n.startswith("language_model.mm_") for n in names)
    # the vision tensors live in the last shards: no text tensor comes after the first shard that holds one
    vision_files = [i.file for n, i in infos.items() if n.startswith(("vision_tower.", "mm_projector."))]
    text_files = [i.file for n, i in infos.items() if n.startswith("language_model.")]
    assert max(text_files) <= min(vision_files) and len(set(vision_files)) > 1
    with safe_open(tmp_path / "ck" / infos["vision_tower.patch_embed.proj.weight"].file, "pt") as f:
        assert f.get_tensor("vision_tower.patch_embed.proj.weight").dtype == dtype
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["vision_config"] == tiny_vl().vision_config.to_dict() and cfg["media_placeholder_token_id"] == PAD

    loaded = load_pretrained(tmp_path / "ck").eval()
    assert type(loaded) is K3ForConditionalGeneration
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = prompt([[5, PAD, 6, 7, PAD, 8]], grid_tokens(GRIDS, model.config.vision_config))
    with torch.no_grad():
        assert torch.equal(model(ids, pixel_values=images(), grid_thws=GRIDS).logits,
                           loaded(ids, pixel_values=images(), grid_thws=GRIDS).logits)


def test_a_missing_vision_tensor_is_named(tmp_path):
    save_pretrained(random_model(), tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["vision_config"]["vt_num_hidden_layers"] = 3
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="6 tensor\\(s\\) missing: vision_tower.encoder.blocks.2"):
        load_pretrained(tmp_path / "ck")


def test_init_with_a_tokenizer_takes_its_media_pad_id(tmp_path):
    tok = train_bpe(["a red circle", "a blue square"] * 20, 400)
    config = init_checkpoint(tiny_vl(), tmp_path / "ck", seed=0, tokenizer=tok)
    assert config.media_placeholder_token_id == tok.token_id("<|media_pad|>")
    loaded = K3Config.load(tmp_path / "ck")
    assert loaded.vision_config == tiny_vl().vision_config and loaded.vocab_size == tok.vocab_size


def test_reset_parameters_covers_the_vision_modules():
    a, b = K3ForConditionalGeneration(tiny_vl()), K3ForConditionalGeneration(tiny_vl())
    a.reset_parameters(seed=3)
    b.reset_parameters(seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    w = a.vision_tower.encoder.blocks[0].wqkv.weight
    assert 0.015 < w.std() < 0.025 and rel_err(a.vision_tower.encoder.final_layernorm.weight,
                                                torch.ones(64)) == 0
