"""Scale-out on torch.distributed, applied from outside the single-device model (torchtitan style; K3_SPEC section 8).

The model in openk3/model/ never knows it is distributed. The trainer, when it runs under torchrun, builds a
`DeviceMesh` (mesh.py) and then applies, in this order:
    1. activation checkpointing of the token mixers (fsdp.apply_activation_checkpointing), optional;
    2. FSDP2 `fully_shard` of every decoder layer, then of the root (embeddings, final norm, lm_head, AttnRes
       output vectors) (fsdp.apply_fsdp);
    3. the optimizer (train/optim.py), whose Muon gathers each matrix of a sharded parameter for Newton-Schulz and
       keeps only its own shard of the update.
Checkpoints of a distributed run are torch.distributed.checkpoint (DCP) directories with the optimizer state,
loadable at another world size; dcp.py converts them to and from the release safetensors layout
(`openk3 convert`). docs/parallel.md has the design, the commands and what is not built yet.
"""
