"""The TensorRT backend uses only Python API names that TensorRT 10.x and 11.x both export.

Proven without TensorRT: tests/data/trt_names/tensorrt-<major>.txt list the names the
bindings wheels register (scripts/trt_binding_names.py reads them from the wheels' machine code;
each file's header names the wheel and its sha256). This test parses the backend's sources with
`ast` and checks every name used on the `trt` module (`trt.Builder`), on its enums
(`trt.BuilderFlag.TF32`: exact, one `enum_<T>::value` call each) and on objects it can follow
(`builder = trt.Builder(...)`, `config = builder.create_builder_config()`: `IBuilderConfig::set_flag`).

What the lists prove: enum members exactly. Class members mostly: the extraction can credit a name
to a class that lacks it (a false pass here) and, checked against NVIDIA's binding sources, missed
one member of the classes used (a false failure, which would show). Module-level names only as
"this identifier exists in the bindings".

Guard convention: a name only one version has is read with `getattr(x, "NAME", default)` or
`hasattr(x, "NAME")`, the code works either way, and the module lists it in `OPTIONAL_TRT_NAMES`
(name -> why). Anything else must be in both lists.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NAMES_DIR = ROOT / "tests" / "data" / "trt_names"
BACKENDS = ROOT / "optimizer" / "accel_opt" / "backends"
SOURCES = [BACKENDS / "tensorrt" / "backend.py", BACKENDS / "tensorrt" / "build.py"]
MODULE_ALIASES = {"trt", "tensorrt"}  # `import tensorrt as trt`, `import tensorrt`, or a parameter named trt
PY_CLASSES = {"Builder": "IBuilder", "Runtime": "IRuntime", "OnnxParser": "IParser", "Logger": "ILogger",
              "ILogger": "ILogger", "EngineInspector": "IEngineInspector"}
# Calls whose result the checker follows: method or class -> the C++ class of what it returns.
FACTORIES = {"create_network": "INetworkDefinition", "create_builder_config": "IBuilderConfig",
             "create_optimization_profile": "IOptimizationProfile", "deserialize_cuda_engine": "ICudaEngine",
             "create_engine_inspector": "IEngineInspector", "create_timing_cache": "ITimingCache",
             "get_timing_cache": "ITimingCache", "create_execution_context": "IExecutionContext",
             "get_error": "IParserError", "get_input": "ITensor", "get_output": "ITensor",
             "build_serialized_network": "IHostMemory"}
PRECISION_FLAGS = ("FP16", "BF16", "INT8", "FP8", "INT4", "FP4")


@dataclass(frozen=True)
class BindingNames:
    wheel: str
    version: str
    sha256: str
    names: frozenset[str]

    @property
    def enums(self) -> frozenset[str]:
        return frozenset(n.split(".", 1)[0] for n in self.names if "." in n)

    def __contains__(self, name: str) -> bool:
        return name in self.names


def load_names(major: int) -> BindingNames:
    lines = (NAMES_DIR / f"tensorrt-{major}.txt").read_text().splitlines()
    header = re.match(r"# (\S+) (\S+) (\S+\.whl) sha256=([0-9a-f]{64})$", lines[0])
    assert header, f"tensorrt-{major}.txt: first line must name the wheel and its sha256, got {lines[0]!r}"
    names = frozenset(line for line in lines if line and not line.startswith("#"))
    return BindingNames(header.group(3), header.group(2), header.group(4), names)


LISTS = {major: load_names(major) for major in (10, 11)}
ENUMS = LISTS[10].enums | LISTS[11].enums


@dataclass(frozen=True)
class Use:
    name: str  # "Builder" (module), "BuilderFlag.TF32" (enum member), "IBuilderConfig::set_flag" (class member)
    line: int
    guarded: bool = False


def trt_uses(source: str) -> list[Use]:
    """Every TensorRT API name `source` uses, with the line and whether a getattr/hasattr guards it."""
    tree = ast.parse(source)
    roles: dict[str, str] = {}  # variable -> C++ class of the object it holds (one namespace: names are distinct)

    def resolve(node: ast.AST) -> tuple[str, str] | None:
        if isinstance(node, ast.Name):
            if node.id in MODULE_ALIASES:
                return ("module", "")
            return ("instance", roles[node.id]) if node.id in roles else None
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            if base and base[0] in ("module", "class") and node.attr in ENUMS:
                return ("enum", node.attr)
            if base and base[0] == "module" and node.attr in PY_CLASSES:
                return ("class", PY_CLASSES[node.attr])
            return None
        if isinstance(node, ast.Call):
            func = resolve(node.func)
            if func and func[0] == "class":
                return ("instance", func[1])
            if isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES and resolve(node.func.value):
                return ("instance", FACTORIES[node.func.attr])
        return None

    def use_of(base: tuple[str, str] | None, attr: str) -> str | None:
        if base is None:
            return None
        kind, owner = base
        if kind == "module":
            return attr
        if kind == "enum":
            return f"{owner}.{attr}"
        if attr in ENUMS:  # an enum nested in a class: trt.ILogger.Severity
            return attr
        return f"{owner}::{attr}"

    for _ in range(2):  # roles may be used before the line that assigns them is visited
        for node in ast.walk(tree):
            targets: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                targets = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.With):
                targets = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars is not None]
            for target, value in targets:
                found = resolve(value)
                if isinstance(target, ast.Name) and found and found[0] == "instance":
                    roles[target.id] = found[1]
    uses: list[Use] = []
    guarded_nodes: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1],
                                                       ast.Constant) and isinstance(node.args[1].value, str)):
            name = use_of(resolve(node.args[0]), node.args[1].value)
            guarded = node.func.id == "hasattr" or len(node.args) == 3
            if name:
                uses.append(Use(name, node.lineno, guarded))
                guarded_nodes.add(id(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Load, ast.Store)):
            name = use_of(resolve(node.value), node.attr)
            if name:
                uses.append(Use(name, node.lineno))
    return uses


def optional_names(source: str) -> dict[str, str]:
    """The module's OPTIONAL_TRT_NAMES literal ({} without one)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "OPTIONAL_TRT_NAMES"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def problems(source: str) -> list[str]:
    """One line per name the code uses that a TensorRT version lacks, unguarded or undeclared."""
    optional = optional_names(source)
    out = []
    for use in trt_uses(source):
        missing = [f"{major}.x ({names.version})" for major, names in LISTS.items() if use.name not in names]
        if use.guarded:
            if use.name not in optional:
                out.append(f"line {use.line}: {use.name} is guarded but not listed in OPTIONAL_TRT_NAMES")
            if len(missing) == len(LISTS):
                out.append(f"line {use.line}: {use.name} is in no TensorRT version's bindings")
        elif missing:
            out.append(f"line {use.line}: {use.name} is missing from TensorRT {', '.join(missing)}")
    return out


