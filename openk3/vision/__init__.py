"""MoonViT-V2 and image input for K3 (K3_SPEC section 10): tower.py (the tower, merge and projector), model.py
(K3ForConditionalGeneration), preprocess.py (decoding, the resize rule, patches, the media prompt), synthetic.py (the
image-text corpus `openk3 train --config tiny-vl` learns)."""
