"""A trained mobile-class image classifier, the kind of network where reduced precision is fast and fragile.

MobileNetV3-style blocks: inverted residuals with depthwise 3x3 convolutions, squeeze-and-excitation gates,
hard-swish and ReLU6, batch norm; 96x96 input. Trained here, offline, in a few minutes on two cores: the task is to
tell which photo of scikit-image's, and which quadrant of it, a random crop comes from (36 fine-grained classes,
neighbouring quadrants look alike), so its class margins are a trained network's, not a random head's.

    python examples/mobile_classifier.py train [--out artifacts/mobile]     # writes mobile.pt (a state dict)
    python examples/mobile_classifier.py images DIR --count 200 --seed 7   # JPEG crops of the same photos
    accel-opt build examples/mobile_classifier.py:mobile --shapes image:1x3x96x96 ...   # loads
    artifacts/mobile/mobile.pt

The factory loads its weights with `torch.load(..., weights_only=True)`; it trains them first when the file is missing.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

SIZE = 96
QUADRANTS = 4
WEIGHTS = Path(os.environ.get("ACCEL_OPT_MOBILE_WEIGHTS",
                              Path(__file__).resolve().parent.parent / "artifacts" / "mobile" / "mobile.pt"))
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# (expansion, out channels, squeeze-excite, activation, stride): a MobileNetV3-Small-like stack, narrowed
BLOCKS = [(1, 16, True, "relu6", 2), (4, 24, False, "relu6", 2), (3, 24, False, "relu6", 1), (4, 40, True, "hswish", 2),
          (6, 40, True, "hswish", 1), (3, 48, True, "hswish", 1), (6, 96, True, "hswish", 2),
          (6, 96, True, "hswish", 1)]


def _act(name: str) -> nn.Module:
    return nn.ReLU6() if name == "relu6" else nn.Hardswish()


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, max(8, channels // 4),
                                             1), nn.Conv2d(max(8, channels // 4), channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * nn.functional.hardsigmoid(self.expand(gate))


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, expansion: int, c_out: int, se: bool, act: str, stride: int):
        super().__init__()
        mid = c_in * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers += [nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), _act(act)]
        layers += [nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), _act(act)]
        if se:
            layers.append(SqueezeExcite(mid))
        layers += [nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]  # the linear "project" convolution
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileClassifier(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        blocks, c_in = [], 16
        for expansion, c_out, se, act, stride in BLOCKS:
            blocks.append(InvertedResidual(c_in, expansion, c_out, se, act, stride))
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(c_in, 256, 1), nn.Hardswish())
        self.classifier = nn.Linear(256, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(self.blocks(self.stem(image))).mean((2, 3)))


def _photos() -> list[np.ndarray]:
    from accel_opt import zoo

    return zoo._skimage_photos()


def crops(count_per_class: int, seed: int) -> tuple[list, np.ndarray]:
    """Random crops (35-60% of a quadrant's side, mirrored half the time) of every photo's every quadrant, as PIL
    images (one class per photo and quadrant), shuffled; and their labels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images, labels = [], []
    for p, photo in enumerate(_photos()):
        h, w = photo.shape[:2]
        for q in range(QUADRANTS):
            top, left = (q // 2) * h // 2, (q % 2) * w // 2
            for _ in range(count_per_class):
                side = int(min(h, w) / 2 * rng.uniform(0.35, 0.6))
                y, x = top + int(rng.integers(0, h // 2 - side + 1)), left + int(rng.integers(0, w // 2 - side + 1))
                crop = Image.fromarray(photo[y:y + side, x:x + side])
                images.append(crop.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop)
                labels.append(p * QUADRANTS + q)
    order = rng.permutation(len(images))
    return [images[i] for i in order], np.asarray(labels)[order]


def to_tensor(images: list) -> torch.Tensor:
    """The image-classifier recipe's preprocessing, fitted to 96x96 (shorter side to 110, center crop 96): what
    the builds feed the network."""
    from accel_opt.preprocess.images import preprocess_image
    from accel_opt.recipe.deployed import Preprocessing

    pre = Preprocessing(resize=round(SIZE * 256 / 224), crop=SIZE, mean=list(MEAN), std=list(STD))
    return torch.from_numpy(np.concatenate([preprocess_image(i.convert("RGB"), pre) for i in images]))


def train(out: Path = WEIGHTS, seconds: float = 240.0, seed: int = 0) -> Path:
    """Train for about `seconds` on two cores (AdamW, cosine schedule); save the state dict."""
    torch.manual_seed(seed)
    images, labels = crops(60, seed=seed)
    x, y = to_tensor(images), torch.from_numpy(labels)
    classes = int(labels.max()) + 1
    model = MobileClassifier(classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    started, step, batch = time.monotonic(), 0, 64
    steps = max(50, int(seconds / 0.35))  # ~0.35 s a step of 64 at 96x96 on two cores
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model.train()
    while step < steps and time.monotonic() - started < seconds * 1.5:
        index = torch.randint(0, len(x), (batch,))
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"classes": classes, "state": model.state_dict()}, out)
    held_images, held_labels = crops(10, seed=seed + 100)
    with torch.inference_mode():
        accuracy = float((model(to_tensor(held_images)).argmax(1).numpy() == held_labels).mean())
    print(f"trained {step} steps in {time.monotonic() - started:.0f} s; held-out accuracy {accuracy:.1%} "
          f"({classes} classes) -> {out}")
    return out


def mobile() -> nn.Module:
    """The factory: the trained classifier (trained first when its weights file is missing)."""
    if not WEIGHTS.is_file():
        train(WEIGHTS)
    saved = torch.load(WEIGHTS, weights_only=True)
    model = MobileClassifier(saved["classes"])
    model.load_state_dict(saved["state"])
    return model.eval()


def write_images(folder: Path, count_per_class: int, seed: int) -> list[int]:
    """JPEGs of crops of the same photos (another seed: not the training crops); returns their labels."""
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = crops(count_per_class, seed)
    for i, image in enumerate(images):
        image.convert("RGB").save(folder / f"crop_{i:04d}.jpg", quality=92)
    return labels.tolist()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", type=Path, default=WEIGHTS)
    t.add_argument("--seconds", type=float, default=240.0)
    i = sub.add_parser("images")
    i.add_argument("folder", type=Path)
    i.add_argument("--count", type=int, default=5, help="crops per class")
    i.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.command == "train":
        train(args.out, args.seconds)
    else:
        print(f"{len(write_images(args.folder, args.count, args.seed))} images -> {args.folder}")
