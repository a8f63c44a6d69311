"""Safe loading and validation of an ONNX model file.

Order matters: cheap file checks first, then the protobuf header without external data, then the
external-data locations (checked by us before anything reads them: the path-traversal CVE family),
then onnx.checker *by path* (so >2 GB models work), then strict shape inference.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.files import ensure_free_space
from accel_opt.graph.inspect import index_bounds, opset_of
from accel_opt.graph.lift import lift_if_unimplemented
from accel_opt.graph.save import save_model

log = logging.getLogger(__name__)

# Domains that ONNX Runtime (and the other backends' ONNX parsers) implement.
KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft"}
# ONNX's training domain (Gradient, Momentum, Adagrad, Adam): no inference runtime has kernels for it.
TRAINING_DOMAIN = "ai.onnx.preview.training"
# Nodes that embed or point at a compiled engine: executable, never trusted from an input model.
UNSAFE_OP_TYPES = {("com.microsoft", "EPContext")}
_TEXT_SNIFF_BYTES = 512


@dataclass(frozen=True)
class LoadedModel:
    path: Path  # the model to build from: the input, or a copy without unused opset imports
    proto: onnx.ModelProto  # graph structure; external tensor data not loaded
    external_data_files: list[Path] = field(default_factory=list)  # of the input model
    notes: list[str] = field(default_factory=list)

    @property
    def opset(self) -> int:
        return opset_of(self.proto)

    @property
    def index_bounds(self) -> dict[str, int]:
        """Integer inputs that index a table -> the table's size: synthetic data must stay below it."""
        return index_bounds(self.proto)


def _check_file(path: Path) -> None:
    if not path.exists():
        raise InputRejected(f"model not found: {path}")
    if path.is_dir():
        raise InputRejected(f"model path is a directory, expected an .onnx file: {path}")
    if not path.is_file():
        raise InputRejected(f"model path is not a regular file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise InputRejected(f"model file is empty: {path}")
    with path.open("rb") as f:
        head = f.read(_TEXT_SNIFF_BYTES)
    if head.startswith(b"version https://git-lfs"):
        raise InputRejected(f"model is a Git LFS pointer, not the model itself (run `git lfs pull`): {path}")
    if _looks_like_text(head):
        raise InputRejected(f"model file is text, not a binary ONNX protobuf: {path}")


def _looks_like_text(head: bytes) -> bool:
    # An ONNX protobuf starts with field tags (0x08 ir_version, 0x12/0x1a/0x3a ...) and holds binary
    # bytes early; a text file (JSON, HTML error page, pointer) is printable throughout.
    try:
        decoded = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\r\n\t" for ch in decoded)


def _parse(path: Path) -> onnx.ModelProto:
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError, TypeError) as exc:
        raise InputRejected(f"not a valid ONNX model (protobuf does not parse: {exc}): {path}") from None
    except Exception as exc:  # onnx raises assorted types on corrupt input
        raise InputRejected(f"not a valid ONNX model ({type(exc).__name__}: {exc}): {path}") from None
    if proto.ir_version <= 0 or not proto.opset_import or not proto.HasField("graph"):
        raise InputRejected(f"not a valid ONNX model (no IR version, opset or graph; truncated?): {path}")
    if not proto.graph.output:
        raise InputRejected(f"ONNX model has no outputs: {path}")
    return proto


