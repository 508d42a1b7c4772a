"""Images from clients (``duplex.protocol.images``): PNG, JPEG and WebP data URLs decode to RGB
pixels; a wrong or lying MIME type, a remote URL, too many bytes, too many pixels (a decompression
bomb declares billions in a few bytes: refused from its header, nothing inflated), truncated and
corrupt files are each refused with a message that says why."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from duplex.protocol import images
from duplex.protocol.images import ImageError


def encoded(array: np.ndarray, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **options)
    return out.getvalue()


def data_url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode("ascii")


def gradient(height: int = 48, width: int = 80) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 3, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds one compressed row of zeros."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(bytes(width * 3 + 1))) + png_chunk(b"IEND", b""))


@pytest.mark.parametrize(("fmt", "mime", "options"), [
    ("PNG", "image/png", {}),
    ("WEBP", "image/webp", {"lossless": True}),
    ("JPEG", "image/jpeg", {"quality": 95}),
])
def test_png_jpeg_and_webp_decode_to_rgb(fmt: str, mime: str, options: dict) -> None:
    picture = gradient()
    pixels = images.decode(images.parse_data_url(data_url(encoded(picture, fmt, **options), mime)))
    assert pixels.dtype == np.uint8 and pixels.shape == (48, 80, 3)
    if fmt == "JPEG":  # lossy
        assert np.abs(pixels.astype(int) - picture).mean() < 3
    else:
        assert np.array_equal(pixels, picture)


def test_a_greyscale_or_transparent_image_becomes_rgb() -> None:
    grey = encoded(gradient()[..., 0], "PNG")
    assert images.decode(images.parse_data_url(data_url(grey, "image/png"))).shape == (48, 80, 3)
    rgba = np.dstack([gradient(), np.full((48, 80), 128, np.uint8)])
    assert images.decode(images.parse_data_url(data_url(encoded(rgba, "PNG"), "image/png"))).shape == (48, 80, 3)


@pytest.mark.parametrize(("url", "message"), [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "image type 'image/gif' is not taken"),
    ("data:image/png,plain", "must be a base64 data URL"),
    (None, "must be a data URL string"),
])
def test_urls_that_are_not_taken(url: object, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        images.parse_data_url(url)


def test_too_many_bytes_are_refused_before_decoding() -> None:
    url = "data:image/png;base64," + "A" * (images.MAX_IMAGE_BYTES * 4 // 3 + 8)
    with pytest.raises(ImageError, match="over the limit of"):
        images.parse_data_url(url)


def test_a_type_that_lies_is_refused() -> None:
    jpeg = encoded(gradient(), "JPEG")
    with pytest.raises(ImageError, match="not a readable image/png image"):
        images.decode(images.parse_data_url(data_url(jpeg, "image/png")))


def test_too_many_pixels_are_refused_from_the_header() -> None:
    side = int(images.MAX_IMAGE_PIXELS**0.5) + 1
    with pytest.raises(ImageError, match=f"{side}x{side} pixels is over the limit"):
        images.decode(images.parse_data_url(data_url(bomb_png(side, side), "image/png")))


def test_a_decompression_bomb_is_refused_without_inflating_it() -> None:
    bomb = bomb_png(100_000, 100_000)  # 30 GB of pixels declared in a few hundred bytes
    assert len(bomb) < 2000
    start = time.perf_counter()
    with pytest.raises(ImageError, match="pixels"):
        images.decode(images.parse_data_url(data_url(bomb, "image/png")))
    assert time.perf_counter() - start < 0.5  # refused from the header, nothing inflated


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_truncated_and_corrupt_files_are_refused(damage: str) -> None:
    png = encoded((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8), "PNG")
    raw = png[: len(png) // 2] if damage == "truncated" else b"\x89PNG\r\n\x1a\n" + bytes(200)
    with pytest.raises(ImageError, match="not a readable image/png image"):
        images.decode(images.parse_data_url(data_url(raw, "image/png")))


def test_invalid_base64_is_refused() -> None:
    with pytest.raises(ImageError, match="not valid base64"):
        images.decode(images.parse_data_url("data:image/png;base64,***"))
