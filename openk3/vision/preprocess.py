"""Images into MoonViT-V2's input (K3_SPEC sections 9 and 10).

    image = decode_image(png_or_jpeg_bytes)          # Pillow; a clear ImageError for a bad file
    item = preprocess(image, config.vision_config)   # resize rule, zero pad, normalise, cut into patches
    item.pixel_values [h*w, 3, 14, 14], item.grid_thw (1, h, w), item.num_tokens, item.digest (pixel hash)

The resize rule: keep the aspect ratio and scale down (never up) so that (W/14) * (H/14) <= 65,536 patches, then
zero-pad right and bottom to multiples of 28 (patch 14 x the 2x2 merge). 448x448 -> grid 32x32 -> 256 vision
tokens; 640x480 -> padded 644x504 -> grid 1x36x46 -> 414.
[inferred] bicubic resampling; the padding is black (0) before normalisation; mean = std = 0.5 per channel
(pixels in [-1, 1]) as Kimi K2.5's processor; a transparent image is composited on white.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.config import VisionConfig
from openk3.vision.tower import vision_tokens

PATCH_LIMIT = 65_536  # patches of one image after resizing (K3_SPEC section 9)
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)  # [inferred] Kimi K2.5's preprocessor_config
# Larger images are refused before decoding (a decompression bomb is small on disk, huge in memory). 8192^2 is
# well above what the resize rule keeps (65,536 patches of 14^2 = 12.8M pixels) and below Pillow's own bomb limit.
MAX_PIXELS = 8192 * 8192
# Modes Pillow converts to RGB without losing meaning; 16-bit and float images (I, I;16, F) are refused.
CONVERTIBLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "CMYK", "YCbCr", "La")
# The raster formats Pillow may open. NOTE: not "anything Pillow reads": client bytes must never reach plugins such
# as EPS (Pillow runs Ghostscript on it) or the many rarely used decoders.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Longer side / shorter side. Above it, the zero padding to 28 multiplies the patches: a 1 x 60,000,000 PNG (a few
# KB) would pad to 28 columns, 4M patches and a 9 GB canvas. 200 as Qwen2-VL's processor [inferred: K3's own bound is
# not published].
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image that cannot be used (not an image, truncated, empty, too large, an unsupported mode); the message
    says which. A ValueError, so the CLI and the server report it as bad input."""


def decode_image(data: bytes, where: str = "image"):
    """PNG/JPEG/... bytes -> an RGB PIL image, fully decoded (a truncated file fails here, not later)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError(f"{where}: empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:
            w, h = probe.size
            mode = probe.mode
            if w == 0 or h == 0:
                raise ImageError(f"{where}: zero size ({w}x{h})")
            if w * h > MAX_PIXELS:
                raise ImageError(f"{where}: {w}x{h} is {w * h:,} pixels, above the limit of {MAX_PIXELS:,}")
            if mode not in CONVERTIBLE_MODES:
                raise ImageError(f"{where}: unsupported image mode {mode!r} (expected one of "
                                 f"{', '.join(CONVERTIBLE_MODES)}: 8-bit colour, grey or palette)")
            probe.load()
            image = probe.copy()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not an image in a format accepted here ({', '.join(IMAGE_FORMATS)}; "
                         f"{len(data)} bytes starting {data[:8]!r})") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{where}: too large ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ImageError(f"{where}: cannot decode the image ({type(e).__name__}: {e}); is the file truncated?") \
            from None
    return to_rgb(image)


def to_rgb(image):
    """An RGB copy of a PIL image; transparency is composited on white [inferred]."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?((?:;[^,;]*)*?);base64,(.*)", re.DOTALL)


