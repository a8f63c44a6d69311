"""zoo.photo_dataset: crops of the photos it is given, normalized as the model it feeds was trained."""

from __future__ import annotations

import numpy as np

from accel_opt import zoo


def test_crops_of_given_photos_take_the_given_normalization():
    gray, white = np.full((300, 400, 3), 127, np.uint8), np.full((420, 300, 3), 255, np.uint8)
    minus_127_over_128 = ((127 / 255,) * 3, (128 / 255,) * 3)  # EfficientNet-Lite's (pixel - 127) / 128
    crops, labels = zoo.photo_dataset(64, per_photo=3, seed=1, photos=[gray, white], mean_std=minus_127_over_128)
    assert sorted(labels.tolist()) == [0, 0, 0, 1, 1, 1]
    for crop, label in zip(crops, labels):
        assert crop["image"].shape == (1, 3, 64, 64)
        np.testing.assert_allclose(crop["image"], 0.0 if label == 0 else 1.0, atol=1e-5)
    imagenet, _ = zoo.photo_dataset(64, per_photo=1, seed=1, photos=[white])
    imagenet_white = (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(imagenet[0]["image"][0, :, 0, 0], imagenet_white, rtol=1e-5)
