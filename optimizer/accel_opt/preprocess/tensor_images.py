"""Images as tensor ops on the model's device: the image path of torch artifacts (`accel-opt run`, and the build's
gate, which judges this very path).

JPEGs are decoded in batches where the model runs when torchvision is there to do it (`torchvision.io.decode_jpeg`
takes a list and a device: nvJPEG on CUDA); everywhere else, and for files the device decoder rejects (PNG, CMYK
or progressive JPEGs it does not take), the host decodes with Pillow, exactly as the host path does. Then the same
tensor code runs on either device: the shorter side resized to `resize` (bilinear with antialiasing, the filter
family of Pillow's BILINEAR when it reduces), rounded to uint8 as Pillow's output is, center-cropped to `crop`,
normalized with the recipe's mean and std, laid out, cast. It is not the Pillow path bit for bit (another resampling
implementation), so the build's gate runs the candidate on it and the sign-off states its top-1 agreement with the
Pillow path. torch is imported at module level: import this module only where torch is needed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from accel_opt.errors import InputRejected
from accel_opt.preprocess.images import crop_geometry, read_image
from accel_opt.recipe.deployed import Preprocessing

JPEG_SUFFIXES = (".jpg", ".jpeg")


def device_decoder_available(device: str) -> bool:
    """torchvision's batched JPEG decoder on this device: only with a CUDA torch that loads torchvision (the PyPI
    torchvision does not load beside a CPU-only torch: "operator torchvision::nms does not exist")."""
    if not device.startswith("cuda"):
        return False
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError from its C++ ops
        return False
    return True


NOT_JPEG = "not a JPEG (the device decodes JPEGs only)"
DEVICE_REFUSED = "the device decoder refused it (nvJPEG: a progressive, CMYK or broken JPEG)"


def no_device_decoder(device: str) -> str:
    """Why every image of a job on `device` is decoded on the host."""
    if not device.startswith("cuda"):
        return "a CPU artifact: the host is its device"
    return "no device decoder: torchvision's decode_jpeg does not load beside this torch"


@dataclass
class DecodedBatch:
    images: list[torch.Tensor]  # uint8 HWC (RGB), one per input, on the device or the host
    host_decoded: int = 0  # inputs the device decoder did not take (not JPEG, or rejected): decoded on the host
    rejected: dict[int, str] = field(default_factory=dict)  # index -> reason (not an image at all)
    host_reasons: dict[int, str] = field(default_factory=dict)  # index -> why the host decoded it


class TensorImagePath:
    """Decode and preprocess images for a model on `device` ("cpu", "cuda[:N]") with the recipe's preprocessing."""

    def __init__(self, pre: Preprocessing, device: str = "cpu", strict: bool = False):
        """`strict`: an image the device does not decode is rejected, not decoded on the host (--strict-device)."""
        self.pre, self.device, self.strict = pre, torch.device(device), strict
        self.on_device_decoder = device_decoder_available(device)
        std = torch.tensor(pre.std, dtype=torch.float32)
        # (x / 255 - mean) / std as one multiply and one subtract, the host path's float32 arithmetic (to_model_input)
        self.scale = (1.0 / (255.0 * std)).to(self.device)
        self.offset = (torch.tensor(pre.mean, dtype=torch.float32) / std).to(self.device)

    def decode(self, files: list[bytes], names: list[str]) -> DecodedBatch:
        """Each file's RGB pixels: JPEGs in one batch on the device where it decodes them, the rest on the host."""
        batch = DecodedBatch(images=[None] * len(files))  # type: ignore[list-item]
        on_device = [i for i,
                     name in enumerate(names) if self.on_device_decoder and name.lower().endswith(JPEG_SUFFIXES)]
        if on_device:
            from torchvision.io import ImageReadMode, decode_jpeg

            data = [torch.frombuffer(bytearray(files[i]), dtype=torch.uint8) for i in on_device]
            try:
                decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError:  # one bad file fails the batch: decode one by one, the host taking what nvJPEG won't
                decoded = [self._one_on_device(d) for d in data]
            for i, image in zip(on_device, decoded):
                if image is not None:
                    batch.images[i] = image.permute(1, 2, 0)  # CHW -> HWC
        for i, blob in enumerate(files):
            if batch.images[i] is None:
                why = (DEVICE_REFUSED if i in on_device else NOT_JPEG if self.on_device_decoder
                       else no_device_decoder(str(self.device)))
                if self.strict:
                    batch.rejected[i] = f"decoded on the host, not the device: {why} (--strict-device)"
                    continue
                try:
                    batch.images[i] = torch.from_numpy(np.array(host_decode(blob, self.pre)))
                    batch.host_decoded += 1
                    batch.host_reasons[i] = why
                except InputRejected as exc:
                    batch.rejected[i] = str(exc)
        return batch

    def _one_on_device(self, data: torch.Tensor) -> torch.Tensor | None:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return None

    def crop(self, image: torch.Tensor) -> torch.Tensor:
        """One uint8 HWC image -> its uint8 crop, HWC, on the device: the host path's geometry (shorter side to
        `resize`, both sides at least `crop`, centered), resampled with torch."""
        pre = self.pre
        image = image.to(self.device, non_blocking=True)
        height, width = int(image.shape[0]), int(image.shape[1])
        resized_w, resized_h, left, top = crop_geometry(width, height, pre)
        pixels = image.permute(2, 0, 1).unsqueeze(0).float()
        if (resized_h, resized_w) != (height, width):
            pixels = F.interpolate(pixels, size=(resized_h, resized_w), mode="bilinear", align_corners=False,
                                   antialias=True)
        pixels = pixels[:, :, top:top + pre.crop, left:left + pre.crop]
        return pixels.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)

    def to_model_input(self, crops_hwc: torch.Tensor) -> torch.Tensor:
        """uint8 [batch, H, W, 3] crops -> the model's input on the device, as the host's to_model_input makes it."""
        pre = self.pre
        if pre.dtype == "uint8":
            return crops_hwc.permute(0, 3, 1, 2).contiguous() if pre.layout == "NCHW" else crops_hwc
        if pre.layout == "NCHW":
            pixels = crops_hwc.permute(0, 3, 1, 2).float() * self.scale[:, None, None] - self.offset[:, None, None]
        else:
            pixels = crops_hwc.float() * self.scale - self.offset
        pixels = pixels.contiguous()
        return pixels if pre.dtype == "float32" else pixels.to(getattr(torch, pre.dtype))

    def batch(self, images: list[torch.Tensor], cropped: bool = False) -> torch.Tensor:
        """Decoded images (or, `cropped`, their crops already) -> one model input batch on the device."""
        crops = [image.to(self.device,
                          non_blocking=True) for image in images] if cropped else [self.crop(i) for i in images]
        return self.to_model_input(torch.stack(crops))


