"""Ascend NPU backend ("triton_ascend"): Triton kernels for Triton-Ascend, tiles sized to the unified buffer.

Importing this package imports neither triton nor torch_npu; `launch.AscendBackend` pulls in the
kernels when constructed.
"""
