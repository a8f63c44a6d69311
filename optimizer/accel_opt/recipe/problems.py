"""A recipe's problems, all of them in one line: where each is (its YAML line when the recipe came from a file), what
is wrong, and for an unknown key the known one it was probably meant to be."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

MAX_SHOWN = 8  # problems named in the line; the rest are counted


def describe(exc: ValidationError, model: type[BaseModel], source: str, lines: dict[tuple, int] | None = None) -> str:
    """'recipe SOURCE: N problems: line L: a.b: what (did you mean c?); ...' for every error of `exc`."""
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(loc, lines or {})
        text = f"{f'line {line}: ' if line else ''}{where}: "
        if error["type"] == "extra_forbidden":
            known = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            text += "unknown key" + (f" (did you mean {close[0]}?)" if close
                                     else f" (known here: {', '.join(sorted(known))})"
                                     if known and len(known) <= 12 else "")
        else:
            text += error["msg"]
        problems.append((line or 0, text))
    problems.sort(key=lambda item: item[0])
    shown = "; ".join(text for _, text in problems[:MAX_SHOWN])
    more = f"; and {len(problems) - MAX_SHOWN} more" if len(problems) > MAX_SHOWN else ""
    count = f"{len(problems)} problems: " if len(problems) > 1 else ""
    return f"recipe {source}: {count}{shown}{more}"


def key_lines(text: str) -> dict[tuple, int]:
    """Each key path of a YAML mapping document -> the line (1-based) it is on; {} when it does not compose."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return {}
    found: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = (*path, key.value)
                found[here] = key.start_mark.line + 1
                walk(value, here)
        elif isinstance(node, yaml.SequenceNode):
            for index, value in enumerate(node.value):
                found[(*path, index)] = value.start_mark.line + 1
                walk(value, (*path, index))

    walk(root, ())
    return found


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int | None:
    """The line of the deepest part of `loc` the document has (pydantic adds model names to union members' paths)."""
    keys = tuple(str(p) if not isinstance(p, int) else p for p in loc)
    for end in range(len(keys), 0, -1):
        if keys[:end] in lines:
            return lines[keys[:end]]
        stringly = tuple(str(k) for k in keys[:end])
        if stringly in lines:
            return lines[stringly]
    return None


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """The keys a mapping at `path` of `model` may hold: the field names of the model found there (a dict's keys and
    a list's indexes are stepped over to their values' type)."""
    current: Any = model
    for part in path:
        current = _unwrapped(current)
        if typing.get_origin(current) in (dict, list):
            current = typing.get_args(current)[-1]  # the values' type: `part` is a key or an index
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = field.annotation
    current = _unwrapped(current)
    if typing.get_origin(current) in (dict, list):
        return []
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _unwrapped(annotation: Any) -> Any:
    """Optional[X] and Annotated[X, ...] as X (the first member that is not None)."""
    while typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotated = typing.get_origin(annotation) is typing.Annotated
        annotation = typing.get_args(annotation)[0] if annotated else members[0]
    return annotation
