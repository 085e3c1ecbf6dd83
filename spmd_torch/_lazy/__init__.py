"""The lazy engine: tensor -> dispatch -> graph -> lowering -> compile -> execute. Its modules'
layering (who may import whom) is the table in docs/architecture.md, which a test enforces."""

import jax
import torch

# int64 and float64 keep their PyTorch meaning on the device.
jax.config.update("jax_enable_x64", True)

# 'xla' must name PrivateUse1 before any torch.device('xla') is built (tensor.DEVICE).
if torch._C._get_privateuse1_backend_name() != "xla":
    torch.utils.rename_privateuse1_backend("xla")
