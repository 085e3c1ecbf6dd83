"""The benchmarks' math: sizes, data, the PyTorch models and their hand-written JAX twins.

Eager PyTorch and spmd_torch run the torch models as they are; the JAX twins start from the torch
models' initial weights, so all three implementations train from one point on the same data.
Nothing here imports spmd_torch: a child process chooses which checkout's spmd_torch it imports.
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

# ------------------------------------------------------------------------------------------------
# Sizes shared by every implementation


@dataclass(frozen=True)
class ChainConfig:
    n_ops: int = 2000
    size: int = 256


@dataclass(frozen=True)
class MLPConfig:
    sizes: tuple[int, ...] = (784, 1024, 1024, 10)
    batch: int = 256
    lr: float = 0.01
    momentum: float = 0.9


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128
    batch: int = 8
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    ln_eps: float = 1e-5


@dataclass(frozen=True)
class FSDPConfig:
    mesh_devices: int = 8  # on CPU, virtual host devices forced in the child's XLA_FLAGS
    axis: str = "fsdp"


CHAIN = ChainConfig()
MLP_CFG = MLPConfig()
GPT_CFG = GPTConfig()
# W4 trains the W3 model; only the batch grows, so it splits evenly over the mesh.
GPT_W4_CFG = dataclasses.replace(GPT_CFG, batch=16)
FSDP = FSDPConfig()

# The W1 chain. Each op is written with Python operators so the same lambdas build torch eager
# ops, lazy spmd_torch nodes and traced jnp ops. x -> ((x + y) * 0.5 - y + 1) * w contracts, so
# 2000 ops stay finite. Scalar operands are constant across repetitions: one graph key.
_CHAIN_OPS: tuple[Callable[[Any, Any, Any], Any], ...] = (
    lambda x, y, w: x + y,  # add, tensor operand
    lambda x, y, w: x * 0.5,  # mul, scalar operand
    lambda x, y, w: x - y,  # sub, tensor operand
    lambda x, y, w: x + 1.0,  # add, scalar operand
    lambda x, y, w: x * w,  # mul, tensor operand
)


def chain(x: Any, y: Any, w: Any, n_ops: int = CHAIN.n_ops) -> Any:
    """Applies the W1 op chain; shared by every implementation."""
    for i in range(n_ops):
        x = _CHAIN_OPS[i % len(_CHAIN_OPS)](x, y, w)
    return x


def chain_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W1's operands, seeded so every implementation chains the same values."""
    rng = np.random.RandomState(0)
    shape = (CHAIN.size, CHAIN.size)
    x = rng.randn(*shape).astype(np.float32)
    y = rng.randn(*shape).astype(np.float32)
    w = (1.0 + 0.01 * rng.randn(*shape)).astype(np.float32)
    return x, y, w


def mlp_data(batch: int = MLP_CFG.batch) -> tuple[np.ndarray, np.ndarray]:
    """One fixed MLP batch (inputs, class targets), reused every step."""
    rng = np.random.RandomState(1)
    x = rng.randn(batch, MLP_CFG.sizes[0]).astype(np.float32)
    y = rng.randint(0, MLP_CFG.sizes[-1], size=(batch,)).astype(np.int64)
    return x, y


def gpt_data(cfg: GPTConfig = GPT_CFG) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch of token ids and their next tokens, reused every step."""
    rng = np.random.RandomState(2)
    tokens = rng.randint(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1)).astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


# ------------------------------------------------------------------------------------------------
# PyTorch models: used as-is by eager and spmd_torch; their initial weights seed the JAX params.


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig = MLP_CFG) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.sizes[0], cfg.sizes[1])
        self.fc2 = nn.Linear(cfg.sizes[1], cfg.sizes[2])
        self.fc3 = nn.Linear(cfg.sizes[2], cfg.sizes[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPT_CFG) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def new_mlp() -> MLP:
    """The MLP with seed 0's weights: every implementation and replica starts from them."""
    torch.manual_seed(0)
    return MLP()


def new_gpt() -> GPT:
    """The GPT with seed 0's weights: every implementation starts from them."""
    torch.manual_seed(0)
    return GPT()


def mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def gpt_loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def new_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=MLP_CFG.lr, momentum=MLP_CFG.momentum)


def new_adamw(model: nn.Module) -> torch.optim.Optimizer:
    c = GPT_CFG
    return torch.optim.AdamW(
        model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
    )


# ------------------------------------------------------------------------------------------------
# JAX: the same math by hand. Params are a dict keyed by the torch parameter names.


