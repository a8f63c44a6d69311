"""Extract the Python names TensorRT's bindings export, without importing them (no GPU, no libnvinfer).

    python scripts/trt_binding_names.py                 # download the newest 10.x and 11.x wheels
    python scripts/trt_binding_names.py WHEEL [WHEEL]   # or read wheels already downloaded

Writes tests/data/trt_names/tensorrt-<major>.txt, which tests/backends/tensorrt/test_trt_conformance.py
checks optimizer/accel_opt/backends/tensorrt/ (backend.py, build.py, plan.py) against. `tensorrt_bindings/tensorrt.so`
is a pybind11 module; it cannot be imported here, but its machine code names every binding it registers. The names are
read from the disassembly (objdump, from binutils), not from `strings`: the linker merges a string into the tail of a
longer one ("INT8" lives inside "UINT8", "serialize" inside "deserialize"), so a whole-string list misses names that
exist, and a name present as a string says nothing of which enum or class holds it. Three kinds of line, all sorted
together:

    create_network              every identifier the code loads the address of (a flat set)
    BuilderFlag.STRONGLY_TYPED  an enum member: the name passed to pybind11::enum_<BuilderFlag>::value
    IBuilder::create_network    a member of a bound C++ class (def, def_property*, def_readwrite/readonly)

Enum members are exact (one `enum_<T>::value(name, ...)` call each). A class member is a name in
%rsi (the `name` argument, followed through register moves) at a call to `class_<T>::def*`, or at a
call to the pybind11 internals a fully inlined def ends in (add_class_method,
def_property_static_impl), or a name inside a `class_<T>::def*` specialization the compiler cloned
with its name folded in. T is taken from the call's symbol and from the bound function's `self`
(a member function loaded by address, a dispatcher's lambda parameter). The linker folds identical
functions into one symbol named after one class, so a name can be credited to a class that lacks
it. Cross-checked against NVIDIA's binding sources (release/10.16 for 10.16.1.11, release/11.1 for
11.4.0.106): every member of BuilderFlag, NetworkDefinitionCreationFlag, MemoryPoolType,
LayerInformationFormat, ProfilingVerbosity and HardwareCompatibilityLevel matched exactly; of the
members of IBuilder, IBuilderConfig, ICudaEngine, IEngineInspector, IParser, IRuntime, ITimingCache,
IOptimizationProfile, IExecutionContext and INetworkDefinition, one was missed
(INetworkDefinition.serialize) and extra names were credited to IParser, IRuntime, IBuilderConfig and IExecutionContext.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "tensorrt-cu12-bindings"
SO_PATH = "tensorrt_bindings/tensorrt.so"
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "trt_names"
PLATFORM = ("--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")
IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
FUNCTION = re.compile(r"^([0-9a-f]+) <(.*)>:$")
LEA = re.compile(r"^\s*([0-9a-f]+):\s+lea\s+-?0x[0-9a-f]+\(%rip\),%(\w+)\s+#\s+([0-9a-f]+) <(.*)>$")
CALL = re.compile(r"^\s*[0-9a-f]+:\s+call\s+[0-9a-f]+\s+<(.*)>$")
MEMBER_METHODS = ("def", "def_static", "def_property", "def_property_readonly", "def_property_static",
                  "def_property_readonly_static", "def_readwrite", "def_readonly")
MOVE = re.compile(r"^\s*[0-9a-f]+:\s+mov\s+%(\w+),%(\w+)\s*$")
WRITES = re.compile(r",%(\w+)\s*$")  # the destination register of any other instruction
CALLEE_SAVED = {"rbx", "rbp", "r12", "r13", "r14", "r15"}  # survive a call (System V x86-64 ABI)
# pybind11 internals a fully inlined `class_<T>::def*` ends in; T is then the class in scope.
# instructions after a `lea ..., %rsi` within which its call must come
INLINED_DEFS = ("pybind11::detail::add_class_method(", "pybind11::detail::generic_type::def_property_static_impl(")


def newest_versions() -> dict[int, str]:
    """{major: newest version} of the bindings on the package index, for majors 10 and 11."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", PACKAGE], capture_output=True,
                          text=True, check=True)
    line = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith("Available versions:"))
    versions = [v.strip() for v in line.split(":", 1)[1].split(",")]
    newest: dict[int, str] = {}
    for version in versions:  # pip lists newest first
        major = int(version.split(".")[0])
        if major in (10, 11) and major not in newest:
            newest[major] = version
    return newest


def download(version: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"{PACKAGE}=={version}", "--no-deps", "-d", str(dest),
                    *PLATFORM], check=True, capture_output=True)
    return next(dest.glob(f"tensorrt_cu12_bindings-{version}-*.whl"))


