"""fusec: compile an LLM decode step into one verified, persistent GPU megakernel.

Public API: `fusec.compile(model, config=..., backend="reference"|"cute", ...)` -> CompiledStep.
"""
__version__ = "0.1.0"


def version() -> str:
    """The installed distribution's version; the package's own where fusec is not installed."""
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("fusec")
    except PackageNotFoundError:
        return __version__


def compile(model, config=None, **kw):  # noqa: A001 - the product's verb
    """See `fusec.api.compile`."""
    from fusec.api import compile as _compile
    return _compile(model, config, **kw)
