"""What every backend provides: availability with a reason, compile, and a Polygraphy runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from polygraphy.backend.base import BaseRunner

from optimizer.recipe import Precision, Recipe


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class CompiledModel:
    """A model ready to run on one backend, with the facts a deployment needs."""

    backend: str
    path: Path  # the model file the backend runs
    precision: Precision
    device: str  # "cpu", "cuda:0"
    providers: list[str]  # what actually runs it (checked, not requested)
    threads: int
    build_seconds: float
    settings: dict[str, Any] = field(default_factory=dict)  # session/compile options, recorded verbatim
    extra_files: list[Path] = field(default_factory=list)  # files the deployment needs beside `path`


class Backend(Protocol):
    """A runtime the pipeline builds for.

    A backend that compiles kernels for fixed input shapes (OpenVINO) sets the class attribute
    `compiles_for_shapes = True`; its compile() then also takes the keyword `shapes` (input name ->
    the deployment's resolved shape) and the pipeline passes it. Others need neither.
    """

    name: str
    extra: str  # the pip extra that installs it

    def available(self) -> Availability: ...

    def supports(self, precision: Precision) -> Availability: ...

    def compile(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path) -> CompiledModel: ...

    def runner(self, compiled: CompiledModel) -> BaseRunner: ...

    def synchronize(self) -> None:
        """Wait for queued device work; a no-op on synchronous CPU runtimes."""
