"""JUnit XML of a build's checks: what CI systems read (the testsuites/testsuite/testcase/failure subset)."""

from __future__ import annotations

from xml.etree import ElementTree as ET

from accel_opt.accuracy import Check
from accel_opt.accuracy.evidence import METHOD, RateEvidence


def junit_xml(suites: list[tuple[str, list[Check], str | None]]) -> str:
    """JUnit XML (the testsuites/testsuite/testcase/failure subset CI systems read): one suite per
    (name, checks, error), one test case per check, the failure carrying the check's one-line reason; a
    suite whose build could not run holds one errored case with that `error`."""
    root = ET.Element("testsuites", name="accel-opt")
    for name, checks, error in suites:
        failures = sum(c.gated and not c.passed for c in checks)
        suite = ET.SubElement(root, "testsuite", name=name, tests=str(len(checks) or 1), failures=str(failures),
                              errors=str(int(error is not None)), skipped="0")
        if error is not None:
            case = ET.SubElement(suite, "testcase", classname=name, name="build")
            ET.SubElement(case, "error", message=error, type="BuildError").text = error
        for check in checks:
            case = ET.SubElement(suite, "testcase", classname=name, name=check.name)
            if check.evidence is not None:  # a rate: its counts, bound and method, for CI to read without parsing
                _junit_rate_properties(ET.SubElement(case, "properties"), check.evidence)
            if check.passed or not check.gated:  # reported, not gated (accuracy.labels.gate: labels): no failure
                ET.SubElement(case, "system-out").text = check.line if check.passed else f"not gated: {check.line}"
            else:  # too few held-out samples, or failed
                kind = "InsufficientEvidence" if check.insufficient else "GateFailed"
                ET.SubElement(case, "failure", message=check.line, type=kind).text = check.line
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _junit_rate_properties(properties, evidence: RateEvidence) -> None:
    values = {"rate": f"{evidence.rate:.6g}", "lower_bound": f"{evidence.lower:.6g}",
              "minimum": f"{evidence.minimum:g}",
              "failures": evidence.failures, "trials": evidence.trials, "unit": evidence.unit,
              **{key: getattr(evidence, key) for key in ("rows", "rows_failed", "row_unit")
                 if evidence.rows is not None},
              "confidence": f"{evidence.confidence:g}", "method": METHOD if evidence.bounded else "observed rate",
              "status": evidence.status}
    for key, value in values.items():
        ET.SubElement(properties, "property", name=key, value=str(value))