def test_lists_name_their_wheels():
    for major, names in LISTS.items():
        assert names.version.split(".")[0] == str(major) and names.wheel.startswith("tensorrt_cu12_bindings-")
        assert len(names.names) > 2000, f"tensorrt-{major}.txt looks truncated"


def test_lists_hold_what_the_release_notes_say():
    ten, eleven = LISTS[10], LISTS[11]
    for flag in PRECISION_FLAGS:  # TensorRT 11 removed the precision builder flags
        assert f"BuilderFlag.{flag}" in ten and f"BuilderFlag.{flag}" not in eleven
    assert "BuilderFlag.TF32" in ten and "BuilderFlag.TF32" in eleven
    strongly_typed, explicit_batch = ("NetworkDefinitionCreationFlag.STRONGLY_TYPED",
                                      "NetworkDefinitionCreationFlag.EXPLICIT_BATCH")
    assert strongly_typed in ten and strongly_typed in eleven
    assert explicit_batch in ten and explicit_batch not in eleven
    assert "IInt8EntropyCalibrator2" in ten and "IInt8EntropyCalibrator2" not in eleven  # implicit calibrators removed
    assert "IBuilder::platform_has_fast_fp16" in ten and "IBuilder::platform_has_fast_fp16" not in eleven
    # "FP16" survives in 11 only as other enums' members (DataType uses HALF), not as a builder flag:
    assert "DataType.HALF" in eleven and not any(n.endswith(".FP16") for n in eleven.names)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_backend_uses_only_names_both_versions_export(path):
    found = problems(path.read_text())
    assert not found, f"{path.name}:\n" + "\n".join(found)


