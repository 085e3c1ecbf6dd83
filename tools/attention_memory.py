"""The memory of one attention's forward and backward, plain against blockwise, by XLA's analysis.

``python tools/attention_memory.py [--seq 4096]`` on XLA:CPU: causal
``F.scaled_dot_product_attention`` in float32 (batch 1, 8 heads, head dim 64), forward and backward
as one program, compiled once with each form; prints each program's temporary bytes next to one
``heads * seq * seq`` float32 score matrix, and checks output and gradients against eager CPU
within float32's tolerance.

``--scan-layers N``: instead, N layers of the scan bench's Llama block (width 128, 4 query heads
of 32, batch 2) under ``scan_layers``, forward and backward as one program; prints its temporary
bytes next to one layer's ``batch * heads * seq * seq`` float32 probabilities (what a scan would
keep per layer if JAX differentiated the blockwise forward's loop instead of calling its backward).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import spmd_torch
from spmd_torch._lazy import engine
from spmd_torch._lazy.lowering import attention

HEADS, HEAD_DIM = 8, 64


def step(q, k, v, cotangent) -> tuple:
    """(output, gradients, the compiled program's memory analysis) of one attention step."""
    leaves = [t.to(spmd_torch.device()).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    grads = torch.autograd.grad(out, leaves, cotangent.to(out.device))
    spmd_torch.sync()
    cache = engine.current().cache
    analysis = cache.executables[cache.history[-1]].compiled.memory_analysis()
    return out.cpu(), [g.cpu() for g in grads], analysis


def scan_layers_step(layers: int, seq: int) -> None:
    """Temporaries of N scanned Llama blocks' forward and backward against one layer's
    probabilities."""
    from dataclasses import replace

    from spmd_torch.experimental.scan_layers import scan_layers
    from tools.bench.llama import rope_tables
    from tools.bench.scan import CFG, Block

    cfg = replace(CFG, seq=seq, layers=layers)
    dev = spmd_torch.device()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(layers)).to(dev)
    x = torch.randn(cfg.batch, seq, cfg.d_model, device=dev).requires_grad_()
    cos, sin = (torch.from_numpy(t).to(dev) for t in rope_tables(cfg))
    out = scan_layers(blocks, (x, cos, sin))[0]
    (out * out).mean().backward()
    spmd_torch.sync()
    cache = engine.current().cache
    temp = cache.executables[cache.history[-1]].compiled.memory_analysis().temp_size_in_bytes
    probs = cfg.batch * cfg.heads * seq * seq * 4
    print(
        f"scan_layers, {layers} layers, seq {seq}: temporaries {temp} bytes ({temp / probs:.2f}x "
        f"one layer's probabilities, {probs} bytes); x's gradient finite: "
        f"{bool(x.grad.isfinite().all())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--scan-layers", type=int, default=0)
    args = parser.parse_args()
    seq = args.seq
    if args.scan_layers:
        scan_layers_step(args.scan_layers, seq)
        return
    generator = torch.Generator().manual_seed(0)
    q, k, v, cotangent = (
        torch.randn(1, HEADS, seq, HEAD_DIM, generator=generator) for _ in range(4)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected_grads = torch.autograd.grad(expected, leaves, cotangent)
    scores = HEADS * seq * seq * 4
    print(f"seq {seq}: one heads*seq*seq float32 score matrix is {scores} bytes")
    for form, plain_max_keys in (("plain", seq), ("blockwise", 0)):
        attention.PLAIN_MAX_KEYS = plain_max_keys  # read when the program is lowered
        engine.current().cache.executables.clear()
        out, grads, analysis = step(q, k, v, cotangent)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=2e-4, atol=2e-4)
        temp = analysis.temp_size_in_bytes
        print(
            f"{form:9}: temporaries {temp} bytes ({temp / scores:.3f} score matrices), "
            f"arguments {analysis.argument_size_in_bytes}, outputs "
            f"{analysis.output_size_in_bytes}; output and gradients equal eager's"
        )


if __name__ == "__main__":
    main()
