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


def test_readme_is_short_and_its_links_resolve():
    """The README stays a front page (<= 250 lines; the rest lives in docs/), and every
    relative link in it names a file in the repository."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md over 250 lines: move the detail into docs/"
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert links, "the README links its docs pages"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, missing
    assert "source .venv/bin/activate" in text


def test_ci_runs_the_gates_the_readme_names():
    """.ci/run calls `make ci`, whose prerequisites are the lint, docs and test targets the README promises."""
    import re

    assert "make ci" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    ci = re.search(r"^ci:(.*)$", makefile, re.M)
    assert ci and ci.group(1).split() == ["lint", "docs", "test"]
    assert "make ci" in (ROOT / "README.md").read_text() and "make lint docs test" in (ROOT / "README.md").read_text()


MAX_MODULES_PER_PACKAGE = 15
SOURCE_PACKAGES = ["core", "policies", "sim", "realexec", "traces", "plots"]


def package_sizes() -> dict[str, int]:
    """Modules (.py files other than __init__/__main__) directly inside each source package."""
    sizes = {}
    for top in SOURCE_PACKAGES:
        for init in (ROOT / top).rglob("__init__.py"):
            pkg = init.parent
            sizes[str(pkg.relative_to(ROOT))] = sum(
                1 for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__"))
    return sizes


def test_packages_are_cut_by_role_with_at_most_15_modules_each():
    sizes = package_sizes()
    assert {"core/sched", "core/kv", "core/cost", "sim/twin", "realexec/executor", "realexec/worker"} <= set(sizes)
    too_big = {pkg: n for pkg, n in sizes.items() if n > MAX_MODULES_PER_PACKAGE}
    assert not too_big, f"split these packages by role (more than {MAX_MODULES_PER_PACKAGE} modules): {too_big}"


def test_tests_mirror_the_source_tree():
    """Every test folder names a source package (tests/sim/twin <-> sim/twin), so a module's tests are found by path."""
    for init in (ROOT / "tests").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "tests")
        if rel.parts and rel.parts[0] in SOURCE_PACKAGES:
            assert (ROOT / rel / "__init__.py").exists(), f"tests/{rel} has no source package {rel}"
