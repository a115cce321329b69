"""Imported first by the CuTe GPU test modules: skips the importing module (with its reason)
unless a CUDA GPU and nvidia-cutlass-dsl are present, before any CuTe import can fail."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl==4.8.1 not installed")
