"""Backends: the torch reference executors and the CuTe DSL megakernel."""