def test_checker_sees_the_build():
    """The checker follows the objects of the build: if it stopped seeing them, the test above would pass vacuously."""
    names = {use.name for path in SOURCES for use in trt_uses(path.read_text())}
    for expected in ("Builder", "OnnxParser", "IBuilder::create_network", "IBuilderConfig::set_memory_pool_limit",
                     "MemoryPoolType.WORKSPACE", "IBuilderConfig::builder_optimization_level",
                     "IBuilderConfig::create_timing_cache", "IBuilderConfig::set_timing_cache",
                     "IOptimizationProfile::set_shape", "IParser::parse_from_file", "IParserError::desc",
                     "ICudaEngine::create_engine_inspector", "IEngineInspector::get_engine_information",
                     "LayerInformationFormat.JSON", "ProfilingVerbosity.DETAILED", "BuilderFlag.TF32",
                     "NetworkDefinitionCreationFlag.STRONGLY_TYPED", "Severity.ERROR", "ILogger::__init__"):
        assert expected in names, f"the checker no longer sees {expected}"


def test_checker_rejects_names_a_version_lacks():
    code = (
        "import tensorrt as trt\n"
        "builder = trt.Builder(logger)\n"
        "network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))\n"
        "config = builder.create_builder_config()\n"
        "config.set_flag(trt.BuilderFlag.FP16)\n"
        "fast = builder.platform_has_fast_fp16\n"
        "engine = trt.Runtime(logger).deserialize_cuda_engine(plan)\n"
        "count = engine.num_bindings\n"
        "bf16 = getattr(trt.BuilderFlag, 'BF16', None)\n"
    )
    found = "\n".join(problems(code))
    assert "NetworkDefinitionCreationFlag.EXPLICIT_BATCH is missing from TensorRT 11.x" in found
    assert "BuilderFlag.FP16 is missing from TensorRT 11.x" in found
    assert "IBuilder::platform_has_fast_fp16 is missing from TensorRT 11.x" in found
    assert "ICudaEngine::num_bindings is missing from TensorRT 10.x" in found  # removed in 10.0
    assert "BuilderFlag.BF16 is guarded but not listed in OPTIONAL_TRT_NAMES" in found
    assert "IBuilderConfig::set_flag" not in found  # exists in both


def test_optional_names_exist_somewhere():
    for path in SOURCES:
        for name in optional_names(path.read_text()):
            assert any(name in names for names in LISTS.values()), f"{path.name}: {name} is in no version"


def test_backend_sets_no_precision_flag():
    for path in SOURCES:
        used = {use.name for use in trt_uses(path.read_text())}
        assert not used & {f"BuilderFlag.{flag}" for flag in PRECISION_FLAGS}, path.name


def test_extractor_reads_pybind11_symbols():
    """The parsing scripts/trt_binding_names.py relies on, on symbol names as objdump -C prints them."""
    spec = importlib.util.spec_from_file_location("trt_binding_names", ROOT / "scripts" / "trt_binding_names.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script._binding("pybind11::enum_<nvinfer1::BuilderFlag>::value(char const*, nvinfer1::BuilderFlag, "
                           "char const*)") == ("enum", "BuilderFlag")
    assert script._binding("pybind11::class_<nvinfer1::IBuilder>& pybind11::class_<nvinfer1::IBuilder>::def<"
                           "nvinfer1::INetworkDefinition* (nvinfer1::IBuilder::*)(unsigned int) noexcept, "
                           "pybind11::arg_v, "
                           "char const*>(char const*, ...) [clone .constprop.0]") == ("class", "IBuilder")
    conditional = ("pybind11::class_<nvinfer1::IIfConditional, std::unique_ptr<nvinfer1::IIfConditional, "
                   "pybind11::nodelete> >& pybind11::class_<nvinfer1::IIfConditional, std::unique_ptr<"
                   "nvinfer1::IIfConditional, pybind11::nodelete> >::def<...>(char const*)")
    assert script._binding(conditional) == ("class", "IIfConditional")
    assert script._binding("pybind11::class_<nvinfer1::IBuilder>::dealloc(pybind11::detail::value_and_holder&)") is None
    assert script._owners_in("nvinfer1::ICudaEngine::getNbOptimizationProfiles() const") == {"ICudaEngine"}
    assert script._owners_in("pybind11::cpp_function::initialize<pybind11::cpp_function::initialize<long, "
                             "nvinfer1::INormalizationLayer>(long (nvinfer1::INormalizationLayer::*)() const)::{lambda("
                             "nvinfer1::INormalizationLayer const*)#1}, long>") == {"INormalizationLayer"}
    assert script._owners_in("pybind11::cpp_function::initialize<unsigned long (*&)(nvinfer1::IExecutionContext&, "
                             "char const*), unsigned long>") == {"IExecutionContext"}
