"""One config object for every K3-family model, with Hugging Face field names.

`K3Config` mirrors the `text_config` of the released Kimi K3 `config.json` (model_type "kimi_linear").
A field that is absent from a config means the Kimi-Linear behaviour (K3_SPEC section 1): e.g. no
`attn_res_block_size` is a plain residual stream, no `routed_expert_hidden_size` is the plain MoE.

The config is validated at construction; every error names the offending field and value.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIVATIONS = ("situ", "silu")
# K3Config fields that a K3-style config.json keeps at its top level, beside text_config.
TOP_LEVEL_FIELDS = ("vision_config", "media_placeholder_token_id")
# Keys of a HF text config that are bookkeeping, not model settings: kept in `extra` without a warning.
HF_BOOKKEEPING = ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "auto_map")

@dataclass
class LinearAttnConfig:
    """`linear_attn_config` of the HF config: the KDA shape and the (1-indexed) layer schedule."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)
    # K3 additions; absent = Kimi-Linear (low-rank output gate, unbounded softplus decay).
    use_full_rank_gate: bool = False
    gate_lower_bound: float | None = None


# vision_config values that select code (K3_SPEC section 10): only the release's are implemented, so a config that asks
# for another one fails at construction instead of silently running the release's code.
VISION_CODE_PATHS = {"norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
                     "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
                     "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu"}


