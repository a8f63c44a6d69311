"""The house rules a reader relies on: the layers import one way (import-linter's contracts in pyproject.toml), no
runtime import circle inside the package, and no module past ~400 lines unless its docstring says why it must be one."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "optimizer" / "accel_opt"  # the import package
MAX_LINES = 420  # "~400": past it a module is probably two
ONE_MODULE_REASON = "One module:"  # how a docstring says why a longer module stays whole


def _module_name(path: Path) -> str:
    parts = ["accel_opt", *path.relative_to(SOURCES).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCES.rglob("*.py")}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """Modules of the package that `path` imports when it runs: at module level and inside functions alike, but
    not under `if TYPE_CHECKING:` (annotations only)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(r for a in node.names if a.name.startswith("accel_opt") and (r := _resolve(a.name)))

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level or not (node.module or "").startswith("accel_opt"):
                return
            for alias in node.names:  # `from accel_opt.x import y` names module x.y when there is one
                target = f"{node.module}.{alias.name}"
                resolved = target if target in MODULES else _resolve(node.module)
                if resolved:
                    found.add(resolved)

    Visitor().visit(ast.parse(path.read_text()))
    found.discard(_module_name(path))
    return found


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_runtime_import_circle():
    edges = {name: _imports(path) & set(MODULES) for name, path in MODULES.items()}
    circles = _circles(edges)
    described = ["; ".join(f"{m} -> {sorted(edges[m] & set(c))}" for m in c) for c in circles]
    assert not circles, "import circles: " + " | ".join(described)


def test_the_circle_check_can_fail():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_long_modules_say_why_they_are_one():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
            if len(path.read_text().splitlines()) > MAX_LINES}
    unexplained = [f"{name} ({lines} lines)" for name, lines in sorted(long.items())
                   if ONE_MODULE_REASON not in (ast.get_docstring(ast.parse(MODULES[name].read_text())) or "")]
    assert not unexplained, f"over {MAX_LINES} lines without '{ONE_MODULE_REASON}' in the docstring: {unexplained}"


def test_no_submodule_shadows_a_name_its_package_exports():
    """`from accel_opt.accuracy import compare` must stay the function: a submodule of the same name, once imported
    anywhere, replaces the package's attribute with itself (it did: a module accuracy/compare.py, since gone, hid
    accuracy.compare())."""
    clashes = []
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        # A name bound from another module than the same-named submodule: once that submodule is imported
        # (after the package), it takes the name. (`from .judge import judge` loads it first: the function stays.)
        exported = {n for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                    for a in node.names for n in [a.asname or a.name]
                    if node.module not in (f"{name}.{n}", name.rpartition(".")[0] or None) and node.module != name}
        clashes += [f"{name}.{child.stem}" for child in path.parent.glob("*.py") if child.stem in exported]
    assert not clashes, f"submodules named like a name their package exports: {clashes}"


ROOT = SOURCES.parents[1]
TESTS = Path(__file__).resolve().parent


def misplaced_test_folders(tests: Path, sources: Path) -> list[str]:
    """Folders of `tests` holding test modules that mirror no package of `sources` (tests/backends/torch/ for
    accel_opt/backends/torch/, ...): the tests of a module are found where the module is."""
    return sorted(str(folder.relative_to(tests)) for folder in {p.parent for p in tests.rglob("test_*.py")}
                  if folder != tests and not (sources / folder.relative_to(tests) / "__init__.py").is_file())


def test_tests_mirror_the_package():
    assert not misplaced_test_folders(TESTS, SOURCES)


def test_the_mirror_check_can_fail(tmp_path):
    (tmp_path / "src" / "backends" / "torch").mkdir(parents=True)
    (tmp_path / "src" / "backends" / "torch" / "__init__.py").write_text("")
    for folder in ("backends/torch", "backends/tflite", "torch"):
        (tmp_path / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / folder / "test_x.py").write_text("")
    assert misplaced_test_folders(tmp_path / "tests", tmp_path / "src") == ["backends/tflite", "torch"]


