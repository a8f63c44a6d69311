"""The compile stage's work on the staged folder: the backend's compile, its files and the resource config written into
the artifact, loaded back through the runtime (from there on the build checks and times that folder), and the check
that the deployment runs a batch of its size."""

from __future__ import annotations

import shutil

import onnx

from accel_opt import runtime
from accel_opt.artifact.config import RESOURCE_CONFIG, DeployedInput, ResourceConfig
from accel_opt.artifact.folder import file_hashes
from accel_opt.backends import compile_for
from accel_opt.builder.context import BuildSoFar, Compiled
from accel_opt.data import batch_of
from accel_opt.errors import AccelOptError, first_line
from accel_opt.files import write_json
from accel_opt.graph.inspect import io_specs, with_batch
from accel_opt.graph.save import save_model
from accel_opt.precision.fallback import is_onnx
from accel_opt.precision.nncf_openvino import IR_SUFFIX, ir_files
from accel_opt.preprocess.fit import image_input
from accel_opt.preprocess.fuse import fuse_normalize, fused_shape


def stage_deployment(ctx: BuildSoFar, shapes: dict[str, list[int]]) -> Compiled:
    """Write the model, the backend's compiled files and the resource config into the staged artifact,
    then load it back through the runtime: from here on the build checks and times that folder."""
    pre, staging, backend, workdir = ctx.recipe.preprocessing, ctx.setup.staging, ctx.setup.backend, ctx.setup.workdir
    inputs, outputs = ctx.loaded.inputs, ctx.loaded.outputs
    if ctx.torch:  # the AOTInductor package is what ships; its inputs and outputs are the exported module's
        # What compile() exports (and the benchmark's fp32 baseline too): the module, its inputs and outputs, and the
        # calibration samples of an int8 plan.
        backend.bind(ctx.torch_module, inputs, outputs, ctx.shapes.batch_axes, ctx.dealt.samples.calibration,
                     cache_dir=ctx.setup.cache_dir)
        c = compile_for(backend, ctx.candidate_path, ctx.recipe.precision, ctx.recipe, workdir / "torch", shapes)
        shutil.copy2(c.path, staging / c.path.name)
        deployed_inputs, deployed_outputs = inputs, outputs
    elif not is_onnx(ctx.candidate_path):  # NNCF's OpenVINO IR (calibration.quantizer: nncf): it ships as written
        model_file = staging / f"model{IR_SUFFIX}"
        for source, target in zip(ir_files(ctx.candidate_path), ir_files(model_file)):
            shutil.copy2(source, target)
        c = compile_for(backend, model_file, ctx.recipe.precision, ctx.recipe, workdir, shapes)
        deployed_inputs, deployed_outputs = inputs, outputs  # NNCF keeps the fp32 model's inputs and outputs
    else:
        model_file = staging / "model.onnx"
        source = ctx.candidate_path
        if pre is not None and pre.fused:
            source = fuse_normalize(source, image_input(pre, inputs).name, pre, workdir / "fused" / source.name)
        save_model(onnx.load(str(source)), model_file)  # external data resolved next to the source
        c = compile_for(backend, model_file, ctx.recipe.precision, ctx.recipe, workdir, shapes)
        deployed_inputs, deployed_outputs = io_specs(onnx.load(str(model_file), load_external_data=False))
    for extra in c.extra_files:
        if extra.parent != staging:
            shutil.copy2(extra, staging / extra.name)
    text = ctx.recipe.text
    # the folder runs as it was checked: its own tokenizer, hashed like every file
    if ctx.loaded.tokenizer_path is not None:
        from accel_opt.preprocess.text import TOKENIZER_FILE

        shutil.copy2(ctx.loaded.tokenizer_path, staging / TOKENIZER_FILE)
        text = text.model_copy(update={"tokenizer": TOKENIZER_FILE})  # the config names the file the folder carries
    config = ResourceConfig(
        backend=c.backend, device=c.device, providers=c.providers, precision=c.precision, threads=c.threads,
        settings=c.settings, model_file=c.path.name, extra_files=[p.name for p in c.extra_files],
        inputs=[DeployedInput(**s.model_dump(), shape_used=shapes[s.name], batch_axis=ctx.shapes.batch_axes.get(s.name))
                for s in deployed_inputs],
        outputs=deployed_outputs, batch_size=ctx.deploy_batch, batch_dynamic=ctx.shapes.batch_dynamic,
        preprocessing=ctx.recipe.preprocessing, text=text, postprocess=ctx.recipe.postprocess,
    )
    write_json(staging / RESOURCE_CONFIG, config)
    hashes = file_hashes(staging)  # hashed once: build.json reuses them
    return Compiled(compiled=c, resource_config=config, deployment=runtime.load_staged(staging, hashes, ctx.setup.cpu),
                    deployed_hashes=hashes, shapes=ctx.shapes, deploy_batch=ctx.deploy_batch)


def batch_problem(ctx: BuildSoFar) -> str | None:
    """Why the deployment cannot run a batch of its size (None: it can, or nothing needs checking).
    Only checked when some input is left unbatched: that is when a batch axis may have gone unseen."""
    axes = ctx.shapes.batch_axes
    if ctx.deploy_batch == 1 or all(a is not None for a in axes.values()):
        return None
    try:
        with ctx.deployment.runner(runtime.feed_dtypes_of(ctx.dealt.samples.held_out_deployed)) as runner:
            runner.infer(batch_of(ctx.dealt.samples.held_out_deployed, ctx.deploy_batch, axes), check_inputs=False)
    except AccelOptError:
        raise
    except Exception as exc:  # the runtime's own error types
        return first_line(exc, limit=200)
    return None


def deploy_shapes(ctx: BuildSoFar, fused: bool = True) -> dict[str, list[int]]:
    """The input shapes the artifact is compiled and checked for: the resolved shapes at the deployed batch
    (the image input in HWC order when its preprocessing is fused, unless `fused` is False: the model
    without the fused steps, as the fp32 baseline runs)."""
    shapes = ctx.shapes.shapes
    if ctx.shapes.batch_dynamic:
        shapes = with_batch(shapes, ctx.deploy_batch, ctx.shapes.batch_axes)
    if fused and ctx.fused:
        name = ctx.image_input
        shapes = {**shapes, name: fused_shape(shapes[name], ctx.recipe.preprocessing.layout)}
    return shapes
