"""ReferenceRunner: the reference backend's runner (fusec.api backend "reference"): the graph
run op by op in torch (CPU or CUDA), state held between steps. Also the oracle other backends
and their debugging tools compare against (backends/cute/runner.py, fusec/debug/bisect.py)."""
from __future__ import annotations

from fusec.ir.graph import Graph

from .executor import first_nonfinite_op, init_state, prepare_weights, run_step


class ReferenceRunner:
    """Runs the graph op by op in torch (CPU or CUDA)."""

    def __init__(self, graph: Graph, weights: dict, dims: dict, device: str, precision: str):
        self.graph, self.dims, self.device, self.precision = graph, dims, device, precision
        self.weights = prepare_weights(graph, weights, precision, device)
        self.reset()

    def reset(self) -> None:
        self.state = init_state(self.graph, self.dims, self.device, self.precision)
        self.last_env = None

    def run(self, tokens, positions, hook=None):
        # The step's values are kept until the next step (execute holds them all anyway), so a
        # non-finite result can be traced to the op that produced it at no cost when all is well.
        self.last_env = {}
        return run_step(self.graph, self.weights, self.state, {"tokens": tokens, "pos": positions},
                        self.dims, self.precision, hook, env_out=self.last_env)

    def explain_nonfinite(self) -> str | None:
        """'op NAME -> %value' for the first op of the last step whose result was non-finite."""
        hit = first_nonfinite_op(self.graph, self.last_env or {})
        return None if hit is None else f"first produced by op {hit[0].opname} -> %{hit[1]}"
