"""fusec: compile an LLM decode step into one verified, persistent GPU megakernel."""
__version__ = "0.1.0"
