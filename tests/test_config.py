import json
import re
from pathlib import Path

import pytest

from openk3.config import K3Config, get_config, kimi_k3, kimi_linear_48b, tiny
from openk3.model import count_params

RELEASE = Path(__file__).resolve().parents[2] / "shared" / "k3_release_config.json"
BUNDLED = Path(__file__).resolve().parents[1] / "openk3" / "presets" / "kimi_k3.json"


def release_dict() -> dict:
    return json.loads((RELEASE if RELEASE.exists() else BUNDLED).read_text())


def test_release_preset_is_the_release_config():
    assert kimi_k3().to_hf_dict() == release_dict()


def test_release_layer_schedule():
    c = kimi_k3()
    kda = [i for i in range(93) if c.layer_types[i] == "kda"]
    mla = [i for i in range(93) if c.layer_types[i] == "mla"]
    assert len(kda) == 69 and len(mla) == 24
    assert mla == [i for i in range(3, 92, 4)] + [92]
    assert c.layer_types[91] == "mla" and c.layer_types[92] == "mla"
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))


def test_release_parameter_counts():
    counts = count_params(kimi_k3())
    assert round(counts["total_params"] / 1e12, 4) == 2.7795
    assert round(counts["active_params"] / 1e9, 2) == 104.19


def test_kimi_linear_preset_has_no_k3_fields():
    c = kimi_linear_48b()
    d = c.to_dict()
    for k in ("attn_res_block_size", "routed_expert_hidden_size", "quantization_config"):
        assert k not in d
    assert "use_full_rank_gate" not in d["linear_attn_config"]
    assert "gate_lower_bound" not in d["linear_attn_config"]
    assert c.hidden_act == "silu" and c.routed_scaling_factor == 2.446
    counts = count_params(c)
    assert 47e9 < counts["total_params"] < 50e9 and 2.5e9 < counts["active_params"] < 3.5e9


def test_tiny_has_every_k3_feature():
    c = tiny()
    assert c.attn_res and c.num_hidden_layers // c.attn_res_block_size >= 2
    assert c.latent_moe and c.latent_moe_use_norm and c.num_shared_experts >= 1
    assert c.mxfp4_experts and c.hidden_act == "situ" and c.mla_use_output_gate
    assert c.linear_attn_config.gate_lower_bound == -5.0 and c.linear_attn_config.use_full_rank_gate
    assert "kda" in c.layer_types and "mla" in c.layer_types


@pytest.mark.parametrize("make", [kimi_k3, kimi_linear_48b, tiny])
def test_json_round_trip(tmp_path, make):
    c = make()
    c.save(tmp_path)
    back = K3Config.load(tmp_path / "config.json")
    assert back.to_hf_dict() == c.to_hf_dict()
    assert get_config(str(tmp_path)).to_dict() == c.to_dict()


def test_loads_bare_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(release_dict()["text_config"]))
    c = K3Config.load(tmp_path)
    assert c.hidden_size == 7168 and c.extra["top"] is None


@pytest.mark.parametrize("change, field", [
    ({"linear_attn_config": {"kda_layers": [1, 2, 3, 4, 5], "full_attn_layers": [3, 6]}}, "both"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3, 6]}}, "neither"),
    ({"linear_attn_config": {"kda_layers": [0, 1, 2, 4, 5], "full_attn_layers": [3, 6]}}, "1-indexed"),
    ({"num_experts_per_token": 9}, "num_experts_per_token=9"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"routed_expert_hidden_size": 48}, "routed_expert_hidden_size=48"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"linear_attn_config": {"gate_lower_bound": 1.0}}, "gate_lower_bound=1.0"),
    ({"eos_token_id": 5000}, "eos_token_id=5000"),
])
def test_validation_names_the_bad_field(change, field):
    with pytest.raises(ValueError, match="invalid config") as e:
        tiny().replace(**change)
    assert field in str(e.value)


def test_unknown_preset_and_bad_json(tmp_path):
    with pytest.raises(ValueError, match="no-such-preset"):
        get_config("no-such-preset")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3Config.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        K3Config.load(tmp_path / "missing")


@pytest.mark.parametrize("change, field", [
    ({"max_position_embeddings": -5}, "max_position_embeddings=-5"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps='tiny'"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor='2'"),
    ({"moe_layer_freq": "1"}, "moe_layer_freq='1'"),
    ({"q_lora_rank": 1.5}, "q_lora_rank=1.5"),
    ({"eos_token_id": "1"}, "eos_token_id='1'"),
    ({"mla_use_output_gate": "yes"}, "mla_use_output_gate='yes'"),
    ({"linear_attn_config": {"gate_lower_bound": "low"}}, "linear_attn_config.gate_lower_bound='low'"),
])
def test_validation_names_the_bad_type_or_value(change, field):
    with pytest.raises(ValueError, match="invalid config") as e:
        tiny().replace(**change)
    assert field in str(e.value)


def test_unknown_keys_warn_and_are_kept(tmp_path):
    d = release_dict()
    d["text_config"]["rope_scaling_magic"] = {"factor": 2}
    d["text_config"]["my_flag"] = True
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.warns(UserWarning, match=r"my_flag.*rope_scaling_magic"):
        c = K3Config.load(tmp_path)
    assert c.extra["text_extra"]["rope_scaling_magic"] == {"factor": 2}
    assert c.to_hf_dict()["text_config"]["my_flag"] is True  # kept for the round trip


def test_the_release_config_loads_without_warnings(tmp_path):
    import warnings

    (tmp_path / "config.json").write_text(json.dumps(release_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K3Config.load(tmp_path)


@pytest.mark.parametrize("change, field", [
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2}, "num_expert_group=(4, 2)"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
])
def test_release_fields_without_a_code_path_are_refused(change, field):
    """The release sets these; any other value would select code openk3 does not have, so it is an error."""
    with pytest.raises(ValueError, match=re.escape(field)):
        tiny().replace(**change)
    assert get_config("kimi-k3").use_grouped_topk and get_config("kimi-k3").num_expert_group == 1
