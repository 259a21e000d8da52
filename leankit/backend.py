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
    """The requested backend: ``auto`` (default), ``triton`` or ``torch``.

    Read from the environment at every call (a process may switch it), parsed once per value:
    launchers ask several times per layer of every step."""
    global _PARSED
    raw = os.environ.get("LEANKIT_BACKEND")
    if raw != _PARSED[0]:
        name = (raw or "auto").strip().lower() or "auto"
        if name not in _CHOICES:
            raise ValueError(f"LEANKIT_BACKEND={name!r} is not one of {_CHOICES}")
        _PARSED = (raw, name)
    return _PARSED[1]


_PARSED: tuple = (None, "auto")  # (the raw LEANKIT_BACKEND value last parsed, its backend name)


def use_triton(t: torch.Tensor) -> bool:
    """Whether work on tensor ``t`` should run the Triton kernels."""
    name = backend_name()
    if name == "torch":
        return False
    if name == "triton":
        if not t.is_cuda and "TRITON_INTERPRET" not in os.environ:
            os.environ["TRITON_INTERPRET"] = "1"
        return True
    return t.is_cuda