def decode_data_url(url: str, where: str = "image_url") -> bytes:
    """The bytes of a `data:image/...;base64,...` URL. Any other URL is refused: the server must not fetch
    addresses a client names."""
    if not isinstance(url, str):
        raise ImageError(f"{where}: url must be a string, got {type(url).__name__}")
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        scheme = (url.split(":", 1)[0] if ":" in url else url)[:16]  # (a client's string: never echo all of it)
        if scheme.strip().lower() == "data":
            head = url.strip()[5:].split(",", 1)[0]
            raise ImageError(f"{where}: a data URL must be data:image/<type>;base64,<data>; got media type "
                             f"{head[:40]!r}")
        raise ImageError(f"{where}: only base64 data URLs (data:image/png;base64,...) are accepted; remote or "
                         f"other URLs are not fetched (got scheme {scheme!r})")
    try:
        return base64.b64decode(m.group(3), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data URL is not valid base64 ({e})") from None


def resized_size(width: int, height: int, patch_size: int = 14, patch_limit: int = PATCH_LIMIT) -> tuple[int, int]:
    """(W', H') before padding: scaled down with the aspect ratio kept so that (W'/p) * (H'/p) <= patch_limit."""
    if width < 1 or height < 1:
        raise ImageError(f"image size {width}x{height}: must be positive")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(f"image size {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO}:1 (its padding to "
                         f"multiples of {2 * patch_size} would multiply the patches)")
    scale = min(1.0, math.sqrt(patch_limit / ((width / patch_size) * (height / patch_size))))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def padded_size(width: int, height: int, multiple: tuple[int, int]) -> tuple[int, int]:
    """(W, H) rounded up to multiples of (width multiple, height multiple)."""
    mw, mh = multiple
    return -(-width // mw) * mw, -(-height // mh) * mh


def image_grid(width: int, height: int, vision: VisionConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image of this original size: resized, padded to the merge window."""
    p = vision.patch_size
    kh, kw = vision.merge_kernel_size
    W, H = padded_size(*resized_size(width, height, p), (p * kw, p * kh))
    return 1, H // p, W // p


def num_image_tokens(width: int, height: int, vision: VisionConfig) -> int:
    """Vision vectors (<|media_pad|> slots) of an image of this original size: (H'/28) * (W'/28) in the release."""
    return vision_tokens(image_grid(width, height, vision), vision)


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what the tower needs, the media prompt's size, and a hash of its pixels."""

    pixel_values: Tensor  # [h * w, 3, p, p] fp32, normalised, patches in row-major order
    grid_thw: tuple[int, int, int]
    width: int  # original size, written into the media prompt
    height: int
    num_tokens: int  # vision vectors = <|media_pad|> slots
    digest: str  # sha256 of the grid and the pixel values: the image's identity for caches


def preprocess(image, vision: VisionConfig) -> ImageInput:
    """A PIL image -> ImageInput (the resize rule, zero padding, normalisation, patches)."""
    from PIL import Image

    image = to_rgb(image)
    width, height = image.size
    new_w, new_h = resized_size(width, height, vision.patch_size)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    t, h, w = image_grid(width, height, vision)
    p = vision.patch_size
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(new_h, new_w, 3)
    canvas = torch.zeros(h * p, w * p, 3, dtype=torch.uint8)  # black padding, right and bottom
    canvas[:new_h, :new_w] = x
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    pixels = ((canvas.float() / 255 - mean) / std).permute(2, 0, 1)  # [3, H, W]
    patches = pixels.view(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p).contiguous()
    digest = hashlib.sha256(repr((t, h, w)).encode() + patches.numpy().tobytes()).hexdigest()
    return ImageInput(patches, (t, h, w), width, height, vision_tokens((t, h, w), vision), digest)


def batch_images(images: list[ImageInput]) -> tuple[Tensor, Tensor]:
    """Pack images for the tower: (pixel_values [sum L_i, 3, p, p], grid_thws [N, 3]), no padding between them."""
    if not images:
        raise ValueError("batch_images needs at least one image")
    return torch.cat([im.pixel_values for im in images]), torch.tensor([im.grid_thw for im in images])
