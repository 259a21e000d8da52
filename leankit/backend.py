"""Backend choice: Triton kernels or the PyTorch reference.

* CUDA tensors use the Triton kernels;
* CPU tensors use the PyTorch reference (it is also leankit's CPU backend);
* ``LEANKIT_BACKEND=triton`` forces the kernels, which then run on CPU tensors through Triton's
  interpreter (``TRITON_INTERPRET=1`` is set for you before Triton is imported);
* ``LEANKIT_BACKEND=torch`` forces the reference everywhere.
"""

from __future__ import annotations

import os

import torch

_CHOICES = ("auto", "triton", "torch")


def backend_name() -> str:
    """The requested backend: ``auto`` (default), ``triton`` or ``torch``."""
    name = os.environ.get("LEANKIT_BACKEND", "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"LEANKIT_BACKEND={name!r} is not one of {_CHOICES}")
    return name


def use_triton(t: torch.Tensor) -> bool:
    """Whether work on tensor ``t`` should run the Triton kernels."""
    name = backend_name()
    if name == "torch":
        return False
    if name == "triton":
        if not t.is_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return True
    return t.is_cuda