def _lint_imports(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=300)


def test_the_layers_contract_holds():
    """pyproject.toml's import-linter contracts: one direction of imports (cli, builder, ..., recipe, files, errors),
    and the local and Ray engines independent of each other."""
    done = _lint_imports(ROOT)
    assert done.returncode == 0 and "2 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_the_layers_contract_fails_when_a_lower_layer_imports_a_higher_one(tmp_path):
    """The same contracts on a copy of the package where the recipe (near the bottom) imports the command line (the
    top), inside a function: broken, naming the import."""
    shutil.copytree(SOURCES, tmp_path / "accel_opt", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "accel_opt" / "recipe" / "types.py", "a") as module:
        module.write("\n\ndef _upwards():\n    import accel_opt.cli  # noqa: F401\n")
    config = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(config[config.index("[tool.importlinter]"):config.index("[tool.ruff]")])
    done = _lint_imports(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode != 0 and "One direction of imports BROKEN" in done.stdout, done.stdout[-2000:]
    assert "accel_opt.recipe.types -> accel_opt.cli" in done.stdout


# --- who reads the host's CPU --------------------------------------------------------------------------------------
# The host's CPU is read into one CpuProfile (machine.cpu) at the edge: the CLI and the public API entry points. Every
# decision below takes the profile as an input, so tests make it under every class (tests/builder/test_cpu_profiles.py).
HOST_READERS = {"cpu_flags", "cpu_info", "CPUINFO"}  # names that read this machine's CPU (CpuProfile.here too)
HOST_READING_MODULES = {  # package modules that may read the host, each with why
    "accel_opt.machine.cpu": "defines the readers",
    "accel_opt.cli": "the command line: every command builds this machine's profile once",
    "accel_opt.builder.pipeline": "build(), the public API: its default profile is this machine's",
    "accel_opt.builder.auto": "build_auto(), the API of --precision auto: its default profile is this machine's",
    "accel_opt.builder.doctor": "doctor describes this machine",
    "accel_opt.runtime": "runtime.load() and check(), the API that runs a folder here: their default profile",
    "accel_opt.backends.openvino.backend": "OpenVinoBackend() used directly: its default profile is this machine's",
}
HOST_READING_TESTS = {  # test modules that read the host, each with why (none may decide what to assert from it)
    "tests/machine/test_cpu_class.py": "checks the host detection itself (CpuProfile.here and its oneDNN cap)",
    "tests/test_structure.py": "spells out the readers it looks for",
}


def _host_reads(path: Path) -> list[str]:
    """Where `path` reads the host's CPU: a reader named or imported (under any alias), `.here` of CpuProfile however
    it is reached (a module alias, the qualified name, a class alias), or cpuinfo in any string (pieces joined too)."""
    tree = ast.parse(path.read_text())
    profile_names = {"CpuProfile"}  # the class, and every name bound to it (twice: an alias of an alias)
    for node in [*ast.walk(tree), *ast.walk(tree)]:
        if isinstance(node, ast.alias) and node.name.rpartition(".")[2] == "CpuProfile" and node.asname:
            profile_names.add(node.asname)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)) and \
                ast.unparse(node.value).rpartition(".")[2] in profile_names:
            profile_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in HOST_READERS:
            found.append(f"{node.id} (line {node.lineno})")
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] in HOST_READERS:
            found.append(f"import {node.name}")
        elif isinstance(node, ast.Attribute) and (node.attr in HOST_READERS or (
                node.attr == "here" and ast.unparse(node.value).rpartition(".")[2] in profile_names)):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "cpuinfo" in node.value:
            found.append(f"{node.value!r} (line {node.lineno})")
    return found


def _allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in HOST_READING_MODULES)


def test_only_the_edge_reads_the_host_cpu():
    """Below the CLI and the public API, every class-dependent decision takes a CpuProfile: no module reads the
    host's flags itself."""
    offenders = {name: reads for name, path in MODULES.items() if not _allowed(name) and (reads := _host_reads(path))}
    assert not offenders, f"modules below the edge that read the host's CPU (take a CpuProfile instead): {offenders}"


