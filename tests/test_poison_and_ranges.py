"""Poison stops at the door (NaN/Inf weights, 0xFF E8M0 scales, non-finite logits) and every CLI
flag / API argument out of range is one `fusec: error:` line, exit 2 (a ValueError in the API)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fusec
from checkpoint_writer import write_k3_checkpoint
from fusec.api import NonFiniteLogits
from fusec.cli import main
from fusec.models import kimi_k3
from fusec.weights import random_weights

from cuda_fakes import fake_events_and_pinning

K3 = "models/kimi_k3.py"
LM = "language_model.model."
NAN, INF = float("nan"), float("inf")


def one_error_line(capsys, rc, expect_rc=2) -> str:
    err = capsys.readouterr().err
    assert rc == expect_rc, err
    assert err.startswith("fusec: error: ") and err.count("\n") == 1, err
    return err


# -- the poisoned checkpoint corpus -------------------------------------------------------------

def _set(w, name, index, value):
    w[name][index] = value


def _scale(w, name, index, value=0xFF):
    w[name].scale[index] = value


# (case id, graph weight, how to poison the weights dict, checkpoint tensor the error must name)
CORPUS = [
    ("bf16-nan", lambda w: _set(w, "layers.0.self_attn.q_proj.weight", (3, 7), NAN),
     LM + "layers.0.self_attn.q_proj.weight"),
    ("bf16-inf-lm-head", lambda w: _set(w, "lm_head.weight", (4095, 0), INF),
     "language_model.lm_head.weight"),
    ("bf16-neg-inf-norm", lambda w: _set(w, "layers.1.input_layernorm.weight", (5,), -INF),
     LM + "layers.1.input_layernorm.weight"),
    ("bf16-nan-shared-expert", lambda w: _set(w, "layers.1.block_sparse_moe.shared_experts.down_proj.weight",
                                              (0, 0), NAN),
     LM + "layers.1.block_sparse_moe.shared_experts.down_proj.weight"),
    ("fp32-nan-A_log", lambda w: _set(w, "layers.0.self_attn.A_log", (2,), NAN),
     LM + "layers.0.self_attn.A_log"),
    ("fp32-inf-conv", lambda w: _set(w, "layers.1.self_attn.q_conv1d.weight", (9, 0, 3), INF),
     LM + "layers.1.self_attn.q_conv1d.weight"),
    ("router-bias-nan", lambda w: _set(w, "layers.1.block_sparse_moe.gate.e_score_correction_bias", (17,), NAN),
     LM + "layers.1.block_sparse_moe.gate.e_score_correction_bias"),
    ("mxfp4-scale-ff-w2", lambda w: _scale(w, "layers.1.block_sparse_moe.experts.w2", (5, 3, 1)),
     LM + "layers.1.block_sparse_moe.experts.5.w2.weight_scale"),
    ("mxfp4-scale-ff-w1-last-expert", lambda w: _scale(w, "layers.1.block_sparse_moe.experts.w1", (31, 127, 7)),
     LM + "layers.1.block_sparse_moe.experts.31.w1.weight_scale"),
]


@pytest.fixture(scope="module")
def clean():
    g = kimi_k3.build_graph("tiny")
    return g, random_weights(g, 7, kimi_k3.WEIGHT_INIT)


def _clone(w):
    from fusec.ir.quant import MXFP4Tensor
    return {k: MXFP4Tensor(v.packed.clone(), v.scale.clone()) if isinstance(v, MXFP4Tensor) else v.clone()
            for k, v in w.items()}


@pytest.fixture(scope="module")
def corpus(clean, tmp_path_factory):
    """case id -> checkpoint folder (published K3 layout, 2 shards) holding that one poison."""
    _, w = clean
    cfg, out = kimi_k3.get_config("tiny"), {}
    for case, poison, _ in CORPUS:
        pw = _clone(w)
        poison(pw)
        folder = tmp_path_factory.mktemp(case)
        write_k3_checkpoint(cfg, pw, folder, shards=2, vision=False)
        out[case] = folder
    return out


@pytest.mark.parametrize("case,tensor", [(c, t) for c, _, t in CORPUS], ids=[c for c, _, _ in CORPUS])
def test_poisoned_checkpoint_is_one_line_cli_error(case, tensor, corpus, capsys):
    rc = main(["run", K3, "--config", "tiny", "--steps", "1", "--weights", str(corpus[case])])
    err = one_error_line(capsys, rc)
    assert f"tensor {tensor} has " in err
    assert ("0xFF (NaN)" in err) == case.startswith("mxfp4"), err
    assert "--allow-nonfinite" in err


@pytest.mark.parametrize("case,tensor", [(c, t) for c, _, t in CORPUS], ids=[c for c, _, _ in CORPUS])
def test_poisoned_checkpoint_is_a_value_error_in_the_api(case, tensor, corpus):
    with pytest.raises(ValueError, match=f"tensor {tensor} has "):
        fusec.compile(K3, "tiny", weights=corpus[case])


def test_poisoned_bf16_expert_of_a_bf16_expert_checkpoint(clean, tmp_path, capsys):
    g = kimi_k3.build_graph("tiny", expert_dtype="bf16")
    w = random_weights(g, 7, kimi_k3.WEIGHT_INIT)
    w["layers.2.block_sparse_moe.experts.w3"][7, 1, 2] = NAN
    write_k3_checkpoint(kimi_k3.get_config("tiny", expert_dtype="bf16"), w, tmp_path, shards=2, vision=False)
    rc = main(["run", K3, "--config", "tiny", "--set", "expert_dtype=bf16", "--weights", str(tmp_path)])
    assert f"tensor {LM}layers.2.block_sparse_moe.experts.7.w3.weight has non-finite values (1 NaN)" \
        in one_error_line(capsys, rc)


def test_every_poisoned_tensor_is_counted(clean, tmp_path):
    _, w = clean
    pw = _clone(w)
    for _, poison, _ in CORPUS:
        poison(pw)
    write_k3_checkpoint(kimi_k3.get_config("tiny"), pw, tmp_path, shards=3, vision=False)
    with pytest.raises(ValueError, match=rf"and {len(CORPUS) - 1} more poisoned tensors"):
        fusec.compile(K3, "tiny", weights=tmp_path)


def test_console_script_poisoned_checkpoint(corpus):
    r = subprocess.run([sys.executable, "-m", "fusec", "run", K3, "--config", "tiny", "--steps", "1",
                        "--weights", str(corpus["mxfp4-scale-ff-w2"])], capture_output=True, text=True)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.startswith("fusec: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "experts.5.w2.weight_scale has 1 E8M0 scale byte(s) 0xFF (NaN), first at [3, 1]" in r.stderr


def test_allow_nonfinite_loads_and_the_step_names_the_op(corpus, capsys):
    step = fusec.compile(K3, "tiny", weights=corpus["bf16-nan"], allow_nonfinite=True, batch=2)
    with pytest.raises(NonFiniteLogits, match=r"^step 0: non-finite logits in batch row\(s\) \[0, 1\]; "
                                              r"first produced by op \w+ -> %\S+$") as ei:
        step.generate(torch.tensor([1, 2]), 2)
    assert "q_proj" in str(ei.value)       # the NaN sits in layer 0's q_proj weight
    rc = main(["run", K3, "--config", "tiny", "--weights", str(corpus["bf16-nan"]), "--allow-nonfinite"])
    err = one_error_line(capsys, rc)
    assert "step 0: non-finite logits" in err and "first produced by op" in err


def test_allowed_scale_nan_never_returns_silent_tokens(corpus):
    """A 0xFF scale on an expert that is picked poisons the logits: an error, never token 0."""
    step = fusec.compile(K3, "tiny", weights=corpus["mxfp4-scale-ff-w2"], allow_nonfinite=True, batch=4)
    try:
        out = step.generate(torch.tensor([1, 2, 3, 4]), 4)
    except NonFiniteLogits as e:
        assert str(e).startswith("step ")
    else:   # expert 5 never routed for these tokens: the logits are finite and so are the tokens
        assert out.shape == (4, 4)


def test_nonfinite_logits_name_the_later_step(clean):
    g, w = clean
    step = fusec.compile(K3, "tiny", weights=_clone(w), batch=1, max_len=4)
    step.step(torch.tensor([3]), torch.tensor([0]))
    step.runner.weights["norm.weight"][0] = NAN      # poisoned after load, between steps
    with pytest.raises(NonFiniteLogits, match=r"^step 1: .*first produced by op rms_norm -> %"):
        step.step(torch.tensor([3]), torch.tensor([1]))
    step.reset()
    with pytest.raises(NonFiniteLogits, match=r"^step 0: "):
        step.step(torch.tensor([3]), torch.tensor([0]))


def test_check_finite_off_returns_the_logits(clean):
    g, w = clean
    pw = _clone(w)
    pw["lm_head.weight"][0, 0] = NAN
    step = fusec.compile(K3, "tiny", weights=pw, allow_nonfinite=True, check_finite=False)
    out = step.step(torch.tensor([3]), torch.tensor([0]))
    assert not torch.isfinite(out.logits).all()


def test_poisoned_weight_dict_is_a_value_error(clean):
    _, w = clean
    pw = _clone(w)
    pw["layers.1.block_sparse_moe.gate.e_score_correction_bias"][0] = NAN
    with pytest.raises(ValueError, match=r"^weight tensor layers\.1\.block_sparse_moe\.gate\.e_score_correction_bias "
                                         r"has non-finite values \(1 NaN\), first at \[0\]"):
        fusec.compile(K3, "tiny", weights=pw)
    pw = _clone(w)
    pw["layers.1.block_sparse_moe.experts.w3"].scale[0, 0, 0] = 0xFF
    with pytest.raises(ValueError, match=r"experts\.w3 \(scale\) has 1 E8M0 scale byte"):
        fusec.compile(K3, "tiny", weights=pw)


# -- structural problems stay as clear as before -----------------------------------------------

def _clean_ckpt(clean, folder):
    _, w = clean
    return write_k3_checkpoint(kimi_k3.get_config("tiny"), w, folder, shards=2, vision=False)


def test_structural_errors_stay_clear(clean, tmp_path, capsys):
    import json
    index = _clean_ckpt(clean, tmp_path)
    shard = sorted(set(index["weight_map"].values()))[-1]
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[: len(data) // 2])          # truncated shard
    err = one_error_line(capsys, main(["run", K3, "--config", "tiny", "--weights", str(tmp_path)]))
    assert shard in err
    (tmp_path / shard).write_bytes(data)
    wm = dict(index["weight_map"])
    del wm[LM + "norm.weight"]                                       # missing tensor
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    err = one_error_line(capsys, main(["run", K3, "--config", "tiny", "--weights", str(tmp_path)]))
    assert f"missing tensor {LM}norm.weight needed by graph weight norm.weight" in err


# -- CLI ranges ---------------------------------------------------------------------------------

TINY = [K3, "--config", "tiny"]
BAD_FLAGS = []
for _cmd, _flags in (("compile", ("--max-len", "--batch", "--ranks")), ("run", ("--batch", "--steps")),
                     ("simulate", ("--ranks", "--batch"))):
    for _f in _flags:
        for _v in ("0", "-1", "-3", "two", "1.5", ""):
            BAD_FLAGS.append(([_cmd, *TINY, _f, _v], f"argument {_f}: expected an integer >= 1"))
for _v in ("-1", "x"):
    BAD_FLAGS.append((["run", *TINY, "--seed", _v], "argument --seed: expected an integer >= 0"))
BAD_FLAGS.append((["run", *TINY, "--seed", str(2 ** 70)], "seed must be < 2**63"))
for _v in ("0", "-2", "two", "1.5"):
    BAD_FLAGS.append((["compile", *TINY, "--set", f"attn_res_block={_v}"], f"attn_res_block={_v}: attn_res_block must"))
    BAD_FLAGS.append((["run", *TINY, "--set", f"layers={_v}"], f"layers={_v}: layers must"))
BAD_FLAGS += [
    (["run", *TINY, "--set", "rms_eps=tiny"], "rms_eps must be a finite number"),
    (["run", *TINY, "--set", "mla_layers=1,x"], "mla_layers must be a comma list of integers"),
    (["run", *TINY, "--device", "tpu"], "unknown device 'tpu'"),
    (["run", *TINY, "--device", "meta"], "unsupported device 'meta'"),
    (["run", *TINY, "--backend", "gpu"], "argument --backend: invalid choice"),
    (["compile", *TINY, "--emit", "x"], "argument --emit: invalid choice"),
    (["run", *TINY, "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize("argv,msg", BAD_FLAGS, ids=[" ".join(a[3:] if len(a) > 3 else a) + f"#{i}"
                                                     for i, (a, _) in enumerate(BAD_FLAGS)])
def test_bad_flag_is_one_line_exit_2(argv, msg, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:      # argparse exits from inside parse_args
        rc = e.code
    assert msg in one_error_line(capsys, rc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("argv", [["run", *TINY, "--backend", "cute", "--device", "cuda"],
                                  ["run", *TINY, "--backend", "cute"],
                                  ["run", *TINY, "--device", "cuda:0"]])
def test_no_gpu_says_no_cuda_device(argv, capsys, monkeypatch):
    monkeypatch.setattr("fusec.api.require_cute", lambda: None)     # as if the cute extra were installed
    assert one_error_line(capsys, main(argv)) == "fusec: error: no CUDA device\n"


def test_broken_pipe_is_quiet():
    r_fd, w_fd = os.pipe()
    os.close(r_fd)                       # the reader is gone before fusec writes a byte
    try:
        p = subprocess.run([sys.executable, "-m", "fusec", "ops"], stdout=w_fd, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w_fd)
    assert p.stderr == "" and p.returncode == 141


# -- API ranges ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    ({"batch": 0}, "batch must be an integer >= 1"),
    ({"batch": -1}, "batch must be an integer >= 1"),
    ({"batch": "2"}, "batch must be an integer >= 1"),
    ({"max_len": 0}, "max_len must be an integer >= 1"),
    ({"max_len": -5}, "max_len must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": 2 ** 70}, r"seed must be < 2\*\*63"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"backend": "tpu"}, "unknown backend"),
    ({"overrides": {"attn_res_block": 0}}, "attn_res_block must be an integer >= 1"),
    ({"overrides": {"attn_res_block": "two"}}, "attn_res_block must be an integer"),
    ({"overrides": {"hidden": -8}}, "hidden must be an integer >= 1"),
])
def test_api_bad_arguments_raise_value_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        fusec.compile(K3, "tiny", **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_api_no_gpu():
    with pytest.raises(ValueError, match="^no CUDA device$"):
        fusec.compile(K3, "tiny", device="cuda")


@pytest.fixture(scope="module")
def tiny_step():
    return fusec.compile(K3, "tiny", batch=2, max_len=4)


@pytest.mark.parametrize("tokens,msg", [
    ([-1, 5], r"token id -1 is outside the vocabulary \[0, 4096\)"),
    ([5, 4096], r"token id 4096 is outside the vocabulary \[0, 4096\)"),
    ([2 ** 40, 0], r"token id 1099511627776 is outside the vocabulary"),
    ([1.0, 2.0], "must be integer tensors"),
    ([1, 2, 3], r"expected tokens and positions of shape \[2\]"),
])
def test_api_bad_tokens(tiny_step, tokens, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_step.step(torch.tensor(tokens), torch.tensor([0, 0]))


@pytest.mark.parametrize("steps,start,msg", [(0, 0, "steps must be a positive integer"),
                                             (-3, 0, "steps must be a positive integer"),
                                             (2, -1, "start_pos must be a non-negative integer"),
                                             (5, 0, "exceeds max_len 4")])
def test_api_bad_generate(tiny_step, steps, start, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_step.generate(torch.tensor([1, 2]), steps, start)
    with pytest.raises(ValueError, match=r"token id -1"):
        tiny_step.generate(torch.tensor([-1, 2]), 1)


def test_in_range_still_runs(tiny_step, capsys):
    assert tiny_step.generate(torch.tensor([0, 4095]), 4).shape == (4, 2)
    assert main(["run", *TINY, "--steps", "1", "--batch", "1", "--seed", "0"]) == 0
    assert "step 0:" in capsys.readouterr().out


def _deferred_check(clean, device):
    """A poisoned lm_head under the deferred check: the step returns (the check is pending), the
    next step too (one step stays in flight: it never waits for the GPU), the one after it (or
    check()) raises naming the step; a clean model generates."""
    from fusec.api import CompiledStep
    g, w = clean
    pw = _clone(w)
    pw["lm_head.weight"][5, 0] = NAN
    ref = fusec.compile(K3, "tiny", weights=pw, allow_nonfinite=True, device=device, max_len=4)
    step = CompiledStep(ref.graph, ref.runner, 1, 4, device, deferred=True)
    out = step.step(torch.tensor([3]), torch.tensor([0]))          # returns: the check is pending
    assert not torch.isfinite(out.logits).all()
    step.step(torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(NonFiniteLogits, match=r"^step 0: non-finite logits in batch row\(s\) \[0\]"):
        step.step(torch.tensor([3]), torch.tensor([2]))
    step.reset()
    step.step(torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(NonFiniteLogits, match=r"^step 0: "):
        step.check()
    ok = fusec.compile(K3, "tiny", weights=_clone(w), device=device, max_len=4)
    ok_step = CompiledStep(ok.graph, ok.runner, 1, 4, device, deferred=True)
    assert ok_step.generate(torch.tensor([3]), 4).shape == (4, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deferred_nonfinite_check_on_cuda(clean):
    """The check a non-reference CUDA backend gets: no host sync in the step."""
    _deferred_check(clean, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deferred_input_range_check_on_cuda(clean):
    """CUDA tokens and positions are range-checked on the device (no host read): the step runs
    on clamped values and check() raises naming it."""
    from fusec.api import CompiledStep
    g, w = clean
    ref = fusec.compile(K3, "tiny", weights=_clone(w), device="cuda", max_len=4)
    step = CompiledStep(ref.graph, ref.runner, 1, 4, "cuda", deferred=True)
    step.step(torch.tensor([3], device="cuda"), torch.tensor([0], device="cuda"))
    step.step(torch.tensor([3], device="cuda"), torch.tensor([7], device="cuda"))
    with pytest.raises(ValueError, match=r"^step 1: a position outside \[0, 4\)"):
        step.check()
    step.step(torch.tensor([10 ** 6], device="cuda"), torch.tensor([1], device="cuda"))
    with pytest.raises(ValueError, match=r"^step 2: .*token id outside the vocabulary"):
        step.check()


def test_deferred_nonfinite_check_logic_on_cpu(clean, monkeypatch):
    """The deferred bookkeeping of the CUDA path, with the pinned copy and event faked on the CPU."""
    fake_events_and_pinning(monkeypatch)
    _deferred_check(clean, "cpu")


def test_set_checks_types_against_the_model_config(tmp_path, capsys):
    f = tmp_path / "user_model.py"
    f.write_text("from dataclasses import dataclass\n"
                 "from fusec.modelconfig import select_config\n"
                 "@dataclass(frozen=True)\n"
                 "class C:\n    name: str = 'a'\n    extra: int = 0\n    width: int = 4\n    eps: float = 0.5\n"
                 "CONFIGS = {'a': C()}\nDEFAULT_CONFIG = 'a'\n"
                 "def build_graph(config='a', **ov):\n"
                 "    c = select_config('m', CONFIGS, config, ov)\n"
                 "    raise ValueError(f'built extra={c.extra!r} width={c.width!r} eps={c.eps!r}')\n")
    for sets, msg in ((["extra=0", "eps=1"], "built extra=0 width=4 eps=1.0"),
                      (["extra=-1"], "extra must be an integer >= 0"),
                      (["width=0"], "width must be an integer >= 1"),
                      (["eps=nan"], "eps must be a finite number"),
                      (["eps=x"], "eps must be a finite number")):
        argv = ["compile", str(f), "--emit", "fir", "-o", str(tmp_path / "o")]
        for s in sets:
            argv += ["--set", s]
        assert msg in one_error_line(capsys, main(argv))
