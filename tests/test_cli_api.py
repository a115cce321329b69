"""The CLI and the Python API: figures, round trips through files, clean failures."""
import subprocess
import sys

import pytest
import torch

import fusec
from fusec.cli import main


def test_full_k3_summary_figures(tmp_path, capsys):
    assert main(["compile", "models/kimi_k3.py", "--emit", "fir", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "parameters: 2,779.5 B" in out
    assert "active parameters per token (batch 1): 105.4 B" in out
    assert "bytes read per decode step (batch 1, context 4096): 137.7 GB" in out
    assert "68 x KDA + MoE, 1 x KDA + dense, 24 x MLA + MoE" in out


def test_compiling_the_fir_gives_the_same_summary(tmp_path, capsys):
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--emit", "fir", "-o", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out.splitlines()
    fir = tmp_path / "a" / "kimi_k3_tiny.fir"
    assert main(["compile", str(fir), "--emit", "fir", "-o", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().out.splitlines()
    strip = lambda ls: [l for l in ls if not l.startswith(("wrote ", "done in "))]
    assert strip(first) == strip(second)
    assert (tmp_path / "b" / "kimi_k3_tiny.fir").read_text() == fir.read_text()


def test_run_generates_tokens(capsys):
    assert main(["run", "models/kimi_k3.py", "--config", "tiny", "--steps", "3", "--batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in lines] == ["prompt tokens", "step 0", "step 1", "step 2"]


@pytest.mark.parametrize("argv,msg", [
    (["compile", "nope.py"], "nope.py: no such model file"),
    (["compile", "nope.fir"], "nope.fir: no such file"),
    (["compile", "models/kimi_k3.py", "--config", "huge"], "unknown config 'huge'"),
    (["compile", "models/kimi_k3.py", "--set", "hidden"], "--set expects key=value"),
    (["run", "models/kimi_k3.py", "--config", "tiny", "--weights", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_input_is_one_line_exit_2(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusec: error: ") and msg in err and err.count("\n") == 1


def test_model_file_without_graph(tmp_path, capsys):
    f = tmp_path / "empty_model.py"
    f.write_text("X = 1\n")
    assert main(["compile", str(f)]) == 2
    assert "declares no graph" in capsys.readouterr().err


def test_console_script_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.fir"
    bad.write_text("graph g (B) {\n  io %x : bf16[B, 8\n}\n")
    p = subprocess.run([sys.executable, "-m", "fusec.cli", "compile", str(bad)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.startswith(f"fusec: error: {bad}:3:1: expected ',' or ']'")
    assert "Traceback" not in p.stderr


def test_api_step_owns_state_and_is_deterministic():
    step = fusec.compile("models/kimi_k3.py", "tiny", batch=2, max_len=8, precision="fp32")
    toks = torch.tensor([5, 7], dtype=torch.int32)
    a = step.generate(toks, 4)
    step.reset()
    b = step.generate(toks, 4)
    assert torch.equal(a, b)
    # without a reset the recurrent state holds the first run, so position 0 gives other logits
    stale = step(toks, torch.tensor([0, 0]))
    step.reset()
    fresh = step(toks, torch.tensor([0, 0]))
    step.reset()
    again = step(toks, torch.tensor([0, 0]))
    assert torch.equal(fresh.logits, again.logits)
    assert not torch.allclose(stale.logits, fresh.logits)
    o1 = fresh
    assert o1.logits.shape == (2, 4096) and o1.next_tokens.dtype == torch.int32


def test_api_rejects_bad_inputs():
    step = fusec.compile("models/kimi_k3.py", "tiny", batch=2, max_len=4)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        step(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="positions must be in"):
        step(torch.tensor([1, 2]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="unknown backend"):
        fusec.compile("models/kimi_k3.py", "tiny", backend="tpu")


def test_api_accepts_a_graph_object():
    from fusec.models import kimi_k3
    g = kimi_k3.build_graph("tiny")
    step = fusec.compile(g, batch=1, max_len=4, weights=None)
    assert step(torch.tensor([1]), torch.tensor([0])).logits.shape == (1, 4096)