def _check_external_data(proto: onnx.ModelProto, model_dir: Path) -> list[Path]:
    """Every external location must be a relative path that stays inside the model's folder."""
    base = model_dir.resolve()
    files: dict[Path, int] = {}
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        # Read by hand: onnx's ExternalDataInfo raises a bare ValueError on an offset that is not an integer.
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        name = tensor.name or "(unnamed)"
        if "\0" in location or len(location.encode()) > 4096 or any(len(p.encode()) > 255 for p in location.split("/")):
            raise InputRejected(f"external data of tensor {name!r}: location {location[:80]!r} is not a usable file "
                                "name "
                                "(a NUL byte, or longer than a file system takes)")
        if not all(info.get(key, "0").isdigit() for key in ("offset", "length")):
            raise InputRejected(f"external data of tensor {name!r}: offset {info.get('offset')!r} and length "
                                f"{info.get('length')!r} must be non-negative integers")
        if not location or os.path.isabs(location) or Path(location).drive:
            raise InputRejected(f"external data of tensor {name!r}: location {location!r} must be a relative path")
        if ".." in Path(location).parts:
            raise InputRejected(f"external data of tensor {name!r}: location {location!r} leaves the model folder")
        target = base / location
        if target.is_symlink() or not target.resolve().is_relative_to(base):
            raise InputRejected(f"external data of tensor {name!r}: {location!r} is a link out of the model folder")
        if not target.is_file():
            raise InputRejected(f"external data of tensor {name!r}: file {location!r} is missing beside the model")
        st = target.stat()
        if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
            raise InputRejected(f"external data of tensor {name!r}: {location!r} is a hard link; copy the file instead")
        offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
        if offset + length > st.st_size:
            raise InputRejected(
                f"external data of tensor {name!r}: offset {offset} + length {length} "
                f"exceeds {location!r} ({st.st_size} bytes)"
            )
        files[target] = st.st_size
    return sorted(files)


def _check_ops(proto: onnx.ModelProto) -> None:
    for node, where in _every_node(proto):
        if (node.domain, node.op_type) in UNSAFE_OP_TYPES:
            raise InputRejected(f"node {node.name!r} ({node.domain}::{node.op_type}){where} embeds a compiled engine; "
                                "refusing untrusted engines")
    imported = {o.domain for o in proto.opset_import}
    local = {(f.domain, f.name) for f in proto.functions}  # model-local functions: runtimes inline them
    for graph in _all_graphs(proto.graph):
        for node in graph.node:
            if (node.domain, node.op_type) in local:
                continue
            if node.domain == TRAINING_DOMAIN:
                raise Unsupported(f"op {node.op_type!r} (node {node.name!r}) is training-only ({TRAINING_DOMAIN}): "
                                  "inference runtimes have no kernel for it; export the inference graph")
            if node.domain not in KNOWN_DOMAINS:
                raise Unsupported(
                    f"op {node.op_type!r} from unknown domain {node.domain!r} (node {node.name!r}) has no kernel on "
                    "any backend"
                )
            if node.domain not in imported and not (node.domain == "ai.onnx" and "" in imported):
                raise InputRejected(f"node {node.name!r} uses domain {node.domain!r} without an opset import")


def _check_io(proto: onnx.ModelProto) -> None:
    """Graph inputs and outputs must be tensors of numbers or booleans: the gate measures numeric
    distance and agreement, and the backends take array feeds."""
    initializers = {init.name for init in proto.graph.initializer}
    for kind, values in (("input", [v for v in proto.graph.input if v.name not in initializers]),
                         ("output", proto.graph.output)):
        for value in values:
            which = value.type.WhichOneof("value")
            if which != "tensor_type":
                hint = " (sklearn-onnx classifiers: convert with options={id(model): {'zipmap': False}})" if which in (
                    "sequence_type", "map_type") else ""
                raise Unsupported(f"{kind} {value.name!r} is a {(which or 'untyped value').replace('_type', '')}, not "
                                  "a "
                                  f"tensor: accel-opt builds models whose inputs and outputs are tensors{hint}")
            if value.type.tensor_type.elem_type == onnx.TensorProto.STRING:
                raise Unsupported(f"{kind} {value.name!r} is a string tensor: accel-opt builds models whose inputs and "
                                  "outputs are numbers or booleans (tokenize outside the model)")


