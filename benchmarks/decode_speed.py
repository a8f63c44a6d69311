"""Host preprocessing cost: full JPEG decoding against draft decoding (Pillow's DCT-domain 1/2-1/8 scaling).

Camera-sized JPEGs (scikit-image's bundled photos upscaled to 1920x1280 and 4000x3000, quality 90) go
through the image-classifier recipe's host preprocessing (resize 256, crop 224) both ways, interleaved
file by file, one core. Prints the median ms per image of each and their ratio, and the pixel difference
of the resulting crops (the build's gate judges what that difference does to the model's outputs).

  python -m benchmarks.decode_speed
"""

from __future__ import annotations

import io
import statistics
import time

import numpy as np
from PIL import Image

from accel_opt.data import decode_image, preprocess_image
from accel_opt.recipe import Preprocessing
from accel_opt.zoo import _skimage_photos
from benchmarks._common import wait_for_idle

SIZES = ((1920, 1280), (4000, 3000))
ROUNDS = 5


def _jpegs(size: tuple[int, int]) -> list[bytes]:
    out = []
    for photo in _skimage_photos():
        buffer = io.BytesIO()
        Image.fromarray(photo).resize(size, Image.BICUBIC).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def _prepare(data: bytes, pre: Preprocessing) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    with Image.open(io.BytesIO(data)) as img:
        crop = preprocess_image(decode_image(img, pre.host_part()), pre.host_part())
    return (time.perf_counter() - start) * 1e3, crop


def main() -> None:
    full = Preprocessing(dtype="uint8", layout="NHWC")
    draft = full.model_copy(update={"draft_decode": True})
    print(f"idle check: {wait_for_idle():.0%} busy before the run")
    for size in SIZES:
        files = _jpegs(size)
        times = {"full": [], "draft": []}
        diffs = []
        for _ in range(ROUNDS):
            for data in files:  # interleaved: both variants see the same host state
                ms_full, crop_full = _prepare(data, full)
                ms_draft, crop_draft = _prepare(data, draft)
                times["full"].append(ms_full)
                times["draft"].append(ms_draft)
                diffs.append(np.abs(crop_full.astype(np.int16) - crop_draft.astype(np.int16)).mean())
        f, d = statistics.median(times["full"]), statistics.median(times["draft"])
        print(f"{size[0]}x{size[1]} JPEG -> 224 crop, {len(files)} photos x {ROUNDS}: full decode {f:.1f} ms, "
              f"draft decode {d:.1f} ms per image: {f / d:.2f}x faster; mean |pixel difference| "
              f"{statistics.mean(diffs):.2f} of 255")


if __name__ == "__main__":
    main()
