"""Triton backend (CUDA; CPU through TRITON_INTERPRET=1). Import `launch.TritonBackend` lazily:
importing this package pulls in nothing, so `import areal_lce` never needs triton."""
