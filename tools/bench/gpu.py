"""GPT-2 as nanoGPT writes it, one definition for every config, and W7gpu: GPT-2 small on a GPU.

W7gpu: GPT-2 small (12 layers, d_model 768, 12 heads, vocab 50257, the embedding tied to the output
layer: 124M parameters), seq 1024, batch 8, the forward under bfloat16 autocast, W3's AdamW on
float32 parameters and state; ms/step, tokens/s, peak device memory. Implementations: eager
PyTorch on CUDA, ``torch.compile`` with inductor on CUDA (the model's forward compiled, the
optimizer eager), spmd_torch (lazy, under ``spmd_torch.amp.autocast``), spmd_compile
(tools/bench/compiled.py, opt-in) and hand-written JAX (bfloat16 operands where autocast puts
them, float32 norms and loss, parameters and optimizer state donated) twice: ``jax`` with
attention through cuDNN's fused kernel (``jax.nn.dot_product_attention(implementation='cudnn')``;
skipped, saying so, where JAX has no CUDA device) and ``jax_plain`` with XLA's plain attention
(``implementation='xla'``: scores, mask, softmax, second matmul). Peak memory is
``torch.cuda.max_memory_allocated`` for the torch runs and the device's
``memory_stats()['peak_bytes_in_use']`` for JAX and spmd_torch.

W7gpu runs only with --gpu. ``--tiny`` swaps in a small config (2 layers, d_model 64, seq 64,
batch 2, vocab 512) that runs anywhere, CPU included: a smoke test of every implementation end to
end. W7cpu (cpu.py) runs the same model at its own sizes, in float32; Wattn (attention.py) one of
its attention layers. The models here import nothing of spmd_torch, as in models.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import compiled, harness
from .harness import Trainer, run_trainer
from .models import (
    _jax_cross_entropy,
    _jax_layer_norm,
    _jax_linear,
    gpt_loss,
    jax_adamw_init,
    jax_adamw_update,
    new_adamw,
)
from .training import _eager, _eager_trainer, _jax_trainer, spmd_trainer


@dataclass(frozen=True)
class GPT2Config:
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024
    batch: int = 8
    ln_eps: float = 1e-5
    name: str = "small"  # what reports call it


GPT2_SMALL = GPT2Config()
GPT2_TINY = GPT2Config(layers=2, d_model=64, heads=4, vocab=512, seq=64, batch=2, name="tiny")
AUTOCAST_DTYPE = torch.bfloat16


def config(tiny: bool) -> GPT2Config:
    return GPT2_TINY if tiny else GPT2_SMALL


def gpt2_data(cfg: GPT2Config) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch of token ids and their next tokens, reused every step."""
    rng = np.random.RandomState(4)
    tokens = rng.randint(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1)).astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


