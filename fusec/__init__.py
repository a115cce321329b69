"""fusec: compile an LLM decode step into one verified, persistent GPU megakernel.

Public API: `fusec.compile(model, config=..., backend="reference"|"cute", ...)` -> CompiledStep.
"""
__version__ = "0.1.0"


def compile(model, config=None, **kw):  # noqa: A001 - the product's verb
    """See `fusec.api.compile`."""
    from fusec.api import compile as _compile
    return _compile(model, config, **kw)
