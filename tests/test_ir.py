"""The IR and its text form: exact round trips for every model config, verifier rejections."""
import importlib

import pytest

from fusec.ir.graph import GraphError
from fusec.ir.parser import parse_fir
from fusec.ir.printer import print_graph
from fusec.ir.registry import OpError
from fusec.ir.types import DType, Kind, TensorType
from fusec.ir.verify import verify_graph
from fusec.models import kimi_k3

K3_CONFIGS = ["tiny", "slice4", "slice4-e128", "full"]


def _llama_configs():
    try:
        mod = importlib.import_module("fusec.models.llama")
    except ModuleNotFoundError:
        return []
    return [(mod, c) for c in mod.CONFIGS]


@pytest.mark.parametrize("config", K3_CONFIGS)
def test_k3_round_trip_is_exact(config):
    g = kimi_k3.build_graph(config)
    verify_graph(g)
    text = print_graph(g)
    g2 = parse_fir(text, f"{config}.fir")
    verify_graph(g2)
    assert print_graph(g2) == text
    assert [v.name for v in g2.params] == [v.name for v in g.params]
    assert [(o.opname, o.attrs) for o in g2.ops] == [(o.opname, o.attrs) for o in g.ops]


@pytest.mark.parametrize("mod,config", _llama_configs())
def test_llama_round_trip_is_exact(mod, config):
    text = print_graph(mod.build_graph(config))
    assert print_graph(parse_fir(text)) == text


def test_attn_res_block_override_changes_sources():
    g12 = kimi_k3.build_graph("slice4")
    g2 = kimi_k3.build_graph("slice4", attn_res_block=2)
    n_src = lambda g: max(len(o.inputs) - 2 for o in g.ops if o.opname == "attn_res")
    assert n_src(g12) == 2          # only the embedding block plus the partial in 4 layers
    assert n_src(g2) == 3           # blocks frozen at layers 0 and 2, plus the partial


def test_full_k3_layer_layout():
    c = kimi_k3.get_config("full")
    assert len(c.mla_layers) == 24 and c.mla_layers[-2:] == (91, 92)
    g = kimi_k3.build_graph()
    ops = [o.opname for o in g.ops]
    assert ops.count("kda_recurrent") == 69
    assert ops.count("mla_attention_naive") == 24
    assert ops.count("moe_gate_up") == 92
    experts = [v for v in g.weights() if v.name.endswith("experts.w1")]
    assert len(experts) == 92 and experts[0].type == TensorType((896, 3072, 3584), DType.mxfp4, Kind.weight)


def test_unknown_config_and_field():
    with pytest.raises(ValueError, match="unknown config"):
        kimi_k3.build_graph("huge")
    with pytest.raises(ValueError, match="no field"):
        kimi_k3.build_graph("tiny", hiden=3)


def test_verifier_rejects_wrong_result_type():
    g = kimi_k3.build_graph("tiny")
    op = next(o for o in g.ops if o.opname == "linear")
    op.outputs[0].type = op.outputs[0].type.with_shape(("B", 7))
    with pytest.raises(GraphError, match="types: op linear"):
        verify_graph(g)


def test_verifier_rejects_use_before_definition():
    g = kimi_k3.build_graph("tiny")
    g.ops[3], g.ops[4] = g.ops[4], g.ops[3]
    with pytest.raises(GraphError, match="SSA"):
        verify_graph(g)


def test_verifier_rejects_lost_state_update():
    g = kimi_k3.build_graph("tiny")
    name = next(iter(g.updates))
    del g.updates[name]
    with pytest.raises(GraphError, match=f"state: %{name}"):
        verify_graph(g)


def test_op_rejects_bad_shapes_and_attrs():
    g = kimi_k3.build_graph("tiny")
    x = g.value("embed")
    w = g.value("layers.0.self_attn.o_proj.weight")   # [512, 256]: K mismatch with a 512-wide x
    with pytest.raises(OpError, match="linear: input width"):
        g.add_op("linear", [x, w])
    with pytest.raises(OpError, match="no attribute 'bogus'"):
        g.add_op("sigmoid", [x], {"bogus": 1})
    with pytest.raises(OpError, match="takes 2 operands"):
        g.add_op("add", [x])


def test_argmax_split_ops_match_argmax_and_refuse_empty_chunks():
    """argmax_partial + argmax_combine (the tile pass's split of argmax over the vocabulary) give
    torch's argmax, ties (within a chunk and across chunks) to the lowest column, for chunk
    counts that do and do not divide the row; a chunk count with empty chunks is refused."""
    import torch
    from fusec.ir.registry import get_op
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0))
    x[1, 100] = x[1, 4000] = 50.0
    x[2, 7] = x[2, 9] = 9.0
    for s in (1, 2, 7, 13, 625):
        p = get_op("argmax_partial").ref([x], {"chunks": s})[0]
        assert p.shape == (s, 3, 2)
        assert torch.equal(get_op("argmax_combine").ref([p], {})[0], x.argmax(-1).to(torch.int32)), s
    t = TensorType((3, 5000), DType.f32, Kind.act)
    assert get_op("argmax_partial").infer([t], {"chunks": 625})[0].shape == (625, 3, 2)
    with pytest.raises(OpError, match="more chunks than 8-column groups"):
        get_op("argmax_partial").infer([t], {"chunks": 626})