# ------------------------------------------------------------------------------------------------
# PyTorch: GPT-2 as nanoGPT writes it


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (a.view(b, t, self.heads, c // self.heads).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """The output layer reads wte's weight in forward rather than sharing a Parameter with a
    second module: moving a model to another device type makes new Parameters per module, which
    would untie them."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        for name, p in self.named_parameters():  # GPT-2's init
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def new_gpt2(cfg: GPT2Config) -> GPT2:
    """The model with seed 0's weights: every implementation starts from them."""
    torch.manual_seed(0)
    return GPT2(cfg)


# ------------------------------------------------------------------------------------------------
# JAX: the same math by hand, with autocast's dtypes written out


def _jax_linear_in(p: dict[str, Any], name: str, x: Any, dtype: Any) -> Any:
    """nn.Linear with its operands cast to `dtype` (autocast's rule), or as they are (None)."""
    if dtype is None:
        return _jax_linear(p, name, x)
    y = x.astype(dtype) @ p[f"{name}.weight"].astype(dtype).T
    return y + p[f"{name}.bias"].astype(dtype)


def jax_gpt2_attention(
    p: dict[str, Any], pre: str, x: Any, heads: int, dtype: Any, implementation: str | None
) -> Any:
    """GPT2Attention's math (`pre` prefixes its parameter names: ``'h.0.attn.'``, or ``''``);
    attention through ``jax.nn.dot_product_attention`` with `implementation` ('cudnn', 'xla',
    None: JAX's choice), linear layers as _jax_linear_in casts them."""
    import jax
    import jax.numpy as jnp

    b, t, c = x.shape
    q, k, v = jnp.split(_jax_linear_in(p, f"{pre}c_attn", x, dtype), 3, axis=2)
    q, k, v = (a.reshape(b, t, heads, c // heads) for a in (q, k, v))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return _jax_linear_in(p, f"{pre}c_proj", y.reshape(b, t, c), dtype)  # y: (b, t, heads, hd)


def jax_gpt2_loss(cfg: GPT2Config, autocast: bool, implementation: str | None) -> Any:
    """The loss; with `autocast` as bfloat16 autocast runs it: linear layers and attention take
    bfloat16 operands and give bfloat16 results; embeddings, the residual stream, LayerNorms and
    the loss stay float32. Without it, all float32 (W7cpu)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if autocast else None

    def loss(p: dict[str, Any], idx: Any, tgt: Any) -> Any:
        x = p["wte.weight"][idx] + p["wpe.weight"][: idx.shape[1]]
        for i in range(cfg.layers):
            pre = f"h.{i}"
            h = _jax_layer_norm(p, f"{pre}.ln_1", x, cfg.ln_eps)
            x = x + jax_gpt2_attention(p, f"{pre}.attn.", h, cfg.heads, dtype, implementation)
            h = _jax_linear_in(
                p, f"{pre}.mlp.c_fc", _jax_layer_norm(p, f"{pre}.ln_2", x, cfg.ln_eps), dtype
            )
            x = x + _jax_linear_in(p, f"{pre}.mlp.c_proj", jax.nn.gelu(h, approximate=True), dtype)
        x = _jax_layer_norm(p, "ln_f", x, cfg.ln_eps)
        w = p["wte.weight"]
        logits = x @ w.T if dtype is None else (x.astype(dtype) @ w.astype(dtype).T)
        logits = logits.astype(jnp.float32)
        return _jax_cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))

    return loss


def cudnn_skip() -> dict[str, Any] | None:
    """The result of a cuDNN attention run where JAX sees no CUDA device (None: it does): that
    row is skipped, with the reason, and jax_plain's row stands for JAX."""
    import jax

    platform = jax.devices()[0].platform
    if platform == "gpu":
        return None
    return {
        "skipped": f"cuDNN attention needs a CUDA device (JAX runs on {platform}); "
        "jax_plain is JAX with XLA's attention",
        "device": str(jax.devices()[0]),
    }


# ------------------------------------------------------------------------------------------------
# Runners of any GPT-2 config (W7gpu's here, W7cpu's in cpu.py)


def _info(cfg: GPT2Config, model: nn.Module, device: str) -> dict[str, Any]:
    """Fields every GPT-2 result carries: the config, its tokens per step and parameter count."""
    return {
        "config": cfg.name,
        "tokens_per_step": cfg.batch * cfg.seq,
        "params": sum(p.numel() for p in model.parameters()),
        "device": device,
    }


def gpt2_eager(
    warmup: int, steps: int, check: bool, gpu: bool, cfg: GPT2Config, autocast: torch.dtype | None
) -> dict[str, Any]:
    model = new_gpt2(cfg)
    data = gpt2_data(cfg)
    result = _eager(warmup, steps, check, gpu, model, new_adamw, gpt_loss, data, autocast)
    return {**result, **_info(cfg, model, result["device"])}


def _dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor_trainer(
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    dev: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> Trainer:
    """The eager trainer with the model's forward (and with it AOTAutograd's backward) compiled
    by inductor; the optimizer stays eager. `loss_fn(model, *batch)` gets the compiled model."""
    forward = torch.compile(model)

    def compiled_loss(_: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        return loss_fn(forward, *batch)

    tr = _eager_trainer(model, opt_fn, compiled_loss, data, dev, autocast_dtype)
    return dataclasses.replace(tr, compiles=_dynamo_graphs)


def gpt2_jax(
    warmup: int,
    steps: int,
    check: bool,
    cfg: GPT2Config,
    autocast: bool,
    implementation: str | None,
) -> dict[str, Any]:
    import jax

    model = new_gpt2(cfg)
    loss = jax_gpt2_loss(cfg, autocast, implementation)
    tr = _jax_trainer(loss, jax_adamw_init, jax_adamw_update, model, gpt2_data(cfg))
    info = _info(cfg, model, str(jax.devices()[0]))
    return {**run_trainer(tr, warmup, steps, check), **info, "attention": implementation}


def gpt2_spmd(
    warmup: int,
    steps: int,
    check: bool,
    cfg: GPT2Config,
    autocast: torch.dtype | None,
    probe: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The lazy run; with `probe`, its fields too, read by one more step it runs on the model and
    optimizer once the timed ones are done (not under --check)."""
    import spmd_torch

    model = new_gpt2(cfg)
    made: list = []  # the optimizer spmd_trainer makes, for the probe
    tr = spmd_trainer(
        model,
        lambda m: made.append(new_adamw(m)) or made[0],
        gpt_loss,
        gpt2_data(cfg),
        autocast_dtype=autocast,
    )
    result = harness.run_counting_fallbacks(tr, warmup, steps, check)
    if probe is not None and not check:
        result.update(probe(model, made[0]))
    return {**result, **_info(cfg, model, str(spmd_torch.device()))}


def gpt2_spmd_compile(
    warmup: int,
    steps: int,
    check: bool,
    cfg: GPT2Config,
    autocast: torch.dtype | None,
    backend: str,
) -> dict[str, Any]:
    import spmd_torch

    model = new_gpt2(cfg)
    data = gpt2_data(cfg)
    result = compiled.run(warmup, steps, check, model, new_adamw, gpt_loss, data, backend, autocast)
    return {**result, **_info(cfg, model, str(spmd_torch.device()))}


def torch_device(gpu: bool, who: str) -> torch.device:
    """CUDA under --gpu (refused where torch has none: the run, `who`, is sized for a GPU), else
    the CPU."""
    if gpu and not torch.cuda.is_available():
        raise RuntimeError(f"{who}: torch has no CUDA device (torch.cuda.is_available())")
    return harness.eager_device(gpu)


def w7_eager(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    torch_device(gpu, "W7gpu eager")
    return gpt2_eager(warmup, steps, check, gpu, config(tiny), AUTOCAST_DTYPE)


def w7_inductor(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    cfg = config(tiny)
    dev = torch_device(gpu, "W7gpu inductor")
    model = new_gpt2(cfg)
    tr = inductor_trainer(model, new_adamw, gpt_loss, gpt2_data(cfg), dev, AUTOCAST_DTYPE)
    return {**run_trainer(tr, warmup, steps, check), **_info(cfg, model, str(dev))}


def w7_jax(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """Attention through cuDNN's fused kernel (skipped where JAX has no CUDA device)."""
    return cudnn_skip() or gpt2_jax(warmup, steps, check, config(tiny), True, "cudnn")


def w7_jax_plain(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """Attention as XLA's plain composition (scores, mask, softmax, second matmul)."""
    return gpt2_jax(warmup, steps, check, config(tiny), True, "xla")


def w7_spmd(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return gpt2_spmd(warmup, steps, check, config(tiny), AUTOCAST_DTYPE)


def w7_spmd_compile(
    warmup: int, steps: int, check: bool, gpu: bool, tiny: bool, backend: str = compiled.BACKEND
) -> dict[str, Any]:
    return gpt2_spmd_compile(warmup, steps, check, config(tiny), AUTOCAST_DTYPE, backend)
