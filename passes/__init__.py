"""Compiler passes, one per file, each registered by name (see `manager`)."""
