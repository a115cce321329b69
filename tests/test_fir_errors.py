"""Malformed `.fir` files: each fails with one line naming file:line:col and what was expected.

Every file in tests/fir_invalid/ starts with `# expect: <message prefix>`; the CLI must print
exactly that after `fusec: error: `, exit 2 and write nothing.
"""
from pathlib import Path

import pytest

from fusec.cli import main
from fusec.ir.parser import FirSyntaxError, parse_fir_file

CASES = sorted((Path(__file__).parent / "fir_invalid").glob("*.fir"))


def _expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} lacks its expect line"
    return first[len("# expect: "):]


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_parse_error_message(path, monkeypatch):
    monkeypatch.chdir(path.parent)
    with pytest.raises(FirSyntaxError) as e:
        parse_fir_file(path.name)
    assert str(e.value).startswith(_expected(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", CASES[:3], ids=[p.stem for p in CASES[:3]])
def test_cli_reports_one_line_and_writes_nothing(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(path.parent)
    out = tmp_path / "out"
    rc = main(["compile", path.name, "-o", str(out), "--emit", "fir"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("fusec: error: " + _expected(path)) and err.count("\n") == 1
    assert not out.exists()
