"""Accuracy-driven int8 fallback: keep the layer groups that int8 damages most in float.

Nodes are grouped by (op type, weight shape) -- in a transformer the attention projections, the FFN
up- and down-projections and the activation x activation products; in a CNN the convolutions of
one shape -- so the search costs a handful of re-quantizations, not one per node. It measures on
calibration samples only: the evaluation samples of the gate stay unseen.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from accel_opt.data import Sample
from accel_opt.precision import KeptNode

PROBE_SAMPLES = 8  # calibration samples the fallback measures on


def layer_groups(model: Path, op_types: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Quantizable nodes by group key -> [(node name, op type)]."""
    proto = onnx.load(str(model), load_external_data=False)
    weights = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    groups: dict[str, list[tuple[str, str]]] = {}
    for node in proto.graph.node:
        if node.op_type not in op_types or not node.name:
            continue
        shape = next((weights[i] for i in node.input[1:] if i in weights), None)
        key = f"{node.op_type} weight {'x'.join(map(str, shape))}" if shape else f"{node.op_type} activation x activation"
        groups.setdefault(key, []).append((node.name, node.op_type))
    return groups


def output_cosine(reference: Path, candidate: Path, samples: list[Sample]) -> float:
    """Worst output cosine over `samples` together (float64), candidate vs reference."""
    from accel_opt.backends.onnxruntime import CPU_PROVIDER, create_session

    ref, cand = create_session(reference, [CPU_PROVIDER], 2), create_session(candidate, [CPU_PROVIDER], 2)
    ref_out = [ref.run(None, s) for s in samples]
    cand_out = [cand.run(None, s) for s in samples]
    worst = 1.0
    for i in range(len(ref_out[0])):
        a = np.concatenate([o[i].ravel() for o in ref_out]).astype(np.float64)
        b = np.concatenate([o[i].ravel() for o in cand_out]).astype(np.float64)
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        worst = min(worst, float(a @ b / norms) if norms else 1.0)
    return worst


def keep_sensitive_groups_float(
    reference: Path,
    quantized: Path,
    groups: dict[str, list[tuple[str, str]]],
    requantize: Callable[[list[str], Path], None],
    samples: list[Sample],
    min_cosine: float,
    notes: list[str],
) -> list[KeptNode]:
    """Exclude groups greedily, most helpful first, until the cosine holds; rewrites `quantized`.

    `requantize(excluded_node_names, out_path)` writes a Q/DQ model leaving those nodes in float
    (the calibration ranges are reused, so this is cheap).
    """
    probe = samples[:PROBE_SAMPLES]
    baseline = output_cosine(reference, quantized, probe)
    if baseline >= min_cosine:
        notes.append(f"int8 cosine on calibration samples {baseline:.5f} >= {min_cosine}: no layer kept in float")
        return []
    trial = quantized.parent.parent / "fallback-trial.onnx"  # outside the folder that is published whole
    gains = {}
    for key, nodes in groups.items():
        requantize([name for name, _ in nodes], trial)
        gains[key] = output_cosine(reference, trial, probe)
    excluded: list[str] = []
    reached = baseline
    for key in sorted(gains, key=gains.get, reverse=True):
        excluded.append(key)
        requantize([name for k in excluded for name, _ in groups[k]], quantized)
        reached = output_cosine(reference, quantized, probe)
        if reached >= min_cosine:
            break
    notes.append(
        f"int8 cosine on {len(probe)} calibration samples was {baseline:.5f} < {min_cosine}; kept in float: "
        + ", ".join(f"{k} ({len(groups[k])} nodes, alone -> {gains[k]:.5f})" for k in excluded)
        + f"; now {reached:.5f}"
    )
    return [
        KeptNode(node=name, op_type=op, reason=f"int8 sensitivity: group '{key}' (alone in float: cosine {gains[key]:.5f})")
        for key in excluded
        for name, op in groups[key]
    ]


def kept_from_cache(cached: Path) -> list[KeptNode]:
    """The kept-in-float list stored beside a cached quantized model, if any."""
    kept_file = cached.with_suffix(".kept.json")
    return [KeptNode(**k) for k in json.loads(kept_file.read_text())] if kept_file.is_file() else []
