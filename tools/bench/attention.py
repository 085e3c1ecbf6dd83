"""Wattn: one attention layer's training step at a long sequence: peak memory and ms/step.

The layer is gpu.py's GPT2Attention (q, k and v from one linear projection, causal
``F.scaled_dot_product_attention``, the output projection) at batch 1, 8 heads of 64. The loss is
the squared norm of its output per position, averaged, in float32; a plain SGD update (lr 1e-3)
follows the backward, so that the gradients are outputs each program computes. What grows with
the sequence is the attention's forward and backward. Two forms:

  --gpu: seq 8192 in bfloat16 (parameters and input). Implementations eager and inductor on CUDA,
      jax (cuDNN's fused attention), jax_plain (XLA's plain attention: the scores materialised),
      spmd_torch. Peak memory: ``torch.cuda.max_memory_allocated`` for torch,
      ``memory_stats()['peak_bytes_in_use']`` for JAX and spmd_torch.
  CPU: seq 4096 in float32, the same implementations (jax skipped: cuDNN needs CUDA). Peak memory:
      for JAX and spmd_torch, XLA's memory analysis of the compiled step (arguments, temporaries
      and outputs not aliased to an argument: harness.program_bytes); for eager, the growth of the
      process's resident memory during a throwaway trainer's step, before the timed trainer is
      made (the heap holds nothing freed yet that it could reuse); none for inductor, whose
      first step compiles.

``--tiny`` runs either form at seq 256 (tests). Target (issue 32): on CPU, spmd_torch's peak
memory at most one tenth of plain attention's (jax_plain's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from . import harness
from .gpu import (
    GPT2Attention,
    GPT2Config,
    cudnn_skip,
    inductor_trainer,
    jax_gpt2_attention,
    torch_device,
)
from .harness import Trainer, run_trainer
from .training import _eager_trainer, _jax_trainer, spmd_trainer


@dataclass(frozen=True)
class AttnConfig:
    seq: int
    dtype: str  # torch and JAX spell it alike
    form: str  # what reports call it
    batch: int = 1
    heads: int = 8
    head_dim: int = 64

    @property
    def layer(self) -> GPT2Config:
        d_model = self.heads * self.head_dim
        return GPT2Config(layers=1, d_model=d_model, heads=self.heads, seq=self.seq, batch=1)


ATTN_GPU = AttnConfig(seq=8192, dtype="bfloat16", form="gpu")
ATTN_CPU = AttnConfig(seq=4096, dtype="float32", form="cpu")
TINY_SEQ = 256
SGD_LR = 1e-3
# On CPU, spmd_torch's peak memory over jax_plain's (plain attention's) at most this.
MEMORY_TARGET = 0.1


def config(gpu: bool, tiny: bool) -> AttnConfig:
    cfg = ATTN_GPU if gpu else ATTN_CPU
    return dataclasses.replace(cfg, seq=TINY_SEQ, form=f"{cfg.form} tiny") if tiny else cfg


def attn_data(cfg: AttnConfig) -> tuple[np.ndarray]:
    """One fixed input, float32 (the loss casts it), reused every step."""
    rng = np.random.RandomState(5)
    return (rng.randn(cfg.batch, cfg.seq, cfg.heads * cfg.head_dim).astype(np.float32),)


def new_layer(cfg: AttnConfig) -> nn.Module:
    """The layer with seed 0's weights, in the form's dtype: every implementation starts there."""
    torch.manual_seed(0)
    return GPT2Attention(cfg.layer).to(getattr(torch, cfg.dtype))


def torch_loss(cfg: AttnConfig) -> Any:
    dtype = getattr(torch, cfg.dtype)

    def loss(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x.to(dtype)).float().square().sum(-1).mean()

    return loss


def new_sgd(layer: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(layer.parameters(), lr=SGD_LR)


def jax_loss(cfg: AttnConfig, implementation: str) -> Any:
    import jax.numpy as jnp

    def loss(p: dict[str, Any], x: Any) -> Any:
        y = jax_gpt2_attention(p, "", x.astype(cfg.dtype), cfg.heads, None, implementation)
        return jnp.mean(jnp.sum(jnp.square(y.astype(jnp.float32)), axis=-1))

    return loss


def jax_sgd_init(params: dict[str, Any]) -> dict[str, Any]:
    return {}


def jax_sgd_update(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, Any]:
    import jax

    return jax.tree.map(lambda p, g: p - SGD_LR * g, params, grads), state


# ------------------------------------------------------------------------------------------------
# Runners


def _info(cfg: AttnConfig, device: str) -> dict[str, Any]:
    return {"config": cfg.form, "seq": cfg.seq, "dtype": cfg.dtype, "device": device}


def _memory(result: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The memory figure of the form: the device's peak (--gpu) or the compiled step's bytes."""
    if gpu:
        return {"memory_bytes": result["peak_bytes"], "memory_kind": "device peak"}
    kind = "compiled step (XLA's memory analysis)"
    return {"memory_bytes": result["program_bytes_per_device"], "memory_kind": kind}


