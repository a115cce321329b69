"""fusec IR: tensor types, the op registry, graphs, the `.fir` text form and the IR verifier.

Everything about an op (signature, shape rule, reference semantics, cost, traits) is declared
once in the registry (`fusec.ir.registry`, filled by the modules in `fusec.ir.ops`); the
printer, parser, verifier and reference executor all read that table.
"""
from .types import DType, Kind, TensorType, Dim
from .graph import Value, Op, Graph
from .registry import REGISTRY, OpDef, get_op
from . import ops as _ops  # noqa: F401  (registers every op)

__all__ = ["DType", "Kind", "TensorType", "Dim", "Value", "Op", "Graph", "REGISTRY", "OpDef", "get_op"]
