"""A sample (a feed dict) and the record of where a build's samples came from."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

Sample = dict[str, np.ndarray]


class DataSummary(BaseModel):
    source: str  # "npz", "images", "text" or "synthetic"
    path: str | None
    count: int
    sha256: str | None  # content hash of the files read (None for synthetic)
    seed: int | None = None
    names: list[str] = []  # one per sample, in sample order: file names, or synthetic-0000...

    @property
    def synthetic(self) -> bool:
        return self.source == "synthetic"
