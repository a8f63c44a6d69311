"""What the rescue search and the fallback need from the build, in one place: the callbacks a build hands them
(Actions: transform, judge, diagnose, count FLOPs, time; SearchActions: build-and-judge, speed-up) and the limits
`--precision auto` sets on one candidate's search (SearchLimits). builder/fallback_actions.py and
builder/torch_plan.py make them; precision/fallback.py and precision/search.py call them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the modules that use these callbacks define what they pass
    from accel_opt.precision.diagnose import Diagnosis
    from accel_opt.precision.fallback import VariantVerdict
    from accel_opt.precision.remedies import Planned
    from accel_opt.precision.report import PrecisionReport
    from accel_opt.precision.search import Build, SearchStep


class SearchLimits(Protocol):
    """What `--precision auto` tells one candidate's rescue search (builder.context.CandidateLimits is the one): its
    share of the time budget, why a build at some speed-up cannot win, and where each step is reported."""

    search_budget_s: float
    on_step: Callable[[SearchStep], None] | None

    def cannot_win(self, speedup: float | None) -> str | None: ...


@dataclass
class Actions:
    """What the fallback (precision.fallback.run) needs from the build: its transform, judge and diagnosis, FLOP
    counts, speed-up and the remedies to try."""

    # (nodes kept in fp32, out path, recipe keys of the adopted remedies or None) -> the transform's report
    build: Callable[[list[str], Path, dict | None], PrecisionReport]
    judge: Callable[[Path], VariantVerdict]  # the build, on the steering samples, against the recipe's tolerance
    diagnose: Callable[[Path], Diagnosis | None]  # per-layer errors of a build (None: not available for it)
    # Conv/MatMul/Gemm FLOPs per node of a build, counted on the naive build (its node names are the ones kept)
    flops_of: Callable[[Path], dict[str, int]]
    # Nodes a build leaves to run in float anyway (ORT fuses a Conv into an integer kernel only with a
    # QuantizeLinear after it, which a consumer kept in fp32 no longer has). None: nothing to check.
    companions: Callable[[Path], list[str]] | None = None
    # The build judged like `judge`, but with its Q/DQ emulated in float (what `diagnose` sees). None: not checked.
    # The per-layer diagnosis sees the graph, not the deployed kernels: when only those fail, it would blame layers
    # that are not at fault.
    judge_emulated: Callable[[Path], VariantVerdict] | None = None
    # The build's speed-up against the same backend's fp32 build on the deployed kernels (None: not measurable)
    speedup: Callable[[Path], float | None] = lambda path: None
    remedies: tuple[Planned, ...] = ()  # whole-graph remedies to try first, cheapest first (remedies.plan)
    flops: dict[str, int] = field(default_factory=dict)  # flops_of(the naive build), set by run()
    # (the out path given to `build`, the recipe keys of its remedies) -> the file it writes (precision.written_path):
    # an OpenVINO IR (.xml) where NNCF quantizes
    written: Callable[[Path, dict | None], Path] = lambda path, overrides: path
    # The ONNX model whose node names the builds keep in float (the fp32 model): where a build is not ONNX, its FLOPs
    # and layer groups are read from this. None: every build is ONNX.
    structure: Path | None = None


@dataclass
class SearchActions:
    """What the search needs from the build: a variant with `keep` in float (and the recipe keys of the remedies
    adopted, or None), judged on the steering samples; and the speed-up of a variant against fp32 (None: not measurable
    here)."""

    build_and_judge: Callable[[list[str], Path, dict | None], Build]
    speedup: Callable[[Path], float | None]
