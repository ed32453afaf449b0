"""The import-layering contracts (pyproject.toml, [tool.importlinter]) hold.

`make lint` runs the same `lint-imports`; this test makes a layering break show up in a
plain pytest run too (e.g. `import numpy` in core, `from sim import ...` in realexec).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10: pip's vendored copy of the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_import_contracts_are_kept():
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} missing: install the dev extra (make setup)"
    proc = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_every_stated_rule_has_a_contract():
    """The rules docs/design/architecture.md states, each encoded (and none dropped silently)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden = {tuple(c["source_modules"]): set(c["forbidden_modules"])
                 for c in config["contracts"] if c["type"] == "forbidden"}
    independent = [set(c["modules"]) for c in config["contracts"] if c["type"] == "independence"]
    third_party = {"torch", "numpy", "scipy", "simpy", "triton", "transformers"}
    assert third_party | {"sim", "realexec", "policies", "plots", "traces"} <= forbidden[("core",)]
    assert third_party | {"sim", "realexec", "plots", "traces"} <= forbidden[("policies",)]
    assert {"sim", "realexec"} in independent
    assert {"sim", "realexec", "plots"} <= forbidden[("traces",)]
    engine_rule = next(v for k, v in forbidden.items() if "sim.engine" in k)
    assert engine_rule == {"plots"}
