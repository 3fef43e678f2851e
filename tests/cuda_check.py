"""The GPU checks in one command, for a machine with a GPU: ``python tests/cuda_check.py [pytest options]``.

Runs ``tests/gpu`` (parity with PyTorch's DDP on CUDA, the comm stream's ordering, CUDA_LAUNCH_BLOCKING, row-sparse
CUDA tables) and exits with pytest's status; refuses to run where there is no GPU, where pytest would only skip.
docs/gpu.md has the machine it last ran on and its output.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("tests/cuda_check.py: no CUDA GPU here; these checks need one (CI skips tests/gpu)")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(pytest.main([os.path.join(here, "gpu"), "-v", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]]))
