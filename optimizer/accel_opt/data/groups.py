"""Samples that share a source (crops of one photo, frames of one video, chunks of one document) are not independent.
The user names their groups (`--groups FILE.csv` of file,group, or `--group-pattern REGEX` over each sample's name);
whole groups are dealt into the roles, so no group is in two of them (scikit-learn's GroupShuffleSplit is the model,
written here because it deals by a test share only, not into three roles with caps and copies), and the verdict's
rates count held-out groups as their trials (accuracy.evidence.Trials)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from accel_opt.data import DataSplit, _role_counts
from accel_opt.errors import InputRejected
from accel_opt.recipe.gate import SplitConfig


def read_groups_file(path: Path) -> dict[str, str]:
    """FILE.csv with a header row `file,group`: each sample's name (as listed in manifest.json) -> its group."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputRejected(f"--groups {path}: cannot be read as CSV: {exc}") from None
    if not rows or not {"file", "group"} <= set(rows[0]):
        raise InputRejected(f"--groups {path}: needs a header row with the columns file,group and one row per sample")
    table: dict[str, str] = {}
    for number, row in enumerate(rows, start=2):
        name, group = (row.get("file") or "").strip(), (row.get("group") or "").strip()
        if not name or not group:
            raise InputRejected(f"--groups {path}, line {number}: a file and a group are both needed")
        if table.setdefault(name, group) != group:
            raise InputRejected(f"--groups {path}, line {number}: {name} is in two groups ({table[name]}, {group})")
    return table


def sample_groups(names: list[str], config: SplitConfig) -> list[str] | None:
    """Each sample's group by the recipe's `accuracy.split` (None: samples are not grouped). A sample the groups file
    does not list, a listed file that is not a sample, or a name the pattern does not match is an input error."""
    if config.groups_file is not None:
        table = read_groups_file(Path(config.groups_file))
        missing = [name for name in names if name not in table]
        if missing:
            raise InputRejected(f"--groups {config.groups_file}: {len(missing)} sample(s) have no group, first "
                                f"{missing[0]}: list every sample of --data (and --eval-data)")
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise InputRejected(f"--groups {config.groups_file}: names {len(unknown)} file(s) that are not samples, "
                                f"first {unknown[0]}")
        return [table[name] for name in names]
    if config.group_pattern is None:
        return None
    pattern, groups = re.compile(config.group_pattern), []
    for name in names:
        found = pattern.search(name)
        if found is None:
            raise InputRejected(f"--group-pattern {config.group_pattern!r} does not match the sample {name}: every "
                                "sample needs a group")
        groups.append(found.group(1) if pattern.groups else found.group(0))
    return groups


def split_groups(keys: list[str], groups: list[str], config: SplitConfig, calibrates: bool, calibration_max: int,
                 verdict_max: int, seed: int, held_out: list[str] | None = None) -> DataSplit:
    """data.split_roles dealing whole groups (`groups`: one per sample, --eval-data's after --data's). Groups are taken
    in a seeded order: calibration, then steering, while each is short of its share of the samples, the rest held out
    (one group at least). A group's samples beyond its role's cap are left unused (their source calibrated or
    steered), and so are --eval-data samples of a group that calibrated or steered, and copies of any sample."""
    count = len(keys)
    names = list(dict.fromkeys(groups[:count]))
    order = [names[int(i)] for i in np.random.default_rng(seed).permutation(len(names))]
    n_calib, n_steer = _role_counts(count, config, calibrates, calibration_max, reserve=1 if held_out is None else 0,
                                    all_data=held_out is not None)
    rest = "verdict" if held_out is None else "unused"
    caps = {"calibration": n_calib if calibrates else 0, "steering": n_steer}
    members = {name: [i for i in range(count) if groups[i] == name] for name in names}
    split, seen, role_of = DataSplit(seed=seed), set(), {}
    for position, name in enumerate(order):
        role = next((r for r in ("calibration", "steering") if len(getattr(split, r)) < caps[r]), rest)
        if held_out is None and position == len(order) - 1 and not split.verdict:
            role = "verdict"  # the last group is held out when nothing else was
        role_of[name] = role
        for i in members[name]:
            full = role in caps and len(getattr(split, role)) >= caps[role]
            (split.unused if keys[i] in seen or full else getattr(split, role)).append(i)
            seen.add(keys[i])
    for j, key in enumerate(held_out or []):
        dealt = role_of.get(groups[count + j]) in ("calibration", "steering")
        (split.unused if key in seen or dealt else split.verdict).append(count + j)
        seen.add(key)
    if calibrates and not split.calibration:
        raise InputRejected(f"--data holds {len(names)} group(s): calibrating and judging on disjoint groups needs 2 "
                            "or more")
    split.verdict, beyond = split.verdict[:verdict_max], split.verdict[verdict_max:]
    split.unused += beyond
    for role in ("calibration", "steering", "verdict", "unused"):
        getattr(split, role).sort()
    split.groups = {role: sorted({groups[i] for i in getattr(split, role)})
                    for role in ("calibration", "steering", "verdict")}
    return split