@dataclass
class VisionConfig:
    """`vision_config` of the release's config.json (K3_SPEC section 10): MoonViT-V2 and its projector, HF names.
    The defaults are the release's."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536  # heads x head_dim of q, k and v (12 x 128), wider than vt_hidden_size
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168

    def __post_init__(self) -> None:
        _validate_vision(self)

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_dim(self) -> int:
        """Width of one merged token: the features of a merge_kernel_size window side by side (4 x 1024)."""
        return self.mm_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        if not isinstance(d, dict):
            raise ValueError(f"invalid config: vision_config={d!r}: must be an object")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"vision_config has unknown field(s) {unknown}")
        return cls(**d)


@dataclass
class K3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = None
    intermediate_size: int = 33792
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    # Block Attention Residuals; None = plain residual stream (Kimi-Linear).
    attn_res_block_size: int | None = None
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    # KDA and the layer schedule
    linear_attn_config: LinearAttnConfig = None  # type: ignore[assignment]
    # MoE
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    routed_expert_hidden_size: int | None = None  # LatentMoE width; None = plain MoE
    latent_moe_use_norm: bool = False
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    quantization_config: dict | None = None
    # token ids
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    # Multimodal (top level of the release's config.json, not text_config): the vision tower and projector, and the
    # id of `<|media_pad|>`, the slot an image's vision vectors fill. None = a text-only model.
    vision_config: VisionConfig | None = None
    media_placeholder_token_id: int | None = None
    # Everything else a loaded config.json carried (e.g. the release's ignore_index), kept for the round trip.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig(**self.linear_attn_config)
        if isinstance(self.vision_config, dict):
            self.vision_config = VisionConfig.from_dict(self.vision_config)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _validate(self)

    # ---- the layer schedule (0-indexed, over the 1-indexed config lists) ----
    @property
    def layer_types(self) -> list[str]:
        """The token mixer of each layer, 0-indexed: "kda" or "mla" (from linear_attn_config.kda_layers, which
        `_validate` checks covers every layer once together with full_attn_layers). The one place the schedule
        is derived; the model, the caches and the CLI read it from here."""
        kda = set(self.linear_attn_config.kda_layers)
        return ["kda" if i + 1 in kda else "mla" for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, i: int) -> bool:
        # HF Kimi-Linear's rule (0-indexed): dense before first_k_dense_replace, then MoE every moe_layer_freq layers
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def mxfp4_experts(self) -> bool:
        """Routed experts are stored (and QAT-trained) as MXFP4 when the quantization_config says so."""
        q = self.quantization_config or {}
        return q.get("format") == "mxfp4-pack-quantized"

    @property
    def expert_dim(self) -> int:
        """Width the routed experts work at: the latent width for LatentMoE, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    # ---- JSON round trip ----
    def to_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
             if f.name not in ("extra",) + TOP_LEVEL_FIELDS}
        d["linear_attn_config"] = dataclasses.asdict(self.linear_attn_config)
        # Absent fields mean Kimi-Linear behaviour, so K3-only fields are written only when set.
        lac = d["linear_attn_config"]
        if not lac["use_full_rank_gate"]:
            del lac["use_full_rank_gate"]
        if lac["gate_lower_bound"] is None:
            del lac["gate_lower_bound"]
        for name in ("attn_res_block_size", "routed_expert_hidden_size", "quantization_config"):
            if d[name] is None:
                del d[name]
        d = {**self.extra.get("text_extra", {}), **d}
        d.setdefault("model_type", "kimi_linear")
        d.setdefault("architectures", ["KimiLinearForCausalLM"])
        return d

    def to_hf_dict(self) -> dict:
        """The whole config.json: K3-style (text_config inside a KimiK3ForConditionalGeneration) when the
        loaded config was, else the bare Kimi-Linear text config."""
        text = self.to_dict()
        top = self.extra.get("top")
        if top is None and self.vision_config is not None:  # a multimodal model is always K3-style
            top = self.release_top()
        if top is None:
            return text
        top = dict(top)
        if self.media_placeholder_token_id is not None:
            top["media_placeholder_token_id"] = self.media_placeholder_token_id
        if self.vision_config is not None:
            top["vision_config"] = self.vision_config.to_dict()
        # The release keeps the token ids at the top level only; keep them where they came from.
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in top:
                top[k] = text[k]
                if k not in self.extra.get("text_keys", ()):
                    del text[k]
        return {**top, "text_config": text}

    def release_top(self) -> dict:
        """The top level of the release's config.json (without text_config and the multimodal fields), for a K3-style
        config that did not come with one (e.g. the `tiny` preset)."""
        return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "tie_word_embeddings": self.tie_word_embeddings}

    @classmethod
    def from_dict(cls, d: dict) -> "K3Config":
        """From a HF config dict: either a top level with `text_config` or a bare text config."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        top = None
        if "text_config" in d:
            top = {k: v for k, v in d.items() if k != "text_config"}
            d = d["text_config"]
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"} - set(TOP_LEVEL_FIELDS)
        kwargs = {k: v for k, v in d.items() if k in known}
        text_extra = {k: v for k, v in d.items() if k not in known}
        unknown = sorted(k for k in text_extra if k not in HF_BOOKKEEPING)
        if unknown:
            # NOTE: a warning, not an error: HF configs grow fields; but a misspelt field silently doing nothing
            # must be visible. The keys are kept (extra["text_extra"]) and written back on save.
            warnings.warn(f"config has field(s) openk3 does not know, kept but unused: {', '.join(unknown)}",
                          UserWarning, stacklevel=2)
        if "linear_attn_config" not in kwargs:
            raise ValueError("config has no linear_attn_config: openk3 needs the KDA/MLA layer lists")
        lac = dict(kwargs["linear_attn_config"])
        lac_known = {f.name for f in dataclasses.fields(LinearAttnConfig)}
        unknown = sorted(set(lac) - lac_known)
        if unknown:
            raise ValueError(f"linear_attn_config has unknown field(s) {unknown}")
        kwargs["linear_attn_config"] = LinearAttnConfig(**lac)
        if top is not None:
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if k in top and k not in d:
                    kwargs[k] = top[k]
            # the multimodal fields live on the config; `to_hf_dict` writes them back into the top level
            for k in TOP_LEVEL_FIELDS:
                if k in top:
                    kwargs[k] = top.pop(k)
            if isinstance(kwargs.get("vision_config"), dict):
                kwargs["vision_config"] = VisionConfig.from_dict(kwargs["vision_config"])
        return cls(**kwargs, extra={"top": top, "text_extra": text_extra, "text_keys": sorted(d)})

    @classmethod
    def load(cls, path: str | Path) -> "K3Config":
        """Load a config.json (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config file at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    def replace(self, **changes) -> "K3Config":
        """A validated copy with some fields changed (`linear_attn_config` may be given as a dict of changes)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if isinstance(changes.get("vision_config"), dict) and d["vision_config"] is not None:
            changes["vision_config"] = dataclasses.replace(d["vision_config"], **changes["vision_config"])
        if isinstance(changes.get("linear_attn_config"), dict):
            changes["linear_attn_config"] = dataclasses.replace(d["linear_attn_config"], **changes["linear_attn_config"])
        d.update(changes)
        return K3Config(**d)


def _validate(c: K3Config) -> None:
    def bad(name: str, value: Any, why: str) -> ValueError:
        return ValueError(f"invalid config: {name}={value!r}: {why}")

    # Types first, so the checks below compare numbers (a string eps would otherwise fail inside `<=`).
    lac = c.linear_attn_config
    if lac is None:
        raise bad("linear_attn_config", None, "required (KDA shape and layer lists)")
    for obj, prefix in ((c, ""), (lac, "linear_attn_config.")):
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            if f.name in ("extra", "linear_attn_config", "vision_config"):
                continue
            v = getattr(obj, f.name)
            why = _type_error(v, hints[f.name])
            if why:
                raise bad(prefix + f.name, v, why)

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "kv_lora_rank", "v_head_dim", "num_experts", "num_experts_per_token", "moe_intermediate_size",
                 "max_position_embeddings"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(name, v, "must be a positive integer")
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(name, v, "must be a non-negative integer")
    if c.qk_nope_head_dim + c.qk_rope_head_dim == 0:
        raise bad("qk_nope_head_dim", c.qk_nope_head_dim, "MLA query/key head size is zero")
    if c.hidden_act not in ACTIVATIONS:
        raise bad("hidden_act", c.hidden_act, f"unknown activation; expected one of {ACTIVATIONS}")
    if c.rms_norm_eps <= 0:
        raise bad("rms_norm_eps", c.rms_norm_eps, "must be > 0")
    if c.num_key_value_heads != c.num_attention_heads:
        raise bad("num_key_value_heads", c.num_key_value_heads,
                  f"MLA has as many KV heads as query heads ({c.num_attention_heads})")
    if c.q_lora_rank is not None and c.q_lora_rank <= 0:
        raise bad("q_lora_rank", c.q_lora_rank, "must be a positive integer or null (no q-LoRA)")
    if not c.mla_use_nope:
        raise bad("mla_use_nope", c.mla_use_nope, "only NoPE MLA is implemented (K3 and Kimi-Linear never rotate)")

    for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
        v = getattr(lac, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(f"linear_attn_config.{name}", v, "must be a positive integer")
    if lac.gate_lower_bound is not None and not lac.gate_lower_bound < 0:
        raise bad("linear_attn_config.gate_lower_bound", lac.gate_lower_bound, "must be negative (a log-decay)")
    kda, mla = list(lac.kda_layers), list(lac.full_attn_layers)
    n = c.num_hidden_layers
    for name, lst in (("kda_layers", kda), ("full_attn_layers", mla)):
        out = [x for x in lst if not isinstance(x, int) or not 1 <= x <= n]
        if out:
            raise bad(f"linear_attn_config.{name}", out, f"layer numbers are 1-indexed in [1, {n}]")
        dup = sorted({x for x in lst if lst.count(x) > 1})
        if dup:
            raise bad(f"linear_attn_config.{name}", dup, "layers listed twice")
    both = sorted(set(kda) & set(mla))
    if both:
        raise bad("linear_attn_config", both, "layers are in both kda_layers and full_attn_layers")
    missing = sorted(set(range(1, n + 1)) - set(kda) - set(mla))
    if missing:
        raise bad("linear_attn_config", missing, "layers are in neither kda_layers nor full_attn_layers")

    if c.num_experts_per_token > c.num_experts:
        raise bad("num_experts_per_token", c.num_experts_per_token,
                  f"top-k larger than num_experts={c.num_experts}")
    if c.moe_router_activation_func != "sigmoid":
        raise bad("moe_router_activation_func", c.moe_router_activation_func, "only 'sigmoid' is implemented")
    # Fields the release sets that select code paths openk3 does not have: only the release's values are accepted,
    # so a config asking for something else fails here instead of silently running something different.
    if c.topk_method != "noaux_tc":
        raise bad("topk_method", c.topk_method, "only 'noaux_tc' (top-k over sigmoid scores plus the selection-only "
                                                "bias, K3 and Kimi-Linear) is implemented")
    if c.tie_word_embeddings:
        raise bad("tie_word_embeddings", c.tie_word_embeddings,
                  "tied input/output embeddings are not implemented (K3 and Kimi-Linear keep them separate)")
    if c.num_nextn_predict_layers != 0:
        raise bad("num_nextn_predict_layers", c.num_nextn_predict_layers,
                  "multi-token-prediction layers are not implemented (the release has 0)")
    if c.moe_layer_freq < 1:
        raise bad("moe_layer_freq", c.moe_layer_freq, "must be >= 1")
    # Released configs use one expert group; grouped top-k with 1 group is plain top-k.
    if c.num_expert_group != 1 or c.topk_group != 1:
        raise bad("num_expert_group", (c.num_expert_group, c.topk_group),
                  "only num_expert_group=1, topk_group=1 (plain top-k) is implemented")
    if c.routed_expert_hidden_size is not None and c.routed_expert_hidden_size <= 0:
        raise bad("routed_expert_hidden_size", c.routed_expert_hidden_size, "must be positive or absent")
    if c.attn_res_block_size is not None and (not isinstance(c.attn_res_block_size, int) or c.attn_res_block_size < 1):
        raise bad("attn_res_block_size", c.attn_res_block_size, "must be a positive integer or absent")
    if c.mxfp4_experts and c.expert_dim % 32 != 0:
        raise bad("routed_expert_hidden_size", c.expert_dim, "MXFP4 experts need a width divisible by 32")
    if c.mxfp4_experts and c.moe_intermediate_size % 32 != 0:
        raise bad("moe_intermediate_size", c.moe_intermediate_size, "MXFP4 experts need a multiple of 32")
    q = c.quantization_config
    if q is not None and q.get("format") not in (None, "mxfp4-pack-quantized"):
        raise bad("quantization_config.format", q.get("format"), "only 'mxfp4-pack-quantized' is supported")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
        v = getattr(c, name)
        if v is not None and not 0 <= v < c.vocab_size:
            raise bad(name, v, f"outside the vocabulary [0, {c.vocab_size})")
    v = c.vision_config
    if v is not None:
        if not isinstance(v, VisionConfig):
            raise bad("vision_config", v, "must be an object (the release's vision_config)")
        if v.text_hidden_size != c.hidden_size:
            raise bad("vision_config.text_hidden_size", v.text_hidden_size,
                      f"the projector must map into the text width hidden_size={c.hidden_size}")
        if c.media_placeholder_token_id is None:
            raise bad("media_placeholder_token_id", None, "a model with a vision_config needs the id of <|media_pad|>")


def _validate_vision(v: VisionConfig) -> None:
    def bad(name: str, value: Any, why: str) -> ValueError:
        return ValueError(f"invalid config: vision_config.{name}={value!r}: {why}")

    hints = typing.get_type_hints(VisionConfig)
    for f in dataclasses.fields(v):
        why = _type_error(getattr(v, f.name), hints[f.name])
        if why:
            raise bad(f.name, getattr(v, f.name), why)
    for name in ("patch_size", "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
                 "vt_intermediate_size", "qkv_hidden_size", "init_pos_emb_height", "init_pos_emb_width",
                 "init_pos_emb_time", "mm_hidden_size", "text_hidden_size"):
        if getattr(v, name) <= 0:
            raise bad(name, getattr(v, name), "must be a positive integer")
    for name, value in VISION_CODE_PATHS.items():
        if getattr(v, name) != value:
            raise bad(name, getattr(v, name), f"only {value!r} (the release's) is implemented")
    if v.qkv_hidden_size % v.vt_num_attention_heads:
        raise bad("qkv_hidden_size", v.qkv_hidden_size,
                  f"must be a multiple of vt_num_attention_heads={v.vt_num_attention_heads}")
    if v.head_dim % 2:
        raise bad("qkv_hidden_size", v.qkv_hidden_size, "the head size (qkv_hidden_size / heads) must be even")
    if (len(v.merge_kernel_size) != 2 or any(not isinstance(k, int) or isinstance(k, bool) or k < 1
                                              for k in v.merge_kernel_size)):
        raise bad("merge_kernel_size", v.merge_kernel_size, "must be two positive integers [height, width]")
    if v.mm_hidden_size != v.vt_hidden_size:
        raise bad("mm_hidden_size", v.mm_hidden_size, f"the projector reads the tower's width "
                                                       f"vt_hidden_size={v.vt_hidden_size}")
    if v.vt_hidden_size % 2:
        raise bad("vt_hidden_size", v.vt_hidden_size, "must be even (the fixed sin-cos time embedding)")
    if v.projector_ln_eps <= 0:
        raise bad("projector_ln_eps", v.projector_ln_eps, "must be > 0")


def _type_error(v: Any, hint: Any) -> str | None:
    """Why `v` does not fit the field type `hint` (int, float, bool, str, dict, list[...], or X | None), or None.
    A float field takes an int; floats must be finite; bool is not an int here."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    for t in options:
        t = typing.get_origin(t) or t
        if t is type(None) and v is None:
            return None
        if t is bool and isinstance(v, bool):
            return None
        if t is int and isinstance(v, int) and not isinstance(v, bool):
            return None
        if t is float and isinstance(v, (int, float)) and not isinstance(v, bool):
            return None if math.isfinite(v) else "must be a finite number"
        if t in (str, dict, list) and isinstance(v, t):
            return None
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
             list: "a list", type(None): "null"}
    return "must be " + " or ".join(names.get(typing.get_origin(t) or t, str(t)) for t in options)