def unused_domain_imports(proto: onnx.ModelProto) -> list[str]:
    """Opset imports of custom domains that no node (nor local function) uses: e.g. a Paddle export's
    `Paddle` v1. ONNX tooling (the version converter, IR-version lookup) fails on unknown domains."""
    used = {node.domain for graph in _all_graphs(proto.graph) for node in graph.node}
    for function in proto.functions:
        used.add(function.domain)
        used |= {node.domain for node in function.node}
    return [o.domain for o in proto.opset_import if o.domain not in ("", "ai.onnx") and o.domain not in used]


def _every_node(proto: onnx.ModelProto):
    """(node, where) for every node of the model: the graph, its subgraphs, and model-local functions (with theirs),
    where a runtime inlines them; `where` names the function (empty in the graph)."""
    for graph in _all_graphs(proto.graph):
        for node in graph.node:
            yield node, ""
    for function in proto.functions:
        where = f" in function {function.domain}::{function.name}"
        for node in function.node:
            yield node, where
            for attr in node.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    for graph in _all_graphs(sub):
                        yield from ((inner, where) for inner in graph.node)


def _all_graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _all_graphs(sub)


def check_model_file(path: Path) -> None:
    """The checks of `load_model` that read no tensor data: the file, its protobuf, its external-data locations and
    its ops. A published folder's model is checked by them before anything runs it (runtime.check)."""
    _check_file(path)
    proto = _parse(path)
    _check_external_data(proto, path.parent)
    _check_ops(proto)


def load_model(path: str | Path, workdir: Path, fed: set[str] | frozenset[str] = frozenset()) -> LoadedModel:
    """Validate `path` and return its structure; raise InputRejected/Unsupported with one clear line. `fed`: the
    input names the build's data gives, which decides what an input with a default (an initializer of its name)
    becomes: an input where the data gives it, its default as a constant where not."""
    path = Path(path)
    _check_file(path)
    proto = _parse(path)
    external_files = _check_external_data(proto, path.parent)
    _check_ops(proto)
    _check_io(proto)
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise InputRejected(f"ONNX checker rejected the model: {first_line(exc)}") from None
    shaped = _shape_inferred(path, workdir)
    notes = []
    build_path = path
    unused = unused_domain_imports(proto)
    renamed = name_nodes(proto)  # on the parsed copy: counts what the rewrite below will do
    doubled = _dedupe_outputs(proto)
    defaults = _settle_defaults(proto, fed)
    if unused or renamed or doubled or defaults:
        build_path = _rewritten(path, unused, workdir, fed)
        _drop_imports(shaped, unused)
        name_nodes(shaped)
        _dedupe_outputs(shaped)
        _settle_defaults(shaped, fed)
    notes += defaults
    if doubled:  # one tensor, one output: the transforms and every runtime's output dict take a name once
        notes.append(f"graph outputs listed more than once kept once: {', '.join(doubled)}")
    if unused:
        notes.append(f"unused opset imports dropped: {', '.join(unused)} (no node uses them)")
    if renamed:
        notes.append(f"{renamed} unnamed or duplicate-named nodes named <op>_<index> (the per-layer diagnosis, the "
                     "fallback and the quantizer's exclusions refer to nodes by name)")
    lifted = lift_if_unimplemented(build_path, opset_of(shaped), workdir)
    if lifted is not None:  # an old opset ONNX Runtime has no kernels for: build from the lifted copy
        build_path, note = lifted
        model = onnx.load(str(build_path))
        if name_nodes(model):  # the converter's new nodes are unnamed
            save_model(model, build_path)
        shaped = _shape_inferred(build_path, workdir, error=Unsupported, what="the lifted model's shape inference")
        notes.append(note)
    loaded = LoadedModel(path=build_path, proto=shaped, external_data_files=external_files, notes=notes)
    log.info("loaded %s: opset %d, %d nodes", path, loaded.opset, len(proto.graph.node))
    return loaded


