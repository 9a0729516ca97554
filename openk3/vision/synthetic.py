"""A synthetic image-text corpus, generated on the fly (nothing is downloaded): `openk3 train --config tiny-vl`.

Each example is one 84x84 picture of a coloured shape (red / green / blue / yellow x circle / square / triangle /
cross, at a random place and size on a light random background) in a K3 chat exchange, rendered in XTML with
thinking off:

    user:      [image] Describe the image.
    assistant: a red circle

Only the assistant's tokens are predicted (next-token loss; K3 trains its tower from scratch the same way, with
no contrastive objective). Example i of a stream is drawn from (seed, i) alone, so a stream resumes from its index
and the held-out images (another seed space) are never trained on.

`attribute_accuracy` scores a model on held-out images: its greedy answer names a colour and a shape, each right or
wrong on its own (chance: 1/4 each, 1/16 for both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.config import K3Config
from openk3.text.chat import encode_segments, render_xtml
from openk3.vision.model import expand_media_pads
from openk3.vision.preprocess import ImageInput, batch_images, preprocess

COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (225, 195, 30)}
SHAPES = ("circle", "square", "triangle", "cross")
ATTRIBUTES = ("colour", "shape")
IMAGE_SIZE = 84  # 6 x 6 patches -> 9 vision tokens
PROMPT = "Describe the image."
HELD_OUT_SEED = 10**9  # held-out images are drawn from this seed's stream; the trainer refuses it as a training seed


@dataclass(frozen=True)
class Example:
    image: object  # PIL image
    colour: str
    shape: str

    @property
    def description(self) -> str:
        return describe(self.colour, self.shape)


def describe(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def draw_example(seed: int, index: int) -> Example:
    """Example `index` of the stream `seed`: a shape of a colour, its place, size and shades random."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"{seed}:{index}")
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    S = IMAGE_SIZE
    bg = tuple(rng.randint(200, 250) for _ in range(3))
    image = Image.new("RGB", (S, S), bg)
    draw = ImageDraw.Draw(image)
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[colour])
    r = rng.uniform(0.18, 0.36) * S  # half the shape's size
    cx, cy = rng.uniform(r, S - r), rng.uniform(r, S - r)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    return Example(image, colour, shape)


def messages(example_size: tuple[int, int], answer: str | None = None) -> list[dict]:
    """The chat of one example: the user's image and PROMPT, then (for training) the assistant's answer."""
    w, h = example_size
    conv = [{"role": "user", "content": [{"type": "image_url", "width": w, "height": h},
                                         {"type": "text", "text": PROMPT}]}]
    if answer is not None:
        conv.append({"role": "assistant", "content": answer})
    return conv


def corpus_texts() -> list[str]:
    """Every plain text the corpus holds (the chat's tag names and attributes, the prompt, every description), to
    train the run's BPE on."""
    return [text for c in COLOURS for s in SHAPES
            for text, special in render_xtml(messages((IMAGE_SIZE, IMAGE_SIZE), describe(c, s)), thinking=False,
                                             add_generation_prompt=False) if not special]


