"""K3ForConditionalGeneration: the K3 language model that sees images (K3_SPEC sections 9 and 10).

    out = model(input_ids, labels=labels, pixel_values=pv, grid_thws=grids)   # as K3ForCausalLM, plus images

Each image's vision vectors (tower -> 2x2 merge -> projector, one per merged patch) replace the embeddings of its
`<|media_pad|>` slots, in order, before the text model runs; everything after the embedding is K3ForCausalLM.
NOTE: the spec's prompt has ONE pad per image, replaced by the image's N vectors; openk3 writes the N pads into the
token ids instead (`expand_media_pads`, the form the spec allows engines), so positions, labels and caches keep
one token per position.

The class extends K3ForCausalLM, so trainers, the engine and checkpoints treat it as the text model with two more
modules: `vision_tower` (MoonViT) and `mm_projector` (PatchMergerMLPV2), whose parameter names are the release's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openk3.config import K3Config, VisionConfig
from openk3.model.model import CausalLMOutput, K3ForCausalLM
from openk3.vision.tower import MoonViT, PatchMergerMLPV2, check_grids, vision_tokens


class K3ForConditionalGeneration(K3ForCausalLM):
    def __init__(self, config: K3Config, qat: bool = False):
        if config.vision_config is None:
            raise ValueError("K3ForConditionalGeneration needs a config with a vision_config")
        super().__init__(config, qat=qat)
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = PatchMergerMLPV2(config.vision_config)
        if self.lm_head.weight.device.type != "meta":
            # NOTE: K3ForCausalLM's constructor initialised before the vision modules existed; initialise again
            # so one seed covers the whole model (K3ForCausalLM.reset_parameters walks every parameter).
            self.reset_parameters()

    def image_features(self, pixel_values: Tensor, grid_thws: Tensor) -> list[Tensor]:
        """Each image's vision vectors in the text width: [N_i, hidden_size] per image (tower, merge, projector)."""
        merged = self.vision_tower(pixel_values, grid_thws)
        sizes = [m.shape[0] for m in merged]
        return list(self.mm_projector(torch.cat(merged)).split(sizes))

    def embed_with_images(self, input_ids: Tensor, features: list[Tensor]) -> Tensor:
        """Token embeddings [B, T, D] with the `<|media_pad|>` slots (row-major over the batch) filled by the images'
        vision vectors, image after image. The pads must be exactly the images' vectors in number."""
        pad = self.config.media_placeholder_token_id
        slots = input_ids == pad
        embeds = self.model.embed_tokens(input_ids)
        n_slots, n_vectors = int(slots.sum()), sum(f.shape[0] for f in features)
        if n_slots != n_vectors:
            raise ValueError(f"the input has {n_slots} <|media_pad|> (id {pad}) slots but its images give "
                             f"{n_vectors} vision vectors ({[f.shape[0] for f in features]}); write each image's "
                             f"pads with expand_media_pads")
        if n_slots == 0:
            return embeds
        vectors = torch.cat(features).to(embeds.dtype)
        return embeds.masked_scatter(slots[..., None], vectors)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, *, pixel_values: Tensor | None = None,
                grid_thws: Tensor | None = None, image_features: list[Tensor] | None = None,
                **kwargs) -> CausalLMOutput:
        """K3ForCausalLM.forward with images: `pixel_values` [L, 3, p, p] + `grid_thws` [N, 3] (preprocess.py), or
        the already computed `image_features` (the engine computes each image once and hands each prefill chunk
        the vectors of the slots inside it; an empty list for a chunk with none). With neither, this is the text
        model: NOTE: a `<|media_pad|>` id is then embedded as an ordinary token (a decode step feeding back a
        generated one), not refused."""
        if pixel_values is not None and image_features is not None:
            raise ValueError("give pixel_values (+ grid_thws) or image_features, not both")
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pixel_values and grid_thws come together")
        if pixel_values is not None:
            image_features = self.image_features(pixel_values, grid_thws)
        if image_features is None:
            return super().forward(input_ids, labels=labels, **kwargs)
        embeds = self.embed_with_images(input_ids, image_features)
        return super().forward(input_ids, labels=labels, inputs_embeds=embeds, **kwargs)


def build_model(config: K3Config, qat: bool = False) -> K3ForCausalLM:
    """The model a config describes: K3ForConditionalGeneration with a vision_config, else K3ForCausalLM."""
    if config.vision_config is not None:
        return K3ForConditionalGeneration(config, qat=qat)
    return K3ForCausalLM(config, qat=qat)


def count_vision_params(vision: VisionConfig) -> dict:
    """Parameters of the vision tower and of the projector, built on the meta device (the release: ~401M + 46M)."""
    with torch.device("meta"):
        tower, projector = MoonViT(vision), PatchMergerMLPV2(vision)
    return {"vision_params": sum(p.numel() for p in tower.parameters()),
            "projector_params": sum(p.numel() for p in projector.parameters())}


def expand_media_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Token ids with the k-th `<|media_pad|>` written counts[k] times (one slot per vision vector of image k)."""
    n = ids.count(pad_id)
    if n != len(counts):
        raise ValueError(f"the prompt has {n} <|media_pad|> slots for {len(counts)} images")
    out, k = [], 0
    for i in ids:
        if i == pad_id:
            out += [pad_id] * counts[k]
            k += 1
        else:
            out.append(i)
    return out


def grid_tokens(grid_thws: Tensor, vision: VisionConfig) -> list[int]:
    """Vision vectors of each image of grid_thws [N, 3]."""
    return [vision_tokens(g, vision) for g in check_grids(grid_thws, vision)]

