"""Labels for the samples of --data, in the two conventions users already have.

- `--labels folders`: torchvision's ImageFolder layout, one sub-folder per class; a class's index is the position of
  its folder's name in sorted order. The samples are the images (or .npz files) inside the class folders, named
  CLASS/FILE.
- `--labels FILE.csv`: columns `file,label`, one row per sample file of --data; a label is a class index, or a class
  name from `--classes NAMES.txt` (one name per line, index = line number).

Every sample needs exactly one label and every label a sample; a label out of range, a name not in the class list or a
class without a sample is a one-line input error (exit 3).
"""

from __future__ import annotations

import csv
from pathlib import Path

from accel_opt.errors import InputRejected, UsageError

FOLDERS = "folders"


def read_classes(path: Path) -> list[str]:
    """Class names, one per line (index = line number, blank lines ignored)."""
    try:
        names = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--classes {path}: cannot be read ({exc})") from None
    if len(set(names)) != len(names):
        raise InputRejected(f"--classes {path}: a class name is listed twice")
    if not names:
        raise InputRejected(f"--classes {path}: no class names")
    return names


def class_folders(root: Path) -> list[str]:
    """The class folders of an ImageFolder layout, sorted (a class's index is its position)."""
    classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise InputRejected(f"--labels folders: {root} has no class sub-folders (ImageFolder: one folder per class)")
    return classes


def folder_labels(names: list[str], classes: list[str], every_class: bool = True) -> list[int]:
    """The label of every sample named CLASS/FILE, by its folder; a class folder without a sample is refused
    (`every_class`: --data; held-out samples of --eval-data may leave classes out)."""
    index = {name: i for i, name in enumerate(classes)}
    stray = next((name for name in names if name.split("/", 1)[0] not in index), None)
    if stray is not None:
        raise InputRejected(f"--labels folders: {stray!r} is in no class folder of {', '.join(classes[:5])}...")
    labels = [index[name.split("/", 1)[0]] for name in names]
    empty = sorted(set(classes) - {name.split("/", 1)[0] for name in names})
    if empty and every_class:
        raise InputRejected(f"--labels folders: class folder {empty[0]!r} holds no sample")
    return labels


def csv_labels(path: Path, names: list[str], classes: list[str] | None) -> list[int]:
    """The label of every sample (by its file name, `names`) from a `file,label` CSV."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputRejected(f"--labels {path}: not a readable CSV ({exc})") from None
    if not rows or not {"file", "label"} <= set(rows[0]):
        raise InputRejected(f"--labels {path}: needs the columns file,label")
    index = {name: i for i, name in enumerate(classes or [])}
    by_file: dict[str, int] = {}
    for line, row in enumerate(rows, start=2):
        file, label = (row.get("file") or "").strip(), (row.get("label") or "").strip()
        if file in by_file:
            raise InputRejected(f"--labels {path} line {line}: {file!r} is labeled twice")
        if label.lstrip("-").isdigit():
            value = int(label)
            if value < 0 or (classes is not None and value >= len(classes)):
                raise InputRejected(f"--labels {path} line {line}: label {value} is out of range"
                                    + (f" (0..{len(classes) - 1})" if classes else ""))
        elif label in index:
            value = index[label]
        else:
            raise InputRejected(f"--labels {path} line {line}: label {label!r} is not a class index"
                                + (" or a name in --classes" if classes else " (give --classes for class names)"))
        by_file[file] = value
    given = set(names)
    unknown = sorted(set(by_file) - given)
    if unknown:
        raise InputRejected(f"--labels {path}: {unknown[0]!r} is not a sample of --data")
    missing = [name for name in names if name not in by_file]
    if missing:
        raise InputRejected(f"--labels {path}: {missing[0]!r} has no label ({len(missing)} samples without one)")
    if classes is not None:
        empty = [name for i, name in enumerate(classes) if i not in set(by_file.values())]
        if empty:
            raise InputRejected(f"--labels {path}: class {empty[0]!r} has no sample")
    return [by_file[name] for name in names]
