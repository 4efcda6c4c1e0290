"""Triton kernel bodies (only @triton.jit code; launchers live in fluxtp.backends.fused).

Importing this package needs triton; fluxtp itself does not.
"""
