"""Images a client sends (Realtime ``input_image`` content, chat ``image_url`` parts): data URLs
checked, then decoded to what a model that sees takes (uint8 RGB arrays [height, width, 3]).

Two steps, so that nothing costly happens before a client's image is known to fit (DESIGN.md
invariant 9):

- ``parse_data_url`` (on the event loop, cheap): the URL must be a ``data:`` URL of PNG, JPEG or
  WebP in base64 (the server fetches nothing), and its base64 length bounds its bytes
  (``MAX_IMAGE_BYTES``) before anything is decoded;
- ``decode`` (CPU-bound: off the event loop): Pillow reads the header first, so the format must be
  the one the URL names and the pixel count (``MAX_IMAGE_PIXELS``) is checked before any pixel is
  decompressed (a decompression bomb never expands); truncated or corrupt files are refused.

Each failure is an ``ImageError`` whose message a client can act on; callers map it to their API's
error. Stateless.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
"""MIME types taken, and the format Pillow must find in the bytes."""
MAX_IMAGE_BYTES = 10 * 1024 * 1024
"""An encoded image's bytes (a 16 MiB WebSocket message carries one of these in base64)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Pixels of a decoded image: 48 MiB as RGB, about 0.1 s to decode; the model scales it down."""
MAX_IMAGES_PER_ITEM = 8
MAX_CONVERSATION_IMAGES = 16
"""Images a conversation's items may hold at once (each is read again on every later turn)."""


class ImageError(ValueError):
    """An image refused, with a message that says why."""


@dataclass(frozen=True)
class EncodedImage:
    """A data URL's image, checked but not decoded yet."""

    mime: str
    data: str  # base64

    @property
    def nbytes(self) -> int:
        return len(self.data) * 3 // 4


def parse_data_url(url: object) -> EncodedImage:
    """The image of a ``data:image/...;base64,...`` URL, checked before it is decoded."""
    if not isinstance(url, str):
        raise ImageError("image_url must be a data URL string")
    if not url.startswith("data:"):
        raise ImageError("remote image URLs are not fetched: send the image as a data URL")
    header, comma, data = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not comma or encoding != "base64":
        raise ImageError("image_url must be a base64 data URL (data:image/png;base64,...)")
    if mime not in FORMATS:
        raise ImageError(f"image type {mime!r} is not taken (use {', '.join(FORMATS)})")
    image = EncodedImage(mime, data)
    if image.nbytes > MAX_IMAGE_BYTES:
        raise ImageError(f"an image of {image.nbytes} bytes is over the limit of {MAX_IMAGE_BYTES} bytes")
    return image


def decode(image: EncodedImage) -> np.ndarray:
    """The image as uint8 RGB [height, width, 3]; CPU-bound (run it off the event loop)."""
    try:
        raw = base64.b64decode(image.data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url's data is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=[FORMATS[image.mime]]) as opened:
                width, height = opened.size  # from the header: nothing decompressed yet
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"an image of {width}x{height} pixels is over the limit of "
                                     f"{MAX_IMAGE_PIXELS} pixels")
                return np.asarray(opened.convert("RGB"), dtype=np.uint8).copy()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageError(f"image refused: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:  # Pillow's words for unreadable, truncated
        raise ImageError(f"image_url's data is not a readable {image.mime} image ({err})") from None


def decode_all(images: list[EncodedImage]) -> list[np.ndarray]:
    return [decode(image) for image in images]
