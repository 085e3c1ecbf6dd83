"""The memory of one attention's forward and backward, plain against blockwise, by XLA's analysis.

``python tools/attention_memory.py [--seq 4096]`` on XLA:CPU: causal
``F.scaled_dot_product_attention`` in float32 (batch 1, 8 heads, head dim 64), forward and backward
as one program, compiled once with each form; prints each program's temporary bytes next to one
``heads * seq * seq`` float32 score matrix, and checks output and gradients against eager CPU
within float32's tolerance.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    seq = parser.parse_args().seq
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
