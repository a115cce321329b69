"""Registers every op of the IR (importing this package fills `fusec.ir.registry.REGISTRY`)."""
from . import core, mixers, moe, comm  # noqa: F401
