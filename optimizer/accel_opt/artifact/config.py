"""`resource_config.json`: how an artifact runs, as the build recorded it (backend, precision, threads, shapes, batch,
pre- and postprocessing) and what its benchmark measured. Part of the folder's format: the build writes it, the runtime
reads it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from accel_opt.graph.inspect import TensorSpec
from accel_opt.recipe.deployed import Postprocess, Preprocessing, TextStage
from accel_opt.recipe.types import Precision

RESOURCE_CONFIG = "resource_config.json"

# Every number a folder supplies is bounded before anything loads (runtime.check: exit 3): a forged resource config
# must not start thousands of threads (issue 74: 20,000 threads ran 14,000 on 2 CPUs and outlived SIGTERM) or size an
# allocation. Generous bounds, far above any build: what a real machine needs is the runtime's to cap (threads to
# the CPUs this process may use).
MAX_THREADS = 1024
MAX_BATCH = 1 << 16
MAX_DIM = 1 << 24
MAX_STREAMS = 256
Count = Annotated[int, Field(ge=1, le=MAX_THREADS)]


class DeployedInput(TensorSpec):
    shape_used: list[Annotated[int, Field(ge=0, le=MAX_DIM)]]  # at the deployed batch size
    batch_axis: int | None = Field(default=None, ge=0, le=32)  # None: not batched (a scalar, a fixed table)


class ResourceConfig(BaseModel):
    """`resource_config.json`: how to run the artifact (read by the runtime) and what it measured."""

    format: int = 1
    backend: Literal["onnxruntime", "openvino", "tensorrt", "torch"]
    device: str
    providers: list[str]
    precision: Precision
    threads: Count
    settings: dict[str, Any]  # session / compile options, recorded verbatim
    model_file: str
    extra_files: list[str] = []
    inputs: list[DeployedInput]
    outputs: list[TensorSpec]
    batch_size: int = Field(ge=1, le=MAX_BATCH)  # rows per call as deployed and as the gate evaluated it
    batch_dynamic: bool  # the model accepts other batch sizes (the benchmark sweeps them)
    preprocessing: Preprocessing | None = None  # the recipe's, for image inputs
    text: TextStage | None = None  # the recipe's, for text inputs (the folder carries tokenizer.json)
    postprocess: Postprocess | None = None  # the recipe's: what `accel-opt run` writes per input
    # Found by the build's gate: where each output holds the samples of a batch (-1: the same for all).
    output_batch_axes: dict[str, int] = {}
    # Measured by the build's benchmark:
    batch_sizes_measured: list[int] = []
    memory: dict[str, float] | None = None
    session_load_ms: float | None = None
    recommended: dict[str, Any] | None = None

    @property
    def batch_axes(self) -> dict[str, int | None]:
        return {i.name: i.batch_axis for i in self.inputs}

    @property
    def shapes(self) -> dict[str, list[int]]:
        return {i.name: list(i.shape_used) for i in self.inputs}


class _Settings(BaseModel):
    """The keys of `settings` a backend's loader reads by name; others are recorded for people and left as they are."""

    model_config = ConfigDict(extra="allow")


class TorchSettings(_Settings):
    torch_version: str
    device: str
    inputs: list[TensorSpec]
    output_names: list[str]
    aoti: dict[str, Any] = {}


class OpenVinoSettings(_Settings):
    shape_mode: Literal["static", "dynamic"]
    compile_config: dict[str, Any]
    static_shapes: dict[str, list[Annotated[int, Field(ge=0, le=MAX_DIM)]]] | None
    input_names: list[str]
    output_names: list[str]

    @field_validator("compile_config")
    @classmethod
    def _only_what_a_build_writes(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The keys and values OpenVINO's backend writes, nothing else: a key like CACHE_DIR would make the runtime
        write compiled blobs outside the folder and read them back unhashed (issue 74)."""
        allowed = {"INFERENCE_PRECISION_HINT": {"f32", "bf16", "f16"}, "PERFORMANCE_HINT": {"LATENCY", "THROUGHPUT"}}
        for key, value in config.items():
            if key in allowed:
                if value not in allowed[key]:
                    raise ValueError(f"{key} {value!r} is not one of {sorted(allowed[key])}")
            elif key in ("NUM_STREAMS", "INFERENCE_NUM_THREADS"):
                limit = MAX_STREAMS if key == "NUM_STREAMS" else MAX_THREADS
                if not str(value).isdigit() or not 1 <= int(value) <= limit:
                    raise ValueError(f"{key} {value!r} is not a count from 1 to {limit}")
            else:
                raise ValueError(f"{key} is not an option an accel-opt build sets")
        return config


class TensorRtSettings(_Settings):
    engine: str = "model.plan"
    profile: dict[str, Any] = {}


class OnnxRuntimeSettings(_Settings):
    execution_provider: str = "CPUExecutionProvider"
    provider_options: dict[str, dict[str, str]] = {}


# A folder's settings are checked against its backend's before anything loads (runtime.check): a forged or
# incomplete config is refused (exit 3) there, not met as a KeyError in a loader.
SETTINGS_OF = {"torch": TorchSettings, "openvino": OpenVinoSettings, "tensorrt": TensorRtSettings,
               "onnxruntime": OnnxRuntimeSettings}
