"""The floors ir -> passes -> backends -> top (fusec/: CLI, API, driver, tools), checked on the
import graph with import-linter (every import statement, those inside functions too).

The contracts are pyproject's `[tool.importlinter]`: a layers contract (nothing imports up a
floor; exhaustive, so a new module under fusec/ must be given a floor) and an acyclic-siblings
contract (no two modules or packages import each other, directly or round a circle, at any
depth). The package maps `fusec.ir`, `fusec.passes`, ... onto top-level folders (pyproject
`package-dir`), which import-linter cannot follow from an editable install, so the test lays the
same tree out with symbolic links and points the linter at it; it also checks that the linter
read every module file, so a tree it could not see cannot pass.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import importlinter  # noqa: F401  (declared in the test extra; run below in a process that sees the mirror)

ROOT = Path(__file__).resolve().parent.parent


def _mirror(tmp: Path) -> int:
    """`tmp/fusec/...` as the installed package looks (links into the repository); returns the
    number of module files in it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    top = tmp / "fusec"
    top.mkdir()
    for child in (ROOT / dirs["fusec"]).iterdir():
        if child.name != "__pycache__" and not (top / child.name).exists():
            (top / child.name).symlink_to(child)
    for pkg in sorted(cfg["packages"], key=lambda p: p.count(".")):
        if pkg == "fusec":
            continue
        where = tmp / pkg.replace(".", "/")
        src = ROOT / dirs.get(pkg, pkg.replace(".", "/"))
        if where.exists() or where.is_symlink():
            assert where.resolve() == src.resolve(), f"{pkg}: {where} is not {src}"
        else:
            where.symlink_to(src)
    return sum(f.endswith(".py") for d, _, files in os.walk(top, followlinks=True) if "__pycache__" not in d
               for f in files)


def test_floors_and_no_import_circles(tmp_path):
    n_files = _mirror(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())", "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    out = r.stdout + r.stderr
    analyzed = re.search(r"Analyzed (\d+) files", out)
    assert analyzed and int(analyzed[1]) == n_files, f"the linter did not read the whole package:\n{out}"
    assert r.returncode == 0 and "2 kept, 0 broken" in out, out
