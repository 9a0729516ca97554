"""Scale-out on torch.distributed, applied from outside the single-device model (torchtitan style; K3_SPEC section 8).

The model in openk3/model/ never knows it is distributed. The trainer, when it runs under torchrun, builds a
`DeviceMesh` (mesh.py) and then applies, in this order:
    0. with --cp, the context-parallel forms of the token mixers (context.apply_context_parallel: each rank holds a
       contiguous slice of every row; KDA folds the earlier slices' states, MLA all-gathers the latents);
    1. activation checkpointing of the token mixers (fsdp.apply_activation_checkpointing), optional;
    2. FSDP2 `fully_shard` of every decoder layer, then of the root (embeddings, final norm, lm_head, AttnRes
       output vectors) (fsdp.apply_fsdp);
    3. the optimizer (train/optim.py), whose Muon orthogonalises each sharded matrix on one rank (assigned by cost)
       and sends every rank its shard of the update (two all-to-alls a step).
Checkpoints of a distributed run are torch.distributed.checkpoint (DCP) directories with the optimizer state,
loadable at another world size; dcp.py converts them to and from the release safetensors layout
(`openk3 convert`). docs/parallel.md has the design, the commands and what is not built yet.
"""
