"""Image preprocessing (K3_SPEC sections 9 and 10): the resize rule, the spec's token counts, normalisation and patch
order, the XTML media prompt, and clear errors for bad images and URLs."""

import base64
import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from openk3.config import kimi_k3
from openk3.text.chat import render_xtml, segments_text
from openk3.vision.preprocess import (PATCH_LIMIT, ImageError, batch_images, decode_data_url, decode_image, image_grid,
                                      num_image_tokens, preprocess, resized_size)

V = kimi_k3().vision_config


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def png_header(w: int, h: int) -> bytes:
    """A PNG that declares a size and holds no pixels."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_the_spec_examples():
    assert num_image_tokens(448, 448, V) == 256
    assert image_grid(640, 480, V) == (1, 36, 46)
    assert num_image_tokens(640, 480, V) == 414
    item = preprocess(Image.new("RGB", (640, 480), (10, 20, 30)), V)
    assert item.grid_thw == (1, 36, 46) and item.num_tokens == 414 and (item.width, item.height) == (640, 480)
    assert item.pixel_values.shape == (36 * 46, 3, 14, 14)


@pytest.mark.parametrize("w,h", [(10000, 8000), (40000, 900), (4000, 4000), (3585, 3584)])
def test_large_images_are_scaled_down_to_the_patch_limit(w, h):
    nw, nh = resized_size(w, h)
    assert (nw / 14) * (nh / 14) <= PATCH_LIMIT
    assert abs(nw / nh - w / h) < 0.01 * w / h  # aspect ratio kept
    assert ((nw + 1) / 14) * ((nh + 1) / 14) > PATCH_LIMIT  # as large as the limit allows
    _, gh, gw = image_grid(w, h, V)
    assert gh % 2 == 0 and gw % 2 == 0 and gh * 14 - nh < 28 and gw * 14 - nw < 28


def test_small_images_are_not_scaled_up():
    assert resized_size(30, 20) == (30, 20)
    assert image_grid(30, 20, V) == (1, 2, 4)  # padded to 56 x 28


def test_normalisation_padding_and_patch_order():
    """Pixels map to (x / 255 - 0.5) / 0.5; the padding is black (-1); patch k is rows (k // w) and columns (k % w)
    of the padded image, channel first."""
    g = torch.Generator().manual_seed(0)
    arr = torch.randint(0, 256, (33, 47, 3), generator=g, dtype=torch.uint8)
    image = Image.frombytes("RGB", (47, 33), arr.numpy().tobytes())
    item = preprocess(image, V)
    assert item.grid_thw == (1, 4, 4)  # 47 x 33 -> 56 x 56
    expected = torch.full((56, 56, 3), -1.0)
    expected[:33, :47] = arr.float() / 255 * 2 - 1
    patches = item.pixel_values
    for k in (0, 3, 5, 15):
        i, j = divmod(k, 4)
        block = expected[i * 14:(i + 1) * 14, j * 14:(j + 1) * 14].permute(2, 0, 1)
        assert torch.allclose(patches[k], block, atol=1e-6)


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (28, 28), (255, 0, 0, 0))
    item = preprocess(decode_image(png_bytes(rgba)), V)
    assert torch.allclose(item.pixel_values, torch.ones_like(item.pixel_values))


def test_media_prompt_in_xtml():
    segs = render_xtml([{"role": "user", "content": [{"type": "image_url", "width": 640, "height": 480},
                                                     {"type": "text", "text": "what is it?"}]}], thinking=False)
    text = segments_text(segs)
    assert "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>what is it?" in text
    assert ("<|media_pad|>", True) in segs and ("image 640x480", False) in segs


def test_digest_tells_images_apart():
    a = preprocess(Image.new("RGB", (40, 40), (1, 2, 3)), V)
    b = preprocess(Image.new("RGB", (40, 40), (1, 2, 4)), V)
    c = preprocess(Image.new("RGB", (40, 40), (1, 2, 3)), V)
    assert a.digest != b.digest and a.digest == c.digest
    pv, grids = batch_images([a, b])
    assert pv.shape[0] == a.pixel_values.shape[0] * 2 and grids.tolist() == [[1, 4, 4], [1, 4, 4]]


# ------------------------------------------------------------------------------------------ bad input


def bad_images():
    whole = png_bytes(Image.new("RGB", (64, 64), (1, 2, 3)))
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    sixteen = io.BytesIO()
    Image.new("I;16", (8, 8)).save(sixteen, "PNG")
    return [(b"", "empty"), (b"hello, not an image", "not an image"), (whole[: len(whole) // 2], "truncated"),
            (jpeg[:-100], "truncated"), (png_header(8, 8), "cannot decode"), (png_header(0, 5), "not an image"),
            (png_header(100_000, 100_000), "too large"), (png_header(9000, 9000), "above the limit"),
            (sixteen.getvalue(), "mode 'I;16'")]


@pytest.mark.parametrize("data,message", bad_images())
def test_bad_images_get_a_clear_error(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data)


def test_data_urls():
    png = png_bytes(Image.new("RGB", (5, 3), (9, 9, 9)))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert decode_data_url(url) == png
    assert decode_image(decode_data_url(url)).size == (5, 3)
    with pytest.raises(ImageError, match="not fetched.*'https'"):
        decode_data_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@@")


def test_extreme_aspect_ratios_are_refused():
    """A 1-pixel-wide strip passes the pixel limit, but its padding to 28 columns would multiply its patches (a
    1 x 60M PNG is a few KB and would become a 9 GB canvas): refused before anything is allocated."""
    with pytest.raises(ImageError, match="aspect ratio above 200:1"):
        resized_size(1, 60_000_000)
    with pytest.raises(ImageError, match="aspect ratio"):
        num_image_tokens(5000, 20, V)
    strip = png_bytes(Image.new("RGB", (1, 5000)))
    with pytest.raises(ImageError, match="aspect ratio"):
        preprocess(decode_image(strip), V)
    assert image_grid(200, 1, V) == (1, 2, 16)  # at the bound still accepted


def test_only_common_raster_formats_are_opened():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, "TIFF")
    with pytest.raises(ImageError, match="not an image in a format accepted here"):
        decode_image(buf.getvalue())
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, fmt)
        assert decode_image(buf.getvalue()).size == (8, 8)


def test_data_urls_with_another_media_type_say_so():
    with pytest.raises(ImageError) as e:
        decode_data_url("x" * 100_000 + ":rest")
    assert len(str(e.value)) < 300  # a hostile string is not echoed whole
    with pytest.raises(ImageError, match="media type 'text/plain;base64'"):
        decode_data_url("data:text/plain;base64,aGVsbG8=")
