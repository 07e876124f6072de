"""Session-wide test set-up: on a machine without a GPU, Triton kernels run in the interpreter. This must be set
before any module decorates a kernel, so it lives in the root conftest, which pytest imports first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
