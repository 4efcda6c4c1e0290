"""Triton kernel bodies (only @triton.jit code; launchers live in fluxtp.backends.fused, and
fluxtp.fp8 launches the quantization kernel), and the compile options every launch passes.

Importing this package needs triton; fluxtp itself does not.
"""

import os

# FMA contraction on, as every measurement compiled them, unless the user chose through Triton's
# variable: Triton 3.9 warns that its default turns it off from 3.10.
COMPILE_OPTIONS = {} if "TRITON_DEFAULT_FP_FUSION" in os.environ else {"enable_fp_fusion": True}
