"""The activation table is shared by every model, so nobody may change it."""
from types import MappingProxyType

import pytest
import torch

from vlm_sdk.layers import activation


def test_activation_table_is_read_only():
    assert isinstance(activation.ACTIVATIONS, MappingProxyType)
    with pytest.raises(TypeError):
        activation.ACTIVATIONS["relu"] = torch.relu
