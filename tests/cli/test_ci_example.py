"""The CI example calls accel-opt only with subcommands and options that exist."""

import re
from pathlib import Path

import yaml

from accel_opt.cli import main

WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "ci" / "accel-opt.yml"


def test_workflow_uses_real_commands_and_options():
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    scripts = [step["run"] for job in jobs.values() for step in job["steps"] if "run" in step]
    calls = re.findall(r"accel-opt (\w+)((?:[^\n]|\\\n)*)", "\n".join(scripts))
    targets = jobs["build"]["strategy"]["matrix"]["target"]
    calls += [("build", target["args"]) for target in targets]  # the matrix's own build flags
    assert {name for name, _ in calls} >= {"build", "verify", "compare", "doctor", "sign"}
    for name, args in calls:
        command = main.commands[name]
        known = {opt for param in command.params for opt in getattr(param, "opts", [])}
        used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", args))
        assert used <= known, f"accel-opt {name}: unknown options {sorted(used - known)}"
