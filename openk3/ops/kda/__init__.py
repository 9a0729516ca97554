"""Kimi Delta Attention ops (spec 2.1): the fp32 reference, the chunked PyTorch version, and the
backend choice between them and flash-linear-attention's kernels."""

from openk3.ops.kda.backend import KDABackend, select_kda_backend
from openk3.ops.kda.chunk import chunk_kda_torch
from openk3.ops.kda.naive import naive_recurrent_kda

__all__ = ["KDABackend", "chunk_kda_torch", "naive_recurrent_kda", "select_kda_backend"]
