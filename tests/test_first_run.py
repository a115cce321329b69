"""What a new user meets first: every imported package declared, a clear word when the CuTe extra
is missing, `--version`, `python -m fusec`, help on every flag, the configs of a model, the batch
the summary is for, no folder left by a failed compile, `fusec verify` on an output folder."""
import argparse
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fusec
from fusec.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ["fusec", "ir", "passes", "backends", "models"]       # what pyproject.toml installs
LOCAL = {*PACKAGED, "tests"}
# import name -> distribution name, for every third-party module the code may import; a new
# import fails test_every_import_is_declared until it is added here and to pyproject.toml
DIST = {"torch": "torch", "numpy": "numpy", "lark": "lark", "jinja2": "jinja2", "safetensors": "safetensors", "tqdm": "tqdm",
        "pytest": "pytest", "syrupy": "syrupy", "cutlass": "nvidia-cutlass-dsl", "cuda": "cuda-bindings",
        "matplotlib": "matplotlib", "playwright": "playwright", "importlinter": "import-linter"}
CUTE_ONLY = {"cutlass", "cuda"}
# Runtime modules that only a test runner loads (the pytest plugin): their imports come from the test extra.
TEST_RUNNER_ONLY = {"fusec/testing/pytest_plugin.py"}


def _imports(path: Path) -> set[str]:
    """Top-level modules one file imports (every import statement, inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _files(folders) -> list[Path]:
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


def _test_files() -> list[Path]:
    """tests/ and the benchmark scripts that tests import by name (they put benchmarks/ on sys.path)."""
    files, bench = _files(["tests"]), {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    todo = list(files)
    while todo:
        for name in _imports(todo.pop()) & set(bench):
            if bench[name] not in files:
                files.append(bench[name])
                todo.append(bench[name])
    return files


def _third_party_imports(files) -> dict[str, set[str]]:
    """Top-level module -> files importing it, leaving out the standard library and our own."""
    local = set(LOCAL) | {p.stem for p in _files(["tests", "benchmarks"])}
    local |= {p.parent.name for p in (ROOT / "tests").rglob("__init__.py")}      # test helper packages
    found: dict[str, set[str]] = {}
    for path in files:
        for top in _imports(path):
            if top not in sys.stdlib_module_names and top not in local:
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _names(reqs) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in reqs}


def test_every_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    runtime = _third_party_imports([p for p in _files(PACKAGED) if str(p.relative_to(ROOT)) not in TEST_RUNNER_ONLY])
    tests = _third_party_imports(_test_files() + [ROOT / p for p in TEST_RUNNER_ONLY])
    unknown = (set(runtime) | set(tests)) - set(DIST)
    assert not unknown, f"imports not mapped to a distribution (declare them): {unknown}"
    for mod, files in runtime.items():
        if mod in CUTE_ONLY:
            assert DIST[mod] in extras["cute"] and DIST[mod] not in deps, (mod, files)
        else:
            assert DIST[mod] in deps, f"{mod} imported by {sorted(files)} but not in [project].dependencies"
    for mod, files in tests.items():
        assert DIST[mod] in deps | extras["test"] | (extras["cute"] if mod in CUTE_ONLY else set()), (mod, files)
    # and nothing declared that no code imports (a dependency list that drifts the other way)
    assert deps <= {DIST[m] for m in runtime}, deps - {DIST[m] for m in runtime}
    assert "numpy" in deps


@pytest.mark.parametrize("missing", ["cutlass", "cuda.bindings.driver"])
@pytest.mark.parametrize("argv", [
    ["compile", "models/llama.py", "--config", "tiny", "--emit", "cute"],
    ["run", "models/llama.py", "--config", "tiny", "--backend", "cute"],
])
def test_cute_without_the_extra_says_what_to_install(argv, missing, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, missing, None)          # `import <missing>` now fails
    out = tmp_path / "o"
    assert main([*argv, *(["-o", str(out)] if argv[0] == "compile" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusec: error: the CuTe backend needs the cute extra") and err.count("\n") == 1
    assert "pip install 'fusec[cute]'" in err
    assert not out.exists()


def test_cute_without_the_extra_through_the_api(monkeypatch):
    from fusec.extras import MissingExtraError
    monkeypatch.setitem(sys.modules, "cutlass", None)
    with pytest.raises(MissingExtraError, match=r"fusec\[cute\]"):
        fusec.compile("models/llama.py", "tiny", backend="cute")


def test_cute_without_the_extra_in_a_fresh_interpreter(tmp_path):
    # a finder that refuses the CuTe DSL, as on a plain `pip install -e .`
    code = ("import sys, importlib.abc\n"
            "class NoCute(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('cutlass', 'cuda'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, NoCute())\n"
            "from fusec.cli import main\n"
            f"sys.exit(main(['compile', 'models/llama.py', '--config', 'tiny', '--emit', 'cute', "
            f"'-o', {str(tmp_path / 'o')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("fusec: error: the CuTe backend needs the cute extra")
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr


def test_version(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fusec {version('fusec')}"


def test_version_without_installed_metadata(monkeypatch):
    import importlib.metadata as md
    from fusec import cli

    def not_installed(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "version", not_installed)
    assert cli.version() == fusec.__version__


def test_python_dash_m_fusec():
    p = subprocess.run([sys.executable, "-m", "fusec", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("fusec ")
    p = subprocess.run([sys.executable, "-m", "fusec", "compile", "nope.py"], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 2 and p.stderr == "fusec: error: nope.py: no such model file\n"


def _subparsers(ap):
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))


def test_every_flag_and_command_has_help():
    ap = build_parser()
    sub = _subparsers(ap)
    missing = [f"fusec {a.option_strings or a.dest}" for a in ap._actions if not a.help]
    missing += [f"fusec {c.dest}" for c in sub._choices_actions if not c.help]
    for name, p in sub.choices.items():
        missing += [f"fusec {name} {'/'.join(a.option_strings) or a.dest}" for a in p._actions
                    if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, missing
    assert set(sub.choices) >= {"compile", "run", "verify", "simulate", "configs", "ops"}


def test_configs_lists_the_model_configs(capsys):
    from fusec.models import kimi_k3, llama
    for mod, path in ((kimi_k3, "models/kimi_k3.py"), (llama, "models/llama.py")):
        assert main(["configs", path]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [l.split(":")[0].split(" ")[0] for l in lines] == list(mod.CONFIGS)
        assert f"{mod.DEFAULT_CONFIG} (default)" in lines
    assert main(["configs", "kimi_k3"]) == 0
    slice4 = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("slice4:"))
    assert slice4 == "slice4: layers=4 mla_layers=(3,)"      # the fields unlike the default config


@pytest.mark.parametrize("model,msg", [("out.fir", "has no configs"), ("nope.py", "no such model file")])
def test_configs_of_what_has_none(model, msg, capsys):
    assert main(["configs", model]) == 2
    assert msg in capsys.readouterr().err


def test_configs_of_a_model_without_named_configs(tmp_path, capsys):
    f = tmp_path / "plain_model.py"
    f.write_text("def build_graph(config=None):\n    raise ValueError('unused')\n")
    assert main(["configs", str(f)]) == 2
    assert "declares no named configs" in capsys.readouterr().err


def _summary(capsys) -> list[str]:
    return [l for l in capsys.readouterr().out.splitlines() if not l.startswith(("wrote ", "done in "))]


def test_summary_states_the_batch_it_was_computed_for(tmp_path, capsys):
    base = ["compile", "models/kimi_k3.py", "--config", "tiny", "--max-len", "64"]
    assert main([*base, "--emit", "fir", "-o", str(tmp_path / "b1")]) == 0
    b1 = next(l for l in _summary(capsys) if l.startswith("bytes read per decode step"))
    assert main([*base, "--batch", "4", "-o", str(tmp_path / "b4")]) == 0
    lines = _summary(capsys)
    b4 = next(l for l in lines if l.startswith("bytes read per decode step"))
    assert b1.startswith("bytes read per decode step (batch 1, context 64): ")
    assert b4.startswith("bytes read per decode step (batch 4, context 64): ")
    # four sequences route to more experts: the figure is computed at batch 4, not only labelled so
    assert b4.split(": ")[1] != b1.split(": ")[1]
    assert " at batch 4 " in next(l for l in lines if l.startswith("schedule: "))
    assert b4 in (tmp_path / "b4" / "summary.txt").read_text().splitlines()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_failed_compile_leaves_no_folder(tmp_path, capsys):
    # the pipeline fails after the .fir and summary.txt were written: none of it may remain
    out = tmp_path / "new" / "nested" / "out"
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--passes", "nosuch", "-o", str(out)]) == 2
    assert "unknown pass 'nosuch'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                     # no out, no parents, no staging folder


def test_failed_compile_keeps_the_users_folder_as_it_was(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--emit", "fir", "-o", str(out)]) == 0
    (out / "notes.txt").write_text("mine\n")
    before = _tree(out)
    assert main(["compile", "models/llama.py", "--config", "tiny", "--passes", "nosuch", "-o", str(out)]) == 2
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_compile_into_an_existing_folder_keeps_other_files(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "summary.txt").write_text("stale\n")
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--emit", "fir", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'summary.txt'}" in printed.splitlines()      # the final path, not the staging one
    assert (out / "notes.txt").read_text() == "mine\n"
    assert (out / "summary.txt").read_text().startswith("graph kimi_k3_tiny:")
    assert sorted(p.name for p in out.iterdir()) == ["kimi_k3_tiny.fir", "notes.txt", "summary.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_compile_onto_a_file_is_an_error(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--emit", "fir", "-o", str(f)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert f.read_text() == "x"


def test_verify_accepts_an_output_folder(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", "models/llama.py", "--config", "tiny", "--max-len", "64", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    by_folder = capsys.readouterr().out
    assert main(["verify", str(out / "schedule.fsched.gz")]) == 0
    assert by_folder == capsys.readouterr().out
    assert by_folder.startswith("memory-order verifier (rules V1-V7): OK")


def test_verify_names_what_it_looked_for(tmp_path, capsys):
    fir_only = tmp_path / "fir_only"
    assert main(["compile", "models/llama.py", "--config", "tiny", "--emit", "fir", "-o", str(fir_only)]) == 0
    capsys.readouterr()
    assert main(["verify", str(fir_only)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fusec: error: {fir_only}: folder has no schedule.fsched(.gz)") and err.count("\n") == 1
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"fusec: error: {tmp_path / 'nothing'}: no such schedule file or output folder\n"