# ---------------------------------------------------------------- presets

PRESET_DIR = Path(__file__).resolve().parent / "presets"

_MXFP4 = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                "scale_dtype": "uint8"},
    "input_activations": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def _schedule(n_layers: int, every: int, last_full: bool) -> dict:
    """1-indexed KDA/MLA lists: MLA every `every` layers (and the last layer when `last_full`)."""
    full = [i for i in range(1, n_layers + 1) if i % every == 0 or (last_full and i == n_layers)]
    return {"kda_layers": [i for i in range(1, n_layers + 1) if i not in full], "full_attn_layers": full}


def kimi_k3() -> K3Config:
    """Exactly the released Kimi K3 (read from the release config.json bundled with the package)."""
    return K3Config.load(PRESET_DIR / "kimi_k3.json")


def kimi_linear_48b() -> K3Config:
    """The Kimi-Linear-48B-A3B shape: no K3 additions (softplus decay, low-rank output gate, SwiGLU,
    plain residual, plain MoE scaled by routed_scaling_factor)."""
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32,
        intermediate_size=9216, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=1048576,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True,
        linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4, **_schedule(27, 4, True)},
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.446,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


def kimi_linear_1_5b() -> K3Config:
    """A Kimi-Linear model of 1.49e9 parameters (0.45e9 active), vocabulary 32,000: the config of the speed
    benchmarks against transformers' KimiLinear (bench/vs_transformers.py, docs/training.md). No K3 addition."""
    n = 16
    return kimi_linear_48b().replace(
        vocab_size=32000, hidden_size=1536, num_hidden_layers=n, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=4096,
        linear_attn_config={"num_heads": 16, "head_dim": 128, "short_conv_kernel_size": 4, **_schedule(n, 4, True)},
        num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=512,
        first_k_dense_replace=1, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def k3_1_5b() -> K3Config:
    """`kimi-linear-1.5b` with every K3 feature on (bounded full-rank KDA gate, gated MLA, Block AttnRes, Stable
    LatentMoE at half width, SiTU-GLU, MXFP4 experts): what each K3 feature costs at the benchmark's size."""
    c = kimi_linear_1_5b()
    return c.replace(
        hidden_act="situ", attn_res_block_size=4, mla_use_output_gate=True, routed_scaling_factor=1.0,
        linear_attn_config={**dataclasses.asdict(c.linear_attn_config), "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        routed_expert_hidden_size=768, latent_moe_use_norm=True, quantization_config=copy.deepcopy(_MXFP4))


def tiny(vocab_size: int = 2048) -> K3Config:
    """Every K3 feature on, at CPU-test size: bounded KDA with full-rank gate, gated MLA with q-LoRA,
    AttnRes with 3 blocks, LatentMoE with shared experts, SiTU-GLU, MXFP4 quantization_config."""
    return K3Config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
        intermediate_size=384, hidden_act="situ", rms_norm_eps=1e-5, max_position_embeddings=8192,
        attn_res_block_size=2,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config={"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True, "gate_lower_bound": -5.0, **_schedule(6, 3, True)},
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
        routed_expert_hidden_size=64, latent_moe_use_norm=True, first_k_dense_replace=1,
        routed_scaling_factor=1.0, quantization_config=copy.deepcopy(_MXFP4),
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )


def k3_1b() -> K3Config:
    """A K3-shaped model of about 1B parameters (1.06e9 total, 0.40e9 active) with the K3 vocabulary: the size
    used for GPU throughput and engine benchmarks. Every K3 feature on; MLA every 4th layer and the last."""
    n = 16
    return K3Config(
        vocab_size=163840, hidden_size=1024, num_hidden_layers=n, num_attention_heads=8, intermediate_size=4096,
        hidden_act="situ", attn_res_block_size=4,
        q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config={"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True, "gate_lower_bound": -5.0, **_schedule(n, 4, True)},
        num_experts=48, num_experts_per_token=6, num_shared_experts=2, moe_intermediate_size=512,
        routed_expert_hidden_size=512, latent_moe_use_norm=True, first_k_dense_replace=1,
        quantization_config=copy.deepcopy(_MXFP4),
    )


def tiny_vl(vocab_size: int = 2048) -> K3Config:
    """`tiny` with a MoonViT-V2 at CPU-test size (docs/vision.md): every structural feature of the release tower
    (patch 14, divided position embedding interpolated from a 16 x 16 grid, qkv wider than the width, 2x2 merge,
    patchmergerv2) at width 64, 2 layers. <|media_pad|> is the id `openk3 train`'s BPE gives it (25);
    `config_for_tokenizer` takes whichever id the run's tokenizer has."""
    return tiny(vocab_size).replace(
        media_placeholder_token_id=25,
        vision_config=VisionConfig(vt_hidden_size=64, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                                   vt_intermediate_size=256, qkv_hidden_size=96, init_pos_emb_height=16,
                                   init_pos_emb_width=16, mm_hidden_size=64, text_hidden_size=128))


PRESETS = {"kimi-k3": kimi_k3, "kimi-linear-48b": kimi_linear_48b, "kimi-linear-1.5b": kimi_linear_1_5b,
           "k3-1.5b": k3_1_5b, "k3-1b": k3_1b, "tiny": tiny, "tiny-vl": tiny_vl}


def get_config(name_or_path: str) -> K3Config:
    """A preset name (kimi-k3, kimi-linear-48b, tiny) or a path to a config.json / checkpoint directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    p = Path(name_or_path)
    if p.exists():
        return K3Config.load(p)
    raise ValueError(f"unknown config {name_or_path!r}: not a preset {sorted(PRESETS)} and no such file")
