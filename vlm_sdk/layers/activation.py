"""Activations by their config name (`hidden_act`), for MLPs that are not SwiGLU-fused (vision
towers); the fused SwiGLU `silu_and_mul` is the kernel set's (`layers.ops.KernelOps`)."""
from __future__ import annotations

from types import MappingProxyType

import torch
import torch.nn.functional as F

ACTIVATIONS = MappingProxyType({  # read-only: shared by every model instance
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
})