def test_no_test_decides_what_to_assert_from_the_host_cpu_class():
    """A test asserts what holds on every CPU class; where behaviour depends on the class, it injects a CpuProfile
    and runs under each. Reading the host's class in a test module is the way to write one that passes only where
    it was written (twice it did: test_auto on an AVX-512 VNNI host)."""
    tests = ROOT / "tests"
    offenders = {str(p.relative_to(ROOT)): reads for p in sorted(tests.rglob("*.py"))
                 if str(p.relative_to(ROOT)) not in HOST_READING_TESTS and (reads := _host_reads(p))}
    assert not offenders, f"test modules that read the host's CPU (inject CpuProfile.of_class instead): {offenders}"


def test_the_host_read_check_can_fail(tmp_path):
    sneaky = tmp_path / "test_sneaky.py"
    sneaky.write_text("from accel_opt.machine.cpu import CpuProfile, cpu_flags\n\n\ndef test_x():\n"
                      "    if 'amx_int8' in cpu_flags() or CpuProfile.here().native_bf16:\n        assert True\n"
                      "    open('/proc/cpuinfo')\n")
    reads = _host_reads(sneaky)
    assert reads[0] == "import cpu_flags" and len(reads) == 4, reads
    aliased = tmp_path / "test_aliased.py"  # what passed before (issue 75): aliases, a qualified call, joined pieces
    aliased.write_text("import accel_opt.machine.cpu as c\nimport accel_opt\nfrom accel_opt.machine.cpu import "
                       "CpuProfile as P\nQ = P\n\n\ndef test_x():\n    c.CpuProfile.here()\n"
                       "    accel_opt.machine.cpu.CpuProfile.here()\n    P.here()\n    Q.here()\n"
                       "    open('/proc/' + 'cpuinfo')\n")
    assert len(_host_reads(aliased)) == 5, _host_reads(aliased)
    assert not _host_reads(ROOT / "tests" / "builder" / "test_cpu_profiles.py")  # CpuProfile.of_class injects


# ---- one verdict (issue 73): only report/verdict.py decides whether a folder is signed off -------------------------

VERDICT_MODULE = SOURCES / "report" / "verdict.py"


def _verdict_decisions(source: str) -> list[str]:
    """Places in `source` that decide a verdict instead of reading one: a Verdict built, a `signed_off` set to anything
    but another `.signed_off`, an exit code compared with the verdict's own codes (6, 7)."""
    import ast

    def reads_one(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "signed_off"

    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Verdict":
            found.append(f"{where}: builds a Verdict")
        if isinstance(node, ast.Call):
            found += [f"{where}: signed_off=..." for k in node.keywords if k.arg == "signed_off"
                      and not reads_one(k.value)]
        if isinstance(node, ast.Assign) and any(reads_one(t) for t in node.targets) and not reads_one(node.value):
            found.append(f"{where}: sets .signed_off")
        if isinstance(node, ast.Compare) and "exit_code" in ast.unparse(node.left) and any(
                isinstance(c, ast.Constant) and c.value in (6, 7) for c in node.comparators):
            found.append(f"{where}: compares an exit code with a verdict's")
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))


def test_no_module_but_the_verdicts_own_decides_signed_off():
    decisions = {_module_name(path): lines for path in sorted(SOURCES.rglob("*.py")) if path != VERDICT_MODULE
                 for lines in [_verdict_decisions(path.read_text())] if lines}
    assert not decisions, decisions


def test_the_verdict_decision_check_can_fail():
    forged = ("r = BuildResult(signed_off=not failures)\nc.signed_off = passed\nv = Verdict(outcome='signed off')\n"
              "if manifest.exit_code == 6: pass\nc.signed_off = result.signed_off\n")
    assert [line.split(":")[0] for line in _verdict_decisions(forged)] == ["line 1", "line 2", "line 3", "line 4"]