def encode_example(tokenizer, config: K3Config, image: ImageInput, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, aligned labels) of one exchange: the labels predict only the assistant's answer and the end of
    its message; the media slot is written once per vision vector."""
    pad = config.media_placeholder_token_id
    size = (image.width, image.height)
    prompt = encode_segments(tokenizer, render_xtml(messages(size), thinking=False))
    full = encode_segments(tokenizer, render_xtml(messages(size, answer), thinking=False, add_generation_prompt=False))
    if full[:len(prompt)] != prompt:
        raise AssertionError("the rendered answer does not continue the generation prompt")
    ids = expand_media_pads(full, pad, [image.num_tokens])
    start = len(prompt) - 1 + image.num_tokens - 1  # the last prompt position (after expanding) predicts answer[0]
    labels = [-100] * len(ids)
    labels[start:-1] = ids[start + 1:]
    return ids, labels


@dataclass
class ImageTextBatch:
    input_ids: Tensor  # [B, T]; rows padded at the end with pad_token_id
    labels: Tensor  # [B, T]; -100 outside the answers
    cu_seqlens: Tensor  # [B + 1]: one segment per row
    seq_ids: Tensor  # [B, T]
    pixel_values: Tensor  # [sum L_i, 3, 14, 14]
    grid_thws: Tensor  # [B, 3]

    def to(self, device) -> ImageTextBatch:
        return ImageTextBatch(*(t.to(device) for t in (self.input_ids, self.labels, self.cu_seqlens, self.seq_ids,
                                                       self.pixel_values, self.grid_thws)))


def make_batch(examples: list[Example], tokenizer, config: K3Config, seq_len: int) -> ImageTextBatch:
    """Rows of one exchange each, padded to seq_len (a clear error when one is longer)."""
    rows, labels, images = [], [], []
    for ex in examples:
        item = preprocess(ex.image, config.vision_config)
        ids, lab = encode_example(tokenizer, config, item, ex.description)
        if len(ids) > seq_len:
            raise ValueError(f"an image-text example has {len(ids)} tokens, more than --seq-len={seq_len}")
        fill = seq_len - len(ids)
        rows.append(ids + [config.pad_token_id] * fill)
        labels.append(lab + [-100] * fill)
        images.append(item)
    B = len(rows)
    pixel_values, grid_thws = batch_images(images)
    return ImageTextBatch(torch.tensor(rows), torch.tensor(labels), torch.arange(0, (B + 1) * seq_len, seq_len),
                          torch.arange(B).repeat_interleave(seq_len).view(B, seq_len), pixel_values, grid_thws)


class ImageTextStream:
    """Endless, resumable batches of synthetic examples: batch k holds examples k*B .. k*B + B-1 of `seed`.
    `seq_len` (the padded row length) may change between batches; the state is one example index."""

    def __init__(self, tokenizer, config: K3Config, batch_size: int, seq_len: int, seed: int):
        self.tokenizer, self.config, self.batch_size, self.seq_len, self.seed = tokenizer, config, batch_size, \
            seq_len, seed
        self.index = 0

    def __iter__(self) -> ImageTextStream:
        return self

    def __next__(self) -> ImageTextBatch:
        examples = [draw_example(self.seed, self.index + b) for b in range(self.batch_size)]
        self.index += self.batch_size
        return make_batch(examples, self.tokenizer, self.config, self.seq_len)

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])


@torch.no_grad()
def describe_images(model, tokenizer, images: list, max_tokens: int = 5) -> list[str]:
    """The model's greedy answers to PROMPT about each image (PIL images of one size), each cut at the end of its
    response channel. Batched: every row has the same prompt length, so no padding (one full forward per token)."""
    config = model.config
    device = model.lm_head.weight.device
    items = [preprocess(im, config.vision_config) for im in images]
    if len({(it.width, it.height) for it in items}) != 1:
        raise ValueError("describe_images batches images of one size")
    features = model.image_features(*(t.to(device) for t in batch_images(items)))
    prompt = encode_segments(tokenizer, render_xtml(messages((items[0].width, items[0].height)), thinking=False))
    ids = torch.tensor([expand_media_pads(prompt, config.media_placeholder_token_id, [it.num_tokens])
                        for it in items], device=device)
    was_training = model.training
    model.eval()
    for _ in range(max_tokens):
        logits = model(ids, image_features=features, logits_to_keep=1).logits[:, -1]
        logits[:, config.media_placeholder_token_id] = float("-inf")  # an image slot is never generated
        nxt = logits.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    model.train(was_training)
    stops = {tokenizer.token_id("<|close|>"), config.eos_token_id}
    answers = []
    for row in ids[:, ids.shape[1] - max_tokens:].tolist():
        cut = next((k for k, t in enumerate(row) if t in stops), len(row))
        answers.append(tokenizer.decode(row[:cut]))
    return answers


def parse_description(text: str) -> tuple[str | None, str | None]:
    """(colour, shape) named by an answer of the form `a COLOUR SHAPE`, None for a part that is not one."""
    words = text.split()
    colour = words[1] if len(words) == 3 and words[0] == "a" and words[1] in COLOURS else None
    shape = words[2] if len(words) == 3 and words[0] == "a" and words[2] in SHAPES else None
    return colour, shape


def attribute_accuracy(model, tokenizer, n_images: int = 200, seed: int = HELD_OUT_SEED, batch_size: int = 50) -> dict:
    """How often the model's greedy description of a held-out image names its colour, its shape, and both (chance
    for a model that answers in the right form at random: 1/4, 1/4, 1/16), with a few answers to read."""
    right = {"colour": 0, "shape": 0, "both": 0}
    shown = []
    for start in range(0, n_images, batch_size):
        examples = [draw_example(seed, i) for i in range(start, min(n_images, start + batch_size))]
        for ex, answer in zip(examples, describe_images(model, tokenizer, [ex.image for ex in examples])):
            colour, shape = parse_description(answer)
            right["colour"] += colour == ex.colour
            right["shape"] += shape == ex.shape
            right["both"] += (colour, shape) == (ex.colour, ex.shape)
            if len(shown) < 4:
                shown.append({"truth": ex.description, "answer": answer})
    return {"images": n_images, "accuracy": {k: v / n_images for k, v in right.items()},
            "chance": {"colour": 1 / len(COLOURS), "shape": 1 / len(SHAPES), "both": 1 / (len(COLOURS) * len(SHAPES))},
            "examples": shown}


def accuracy_line(ev: dict) -> str:
    """One line for people from an `attribute_accuracy` result."""
    acc, chance = ev["accuracy"], ev["chance"]
    return (f"held-out images: the model's descriptions name the colour {acc['colour']:.1%} (chance "
            f"{chance['colour']:.0%}), the shape {acc['shape']:.1%} (chance {chance['shape']:.0%}), both "
            f"{acc['both']:.1%} (chance {chance['both']:.1%}) of {ev['images']} images")
