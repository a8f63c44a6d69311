"""Each stage of a build hands on frozen results and never rewrites another stage's: checked on a real int8 build
(every stage runs) by recording what each stage was handed and returned, and in the code by the builder's assignments.
"""

import ast
import dataclasses
from pathlib import Path

import numpy as np

import accel_opt.builder.context as context
from accel_opt.builder import pipeline

from ..conftest import image_npz_folder

BUILDER = Path(pipeline.__file__).parent
RESULT_FIELDS = [f.name for f in dataclasses.fields(context.BuildSoFar) if f.name != "setup"]


def test_every_stage_result_is_frozen():
    records = [context.BuildSoFar, context.Setup, context.Samples,
               *(getattr(context, name) for name in ("Exported", "Loaded", "Dealt", "Cleaned", "Reduced", "Compiled",
                                                     "Checked"))]
    for record in records:
        assert record.__dataclass_params__.frozen, record.__name__


def assignments_to_ctx(source: str) -> list[int]:
    """The lines of `source` that assign into what a stage is handed: `ctx.x = ...`, `ctx.x.y[0] += ...`, `setattr(ctx,
    ...)`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for target in targets:  # `ctx = ...` rebinds the name (the pipeline's loop does): not an assignment into it
            while isinstance(target, ast.Attribute | ast.Subscript):
                target = target.value
                if isinstance(target, ast.Name) and target.id == "ctx":
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and node.args and \
                isinstance(node.args[0], ast.Name) and node.args[0].id == "ctx":
            lines.append(node.lineno)
    return lines


def test_no_builder_module_assigns_to_what_a_stage_is_handed():
    found = [f"{path.name}:{line}" for path in sorted(BUILDER.glob("*.py"))
             for line in assignments_to_ctx(path.read_text())]
    assert not found


def test_the_assignment_check_can_fail():
    source = ("def stage(ctx):\n    ctx.bench = 1\n    ctx.samples.held_out[0] = None\n    ctx.notes += ['x']\n"
              "    setattr(ctx, 'verdict', None)\n    ctx = other(ctx)\n    done = ctx.verdict\n")
    assert assignments_to_ctx(source) == [2, 3, 4, 5]


def test_each_stage_adds_only_its_own_results_and_leaves_earlier_ones_as_they_were(tiny_cnn_path, fast_recipe,
                                                                                   tmp_path, monkeypatch):
    data = image_npz_folder(tmp_path / "data", 100)  # an int8 build holds 60 out: enough to certify it
    handed: list[tuple[str, context.BuildSoFar, context.BuildSoFar]] = []
    real = pipeline._run_stage

    def recording(ctx, name, stage, stages, on_stage):
        after = real(ctx, name, stage, stages, on_stage)
        handed.append((name, ctx, after))
        return after

    monkeypatch.setattr(pipeline, "_run_stage", recording)
    result = pipeline.build(tiny_cnn_path, fast_recipe.with_overrides(precision="int8"), data_dir=data,
                            out_dir=tmp_path / "out")
    assert result.exit_code in (0, 1)
    assert [name for name, _, _ in handed] == [name for name, _ in pipeline.STAGES]
    owned = {"export": {"exported"}, "load": {"loaded", "dealt"}, "cleanup": {"cleaned"}, "precision": {"reduced"},
             "compile": {"compiled"}, "accuracy": {"checked"}, "benchmark": {"measured"}, "verdict": {"verdict"},
             "reports": set()}
    final = handed[-1][2]
    for name, before, after in handed:
        assert after.setup is before.setup
        added = {f for f in RESULT_FIELDS if getattr(after, f) is not getattr(before, f)}
        assert added <= owned[name], name
        for field in RESULT_FIELDS:  # an earlier result is the very object the final build holds
            if getattr(before, field) is not None:
                assert getattr(final, field) is getattr(before, field), (name, field)
    # The samples dealt at load are what every later stage read, unchanged: same arrays, same order.
    load = next(after for name, _, after in handed if name == "load")
    samples = final.dealt.samples
    assert samples is load.dealt.samples
    for role in ("calibration", "steering", "held_out", "timed"):
        assert [id(s) for s in getattr(samples, role)] == [id(s) for s in getattr(load.dealt.samples, role)]
    assert all(np.isfinite(s["image"]).all() for s in samples.held_out)
    # The accuracy stage's deployment records where outputs hold a batch's samples; the compiled one is left as it was.
    assert final.checked.deployment is not final.compiled.deployment
    assert final.compiled.deployment.config.output_batch_axes == {}
    assert final.checked.deployment.config.output_batch_axes == final.checked.accuracy.evaluation.output_batch_axes
