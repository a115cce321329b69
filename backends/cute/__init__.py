"""CuTe DSL megakernel backend (imports cutlass lazily)."""
