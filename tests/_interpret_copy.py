"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py: the publish copy kernel
(fluxtp.kernels._copy) copies exactly, for lengths that are and are not multiples of its block
and of its programs' stride, and writes nothing past the end."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch

from fluxtp.kernels._copy import copy_kernel


def main():
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    block, programs = 16, 3
    for n in (1, 15, 16, 47, 48, 49, 200):
        src = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
        dst = torch.full((n + 8,), -1, dtype=torch.int64)
        copy_kernel[(programs,)](src, dst, n, BLOCK=block, NUM_PROGRAMS=programs)
        assert torch.equal(dst[:n], src), f"n={n}: copied words differ"
        assert (dst[n:] == -1).all(), f"n={n}: wrote past the end"
    print("ok")


if __name__ == "__main__":
    main()