def _torch(
    warmup: int, steps: int, check: bool, gpu: bool, tiny: bool, impl: str
) -> dict[str, Any]:
    """Eager or inductor (`impl`), from the initial weights. On CPU, eager's memory figure is the
    RSS growth of a throwaway trainer's step, made first; the timed run then starts from the same
    weights as every other implementation's."""
    cfg = config(gpu, tiny)
    dev = torch_device(gpu, f"Wattn {impl}")
    trainer = _eager_trainer if impl == "eager" else inductor_trainer

    def make() -> Trainer:
        return trainer(new_layer(cfg), new_sgd, torch_loss(cfg), attn_data(cfg), dev)

    memory: dict[str, Any] = {"memory_bytes": None, "memory_kind": "n/a"}
    if impl == "eager" and not gpu and not check:
        first = make()
        with harness.RssPeak() as peak:
            first.step()
            first.wait()
        del first
        memory = {"memory_bytes": peak.growth, "memory_kind": "RSS growth of a first step"}
    result = run_trainer(make(), warmup, steps, check)
    if gpu and not check:
        memory = _memory(result, gpu)
    return {**result, **memory, **_info(cfg, str(dev))}


def wattn_eager(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return _torch(warmup, steps, check, gpu, tiny, "eager")


def wattn_inductor(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return _torch(warmup, steps, check, gpu, tiny, "inductor")


def _jax(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool, impl: str) -> dict[str, Any]:
    import jax

    cfg = config(gpu, tiny)
    loss = jax_loss(cfg, impl)
    data = attn_data(cfg)
    tr = _jax_trainer(loss, jax_sgd_init, jax_sgd_update, new_layer(cfg), data, analyse=True)
    result = run_trainer(tr, warmup, steps, check)
    memory = {} if check else _memory(result, gpu)
    return {**result, **memory, **_info(cfg, str(jax.devices()[0])), "attention": impl}


def wattn_jax(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """Attention through cuDNN's fused kernel (skipped where JAX has no CUDA device)."""
    return cudnn_skip() or _jax(warmup, steps, check, gpu, tiny, "cudnn")


def wattn_jax_plain(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """Attention as XLA's plain composition: what the CPU target compares with."""
    return _jax(warmup, steps, check, gpu, tiny, "xla")


def wattn_spmd(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    import spmd_torch

    cfg = config(gpu, tiny)
    tr = spmd_trainer(new_layer(cfg), new_sgd, torch_loss(cfg), attn_data(cfg))
    tr = dataclasses.replace(tr, program_bytes=harness.spmd_program_bytes)
    result = harness.run_counting_fallbacks(tr, warmup, steps, check)
    memory = {} if check else _memory(result, gpu)
    return {**result, **memory, **_info(cfg, str(spmd_torch.device()))}
