"""Independent plain-PyTorch model implementations used as numerical oracles by the tests.

Nothing here imports fusec.ir ops, refs, the builder or the executor: each model is written from
its public description (shared/models/*.md, the HF configs) so that agreement with the reference
executor is evidence, not a tautology.
"""
