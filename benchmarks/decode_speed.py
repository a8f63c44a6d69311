"""Host preprocessing cost: full JPEG decoding against draft decoding (Pillow's DCT-domain 1/2-1/8 scaling),
and what each step after decoding costs at the e2e job's file sizes.

Camera-sized JPEGs (scikit-image's bundled photos upscaled to 1920x1280 and 4000x3000, quality 90) go
through the image-classifier recipe's host preprocessing (resize 256, crop 224) both ways, interleaved
file by file, one core. Prints the median ms per image of each and their ratio, and the pixel difference
of the resulting crops (the build's gate judges what that difference does to the model's outputs).

Then, on 640x427 photos (the e2e job's 320-800 px), the steps after decoding, interleaved: Pillow's
bilinear resize of the whole image then the crop, against resampling only the crop's box (what
accel-opt does); OpenCV's INTER_AREA and INTER_LINEAR where OpenCV is installed (it is not a
dependency); and normalizing the crop with the textbook expression against accel-opt's in-place one.

  python -m benchmarks.decode_speed
"""

from __future__ import annotations

import io
import statistics
import time

import numpy as np
from PIL import Image

from accel_opt.preprocess.images import decode_image, preprocess_image
from accel_opt.recipe.deployed import Preprocessing
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


def _after_decode(rounds: int = 20) -> None:
    """ms per image of each step after decoding, one core, interleaved; pixel differences vs Pillow's."""
    from accel_opt.preprocess.images import to_model_input

    pre = Preprocessing(dtype="uint8", layout="NHWC")
    floats = Preprocessing()
    images = [Image.fromarray(photo).resize((640, 427), Image.BICUBIC) for photo in _skimage_photos()]
    mean, std = np.asarray(floats.mean, np.float32), np.asarray(floats.std, np.float32)

    def whole_then_crop(img):
        scale = pre.resize / min(img.size)
        big = img.resize((max(pre.crop, round(img.width * scale)), max(pre.crop, round(img.height * scale))),
                         Image.BILINEAR)
        left, top = (big.width - pre.crop) // 2, (big.height - pre.crop) // 2
        return np.asarray(big.crop((left, top, left + pre.crop, top + pre.crop)))

    variants = {"Pillow: resize the whole image, then crop": whole_then_crop,
                "Pillow: resample only the crop's box (accel-opt)": lambda img: preprocess_image(img, pre)[0]}
    try:
        import cv2

        cv2.setNumThreads(1)

        def opencv(flag):
            def run(img):
                pixels = np.asarray(img)
                scale = pre.resize / min(img.size)
                width, height = max(pre.crop, round(img.width * scale)), max(pre.crop, round(img.height * scale))
                big = cv2.resize(pixels, (width, height), interpolation=flag)
                left, top = (width - pre.crop) // 2, (height - pre.crop) // 2
                return big[top:top + pre.crop, left:left + pre.crop]
            return run

        variants["OpenCV INTER_AREA, then crop"] = opencv(cv2.INTER_AREA)
        variants["OpenCV INTER_LINEAR (no antialiasing), then crop"] = opencv(cv2.INTER_LINEAR)
    except ImportError:
        print("OpenCV is not installed: its resizes are skipped (pip install opencv-python-headless to compare)")
    times = {name: [] for name in variants}
    diffs = {name: [] for name in variants}
    for _ in range(rounds):
        for img in images:
            reference = None
            for name, resize in variants.items():
                start = time.perf_counter()
                crop = resize(img)
                times[name].append((time.perf_counter() - start) * 1e3)
                reference = crop if reference is None else reference
                diffs[name].append(np.abs(crop.astype(np.int16) - reference.astype(np.int16)).mean())
    print(f"640x427 image -> 224 crop, {len(images)} photos x {rounds}, one core:")
    for name in variants:
        print(f"  {name:52} {statistics.median(times[name]):6.2f} ms; mean |pixel difference| vs the first "
              f"{statistics.mean(diffs[name]):.2f} of 255")
    crops = np.stack([whole_then_crop(img) for img in images[:8]])
    textbook, in_place = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        np.ascontiguousarray(((crops.astype(np.float32) / 255.0 - mean) / std).transpose(0, 3, 1, 2))
        textbook.append((time.perf_counter() - start) * 1e3 / len(crops))
        start = time.perf_counter()
        to_model_input(crops, floats)
        in_place.append((time.perf_counter() - start) * 1e3 / len(crops))
    print(f"  normalize a 224 crop to NCHW float32: (x / 255 - mean) / std {statistics.median(textbook):.2f} ms, "
          f"accel-opt in place {statistics.median(in_place):.2f} ms")


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
    _after_decode()


if __name__ == "__main__":
    main()
