"""torch_xla.experimental.gru: ``nn.GRU`` whose time loop is one scan.

ATen runs a GRU one time step at a time, so the traced program holds every step and grows with
the sequence. ``GRU`` keeps ``nn.GRU``'s parameters, state dict and results, and runs each layer
as one ``scan`` over time (its step recorded once): the program holds one step per layer
whatever the length, and autograd goes through each scan as one op each way.

PyTorch/XLA replaces ``torch.nn.GRU`` by this class when it is imported, and so does ``import
torch_xla`` here (torch's own stays as ``nn.GRU._orig``); ``import spmd_torch`` patches nothing in
torch, so import it from here where a scanned GRU is wanted.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .scan import scan

__all__ = ["GRU"]

_TORCH_GRU = getattr(nn.GRU, "_orig", nn.GRU)  # torch's, also once ``import torch_xla`` patched it


class GRU(_TORCH_GRU):
    """``nn.GRU`` with each layer's time loop as one scan (unidirectional, no projection).

    Takes ``nn.GRU``'s arguments; ``bidirectional=True`` gives a plain ``nn.GRU`` (with a
    warning), as in PyTorch/XLA. Inputs off the xla device run ``nn.GRU``'s own forward.

    Example:
        >>> gru = GRU(16, 32, num_layers=2).to('xla')
        >>> out, h = gru(torch.randn(100, 4, 16, device='xla'))  # one step per layer traced
    """

    def __new__(cls, *args, **kwargs):
        if kwargs.get("bidirectional", False) or (len(args) > 6 and args[6]):
            logging.warning("the scan-based GRU is unidirectional: a plain nn.GRU is made instead")
            return _TORCH_GRU(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if kwargs.get("proj_size", 0):
            raise ValueError("GRU: nn.GRU takes no proj_size (it is LSTM's)")
        super().__init__(*args, **kwargs)

    def forward(self, input, hx=None):  # nn.GRU's very signature: the two are interchangeable
        if isinstance(input, nn.utils.rnn.PackedSequence):
            raise ValueError("GRU: a PackedSequence is not supported; pass a padded tensor")
        if input.device.type != "xla":
            return super().forward(input, hx)
        if input.dim() not in (2, 3):
            raise ValueError(f"GRU: expected a 2-D or 3-D input, got {input.dim()}-D")
        batched = input.dim() == 3
        if not batched:
            input = input.unsqueeze(0 if self.batch_first else 1)
            if hx is not None:
                if hx.dim() != 2:
                    raise RuntimeError(
                        f"GRU: for an unbatched 2-D input hx must be 2-D, got {hx.dim()}-D"
                    )
                hx = hx.unsqueeze(1)
        elif hx is not None and hx.dim() != 3:
            raise RuntimeError(f"GRU: for a batched 3-D input hx must be 3-D, got {hx.dim()}-D")
        if hx is None:
            batch = input.size(0 if self.batch_first else 1)
            hx = input.new_zeros(self.num_layers, batch, self.hidden_size)
        self.check_forward_args(input, hx, None)
        if self.batch_first:
            input = input.transpose(0, 1)
        output, last = input, []
        for layer in range(self.num_layers):
            weights = {
                "w_ih": getattr(self, f"weight_ih_l{layer}"),
                "w_hh": getattr(self, f"weight_hh_l{layer}"),
                "b_ih": getattr(self, f"bias_ih_l{layer}") if self.bias else None,
                "b_hh": getattr(self, f"bias_hh_l{layer}") if self.bias else None,
            }
            h, output = scan(_step, {"h": hx[layer], **weights}, output, is_fn_pure=True)
            last.append(h["h"])
            if layer < self.num_layers - 1 and self.dropout > 0:
                output = F.dropout(output, p=self.dropout, training=self.training)
        hidden = torch.stack(last)
        if self.batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output, hidden = output.squeeze(0 if self.batch_first else 1), hidden.squeeze(1)
        return output, hidden


def _step(carry: dict, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One time step of one layer, PyTorch's formula (the weights ride in the carry unchanged;
    a module-level function, so that scan keeps its recording)."""
    h = carry["h"]
    x_r, x_z, x_n = F.linear(x, carry["w_ih"], carry["b_ih"]).chunk(3, dim=1)
    h_r, h_z, h_n = F.linear(h, carry["w_hh"], carry["b_hh"]).chunk(3, dim=1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    h = (1 - z) * n + z * h
    return {**carry, "h": h}, h