def jax_params(model: nn.Module) -> dict[str, Any]:
    """Copies the torch initial weights, so all three implementations start from one point, in
    their dtype (bfloat16 through float32: numpy has none)."""
    import jax.numpy as jnp

    def copy(v: torch.Tensor) -> Any:
        return jnp.asarray(v.detach().cpu().float().numpy()).astype(str(v.dtype)[len("torch.") :])

    return {k: copy(v) for k, v in model.named_parameters()}


def _jax_linear(p: dict[str, Any], name: str, x: Any) -> Any:
    y = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def _jax_layer_norm(p: dict[str, Any], name: str, x: Any, eps: float) -> Any:
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]


def _jax_cross_entropy(logits: Any, targets: Any) -> Any:
    """Mean of logsumexp(logits) - logits[target], like F.cross_entropy."""
    import jax
    import jax.numpy as jnp

    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def jax_mlp_loss(p: dict[str, Any], x: Any, y: Any) -> Any:
    import jax

    h = jax.nn.relu(_jax_linear(p, "fc1", x))
    h = jax.nn.relu(_jax_linear(p, "fc2", h))
    return _jax_cross_entropy(_jax_linear(p, "fc3", h), y)


def _jax_attention(p: dict[str, Any], name: str, x: Any, heads: int) -> Any:
    import jax
    import jax.numpy as jnp

    b, t, c = x.shape
    hd = c // heads
    q, k, v = jnp.split(_jax_linear(p, f"{name}.qkv", x), 3, axis=2)
    q, k, v = (a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
    return _jax_linear(p, f"{name}.proj", y)


def jax_gpt_loss(p: dict[str, Any], idx: Any, tgt: Any) -> Any:
    import jax

    c = GPT_CFG
    t = idx.shape[1]
    x = p["wte.weight"][idx] + p["wpe.weight"][:t]
    for i in range(c.layers):
        pre = f"blocks.{i}"
        x = x + _jax_attention(
            p, f"{pre}.attn", _jax_layer_norm(p, f"{pre}.ln1", x, c.ln_eps), c.heads
        )
        h = _jax_linear(p, f"{pre}.fc1", _jax_layer_norm(p, f"{pre}.ln2", x, c.ln_eps))
        x = x + _jax_linear(p, f"{pre}.fc2", jax.nn.gelu(h, approximate=False))
    logits = _jax_linear(p, "head", _jax_layer_norm(p, "ln_f", x, c.ln_eps))
    return _jax_cross_entropy(logits.reshape(-1, c.vocab), tgt.reshape(-1))


def jax_sgd_init(params: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.zeros_like, params)


def jax_sgd_update(params: Any, grads: Any, bufs: Any) -> tuple[Any, Any]:
    """torch.optim.SGD, dampening 0, no Nesterov: buf = m*buf + g (buf starts as g), p -= lr*buf."""
    import jax

    c = MLP_CFG
    bufs = jax.tree.map(lambda b, g: c.momentum * b + g, bufs, grads)
    params = jax.tree.map(lambda p, b: p - c.lr * b, params, bufs)
    return params, bufs


def jax_adamw_init(params: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"step": jnp.zeros((), jnp.float32), "m": zeros, "v": jax.tree.map(jnp.copy, zeros)}


def jax_adamw_update(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, Any]:
    """torch.optim.AdamW: decoupled decay p *= 1 - lr*wd, bias-corrected m / (sqrt(v_hat) + eps)."""
    import jax
    import jax.numpy as jnp

    c = GPT_CFG
    b1, b2 = c.betas
    step = state["step"] + 1.0
    step_size = c.lr / (1.0 - b1**step)
    bc2_sqrt = jnp.sqrt(1.0 - b2**step)
    m = jax.tree.map(lambda m, g: m + (1.0 - b1) * (g - m), state["m"], grads)  # torch lerp_
    v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state["v"], grads)

    def update(p: Any, m: Any, v: Any) -> Any:
        p = p * (1.0 - c.lr * c.weight_decay)
        return p - step_size * (m / (jnp.sqrt(v) / bc2_sqrt + c.eps))

    return jax.tree.map(update, params, m, v), {"step": step, "m": m, "v": v}


def jax_train_step(loss_fn: Callable, update_fn: Callable) -> Callable:
    """One jitted step; params and optimizer state are donated, as a real training loop would."""
    import jax

    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        params, opt_state = update_fn(params, grads, opt_state)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