def _shape_inferred(path: Path, workdir: Path, error: type[Exception] = InputRejected,
                    what: str = "shape inference") -> onnx.ModelProto:
    """`path`'s structure with inferred shapes (external data not loaded); `error` names a failure."""
    inferred = workdir / "shape_inferred.onnx"
    try:
        # By path: works past protobuf's 2 GB limit. Strict: type errors are errors, not warnings.
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred), check_type=True, strict_mode=True)
        return onnx.load(str(inferred), load_external_data=False)
    except Exception as exc:  # InferenceError, or a C++ error surfaced as RuntimeError
        ensure_free_space(workdir, path.stat().st_size)  # a full disk truncates the output silently
        raise error(f"{what} failed: {first_line(exc)}") from None
    finally:
        inferred.unlink(missing_ok=True)


def _rewritten(path: Path, domains: list[str], workdir: Path, fed: set[str] | frozenset[str]) -> Path:
    """The model without the opset imports `domains`, with every node named and its defaulted inputs settled, saved
    in `workdir`."""
    model = onnx.load(str(path))  # with its (already checked) external data
    _drop_imports(model, domains)
    name_nodes(model)
    _dedupe_outputs(model)
    _settle_defaults(model, fed)
    out = workdir / "input" / path.name
    save_model(model, out)
    return out


def _settle_defaults(model: onnx.ModelProto, fed: set[str] | frozenset[str]) -> list[str]:
    """An input that also has an initializer is an input with a default (ONNX Runtime lets a feed override it). The
    transforms cannot keep both meanings (the quantizer would quantize the default as a weight, and a feed would then
    change nothing), so each becomes one: an input where the data gives it (the initializer dropped: every sample,
    and every job the folder runs, feeds it), a constant where not (dropped from the inputs). Before IR version 4
    every initializer had to be listed as an input: those are weights, left as they are. Returns a note per input."""
    if model.ir_version < 4:
        return []
    initializers = {init.name: init for init in model.graph.initializer}
    defaulted = [value for value in model.graph.input if value.name in initializers]
    notes = []
    for value in defaulted:
        if value.name in fed:
            model.graph.initializer.remove(initializers[value.name])
            notes.append(f"input {value.name!r} has a default in the model and the data gives it: an input the "
                         "folder is fed, its default dropped")
        else:
            model.graph.input.remove(value)
            notes.append(f"input {value.name!r} has a default in the model and the data does not give it: built "
                         f"with its default as a constant (give {value.name!r} in every .npz of --data to feed it)")
    return notes


def _dedupe_outputs(model: onnx.ModelProto) -> list[str]:
    """Drop repeats from the graph's output list (the first of each name stays); return the names repeated."""
    seen: set[str] = set()
    kept, doubled = [], []
    for output in model.graph.output:
        (doubled if output.name in seen else kept).append(output)
        seen.add(output.name)
    if doubled:
        del model.graph.output[:]
        model.graph.output.extend(kept)
    return sorted({o.name for o in doubled})


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every unnamed node, and every node whose name an earlier node already took, the name
    `<op>_<index>` (made unique), in every graph and subgraph; returns how many were renamed. Node
    names are optional in ONNX, and tools that refer to nodes by name would confuse them."""
    graphs = list(_all_graphs(model.graph))
    taken = {node.name for graph in graphs for node in graph.node if node.name}
    seen: set[str] = set()
    renamed = 0
    for graph in graphs:
        for index, node in enumerate(graph.node):
            if node.name and node.name not in seen:
                seen.add(node.name)
                continue
            name, suffix = f"{node.op_type}_{index}", 1
            while name in taken or name in seen:
                name, suffix = f"{node.op_type}_{index}_{suffix}", suffix + 1
            node.name = name
            seen.add(name)
            renamed += 1
    return renamed


def _drop_imports(model: onnx.ModelProto, domains: list[str]) -> None:
    kept = [o for o in model.opset_import if o.domain not in domains]
    del model.opset_import[:]
    model.opset_import.extend(kept)