def host_decode(blob: bytes, pre: Preprocessing):
    """A file's RGB pixels decoded by Pillow on the host, as the host path decodes them (refusals included)."""
    return read_image(io.BytesIO(blob), pre)


def tensor_path_samples(files: list[Path], pre: Preprocessing, input_name: str, device: str = "cpu",
                        flag: str = "--data") -> list[dict]:
    """The build's view of `files` through this path: one feed dict per file (numpy, batch of one), in file order."""
    path = TensorImagePath(pre, device)
    samples = []
    for file in files:
        decoded = path.decode([file.read_bytes()], [file.name])
        if decoded.rejected:
            raise InputRejected(f"{flag} {file.name}: {decoded.rejected[0]}")
        samples.append({input_name: path.batch(decoded.images).cpu().numpy()})
    return samples


def top_k_on_device(scores: torch.Tensor, k: int, softmax: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of the k best per row, computed where `scores` is: only k pairs per row cross to the host.
    float64 softmax, as the host's topk_record computes it."""
    values = scores.reshape(scores.shape[0], -1).double()
    if softmax:
        values = torch.softmax(values, dim=1)
    best = torch.topk(values, min(k, values.shape[1]), dim=1, sorted=True)
    return best.indices.cpu().numpy(), best.values.cpu().numpy()

