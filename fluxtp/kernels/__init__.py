"""Triton kernel bodies (only @triton.jit code; launchers live in fluxtp.backends.fused, and
fluxtp.fp8 launches the quantization kernel).

Importing this package needs triton; fluxtp itself does not.
"""
