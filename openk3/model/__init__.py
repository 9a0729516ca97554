"""The K3 network (model.py), its decode caches (state.py) and its checkpoint format (checkpoint.py).

The public names of model.py and state.py are re-exported here, so `from openk3.model import K3ForCausalLM`
works; checkpoint.py (safetensors, the outside name table) is imported only by those who load or save."""

from openk3.model.model import (MLP, CausalLMOutput, DecoderLayer, Experts, ForwardContext, GatedMLA, K3ForCausalLM,
                                K3Model, KimiDeltaAttention, MoE, RMSNorm, RMSNormWeight, Router, causal_conv_silu,
                                chunked_cross_entropy, count_params, glu_activation, recomputed, rms_norm,
                                segment_positions)
from openk3.model.state import K3Cache, KDAState, MLAState

__all__ = ["MLP", "CausalLMOutput", "DecoderLayer", "Experts", "ForwardContext", "GatedMLA", "K3Cache", "K3ForCausalLM",
           "K3Model", "KDAState", "KimiDeltaAttention", "MLAState", "MoE", "RMSNorm", "RMSNormWeight", "Router",
           "causal_conv_silu", "chunked_cross_entropy", "count_params", "glu_activation", "recomputed", "rms_norm",
           "segment_positions"]