def _sections(elf: bytes) -> list[tuple[str, int, int, int]]:
    """(name, address, file offset, size) of every ELF64 section."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    out = []
    for name, _type, _flags, addr, offset, size in headers:
        end = elf.index(b"\0", names_offset + name)
        out.append((elf[names_offset + name:end].decode(), addr, offset, size))
    return out


def _string_at(elf: bytes, sections, address: int) -> bytes | None:
    for name, addr, offset, size in sections:
        if name.startswith(".rodata") and addr <= address < addr + size:
            start = offset + address - addr
            return elf[start:elf.index(b"\0", start)]
    return None


def _template_arg(text: str, head: str) -> str | None:
    """The first template argument after `head<` in a demangled name, namespaces dropped."""
    at = text.find(head + "<")
    if at < 0:
        return None
    depth, start = 0, at + len(head) + 1
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            if depth == 0:
                return text[start:i].split("::")[-1].strip()
            depth -= 1
        elif ch == "," and depth == 0:
            return text[start:i].split("::")[-1].strip()
    return None


SELF_TYPE = re.compile(r"(?:\(|, )(?:[\w:]+::)?(\w+)::\*|\{lambda\((?:[\w:]+::)?(\w+)(?: const)?[&*]"
                       r"|\(\*&?\)\((?:[\w:]+::)?(\w+)(?: const)?[&*]")
MEMBER_FUNCTION = re.compile(r"^(?:nvinfer1|nvonnxparser)::(?:v_\d+_\d+::)?(\w+)::~?\w+\(")


def _owners_in(symbol: str) -> set[str]:
    """Classes `symbol` names as the `self` of a binding: a member function loaded by address
    (`nvinfer1::IBuilder::createNetworkV2(...)`), or a pybind11 dispatcher (`cpp_function::initialize<...>`)
    of a member pointer `R (T::*)(...)` or of a lambda / function pointer whose first parameter is T."""
    member = MEMBER_FUNCTION.match(symbol)
    if member:
        return {member.group(1)}
    if symbol.startswith("pybind11::cpp_function::initialize<"):
        match = SELF_TYPE.search(symbol)
        if match:
            return {next(g for g in match.groups() if g)}
    return set()


def _binding(target: str) -> tuple[str, str] | None:
    """('enum'|'class', C++ type) when `target` (a demangled function) registers a name on a type."""
    if target.startswith("pybind11::enum_<") and "::value(char const*" in target:
        return "enum", _template_arg(target, "pybind11::enum_")
    match = re.match(r"pybind11::class_<.*?>& pybind11::class_<", target)
    if match:
        cls = _template_arg(target, "pybind11::class_")
        rest = target[match.end():]
        method = re.search(r">::(\w+)<|>::(\w+)\(", rest)
        name = method and (method.group(1) or method.group(2))
        if cls and name in MEMBER_METHODS:
            return "class", cls
    return None


def extract(so_bytes: bytes, so_path: Path) -> set[str]:
    """Every name line (see the module docstring) for the module at `so_path` (its bytes: `so_bytes`)."""
    if shutil.which("objdump") is None:
        raise SystemExit("objdump not found: install binutils")
    sections = _sections(so_bytes)
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(so_path)], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    names: set[str] = set()
    clone_of = None  # the class of a def specialization with its name folded in, while inside one
    evidence: set[str] = set()  # classes the code since the last def names as `self` (see _owners_in)
    owners: set[str] = set()  # the classes the last def registered on
    registers: dict[str, str] = {}  # register -> the identifier whose address it holds (straight-line tracking)
    for line in listing:
        header = FUNCTION.match(line)
        if header:
            bound = _binding(header.group(2))
            clone_of = bound[1] if bound and bound[0] == "class" else None
            evidence, owners, registers = set(), set(), {}
            continue
        lea, call, move = LEA.match(line), CALL.match(line), MOVE.match(line)
        if lea or call:
            evidence |= _owners_in((lea.group(4) if lea else call.group(1)).split("+0x")[0])
        if lea:
            text = _string_at(so_bytes, sections, int(lea.group(3), 16))
            name = text.decode() if text is not None and IDENTIFIER.fullmatch(text) else None
            registers.pop(lea.group(2), None)
            if name:
                names.add(name)
                registers[lea.group(2)] = name
                if clone_of:
                    names.add(f"{clone_of}::{name}")
        elif call:
            name = registers.get("rsi")  # the `name` argument of enum_<T>::value and class_<T>::def*
            bound = _binding(call.group(1))
            if bound and bound[0] == "enum":
                if name:
                    names.add(f"{bound[1]}.{name}")
            elif bound or call.group(1).startswith(INLINED_DEFS):
                owners = evidence | ({bound[1]} if bound else set()) or owners
                names.update(f"{owner}::{name}" for owner in owners if name)
                evidence = set()
            registers = {r: v for r, v in registers.items() if r in CALLEE_SAVED}
        elif move and move.group(1) in registers:
            registers[move.group(2)] = registers[move.group(1)]
        else:
            written = WRITES.search(line)
            if written:
                registers.pop(written.group(1), None)
    return names


def write_list(wheel: Path, out_dir: Path) -> Path:
    version = wheel.name.split("-")[1]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        so_path = Path(archive.extract(SO_PATH, tmp))
        names = extract(so_path.read_bytes(), so_path)
    out = out_dir / f"tensorrt-{version.split('.')[0]}.txt"
    header = (f"# {PACKAGE} {version} {wheel.name} sha256={digest}\n"
              f"# {SO_PATH}: {len(names)} names, extracted by scripts/trt_binding_names.py; do not edit\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "".join(f"{n}\n" for n in sorted(names)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="*", type=Path,
                        help="bindings wheels (default: download the newest 10.x, 11.x)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or [download(v, Path(tmp)) for v in newest_versions().values()]
        for wheel in wheels:
            print(write_list(wheel, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
