"""W6: a Llama-style decoder from plain PyTorch modules, its hand-written JAX twin, its runners.

The model is what a PyTorch/XLA user writes today: ``nn.RMSNorm``, rotary embeddings applied with
rotate-half (cos/sin tables as non-persistent buffers), a SwiGLU MLP and grouped-query attention
through ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``. It trains with
W3's AdamW. The JAX twin repeats each kv head for its group of query heads, as ``enable_gqa`` does,
and starts from the torch model's initial weights; both read one rotary table built in numpy.
spmd_torch's runs also count the CPU fallbacks (``aten::<op>`` counters) of their steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import compiled, harness
from .harness import run_trainer
from .models import _jax_cross_entropy, gpt_loss, jax_adamw_init, jax_adamw_update, new_adamw
from .training import _eager, _jax_trainer, spmd_trainer


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 4
    d_model: int = 256
    heads: int = 8  # query heads
    kv_heads: int = 2  # each serves heads // kv_heads query heads
    ffn: int = 768  # SwiGLU hidden size: Llama's 2/3 * 4 * d_model, rounded up to 256
    vocab: int = 1024
    seq: int = 256
    batch: int = 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


LLAMA_CFG = LlamaConfig()


def llama_data(cfg: LlamaConfig = LLAMA_CFG) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch of token ids and their next tokens, reused every step."""
    rng = np.random.RandomState(3)
    tokens = rng.randint(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1)).astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def rope_tables(cfg: LlamaConfig = LLAMA_CFG) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, (seq, head_dim) in float32, computed in float64 once
    so torch and JAX rotate by the same numbers. Halves layout: frequency i at i and i + hd/2."""
    hd = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.outer(np.arange(cfg.seq, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# PyTorch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.heads * hd, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    block = LlamaBlock  # the layer's class (the scan bench's carries its inputs through)

    def __init__(self, cfg: LlamaConfig = LLAMA_CFG) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(self.block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def new_llama() -> Llama:
    """The model with seed 0's weights: every implementation starts from them."""
    torch.manual_seed(0)
    return Llama()


# ------------------------------------------------------------------------------------------------
# JAX: the same math by hand, params keyed by the torch parameter names


def _jax_rms_norm(p: dict[str, Any], name: str, x: Any, eps: float) -> Any:
    import jax.numpy as jnp

    return x * (1.0 / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)) * p[name]


def _jax_rope(x: Any, cos: Any, sin: Any) -> Any:
    import jax.numpy as jnp

    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _jax_gqa_attention(p: dict[str, Any], name: str, x: Any, cos: Any, sin: Any) -> Any:
    """Causal attention; kv head j serves query heads j*g .. j*g+g-1 (g = heads // kv_heads)."""
    import jax
    import jax.numpy as jnp

    c = LLAMA_CFG
    b, t, _ = x.shape
    q = (x @ p[f"{name}.q_proj.weight"].T).reshape(b, t, c.heads, -1).transpose(0, 2, 1, 3)
    k = (x @ p[f"{name}.k_proj.weight"].T).reshape(b, t, c.kv_heads, -1).transpose(0, 2, 1, 3)
    v = (x @ p[f"{name}.v_proj.weight"].T).reshape(b, t, c.kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = _jax_rope(q, cos, sin), _jax_rope(k, cos, sin)
    group = c.heads // c.kv_heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(c.head_dim))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, -1)
    return y @ p[f"{name}.o_proj.weight"].T


def jax_llama_loss(p: dict[str, Any], idx: Any, tgt: Any) -> Any:
    import jax

    c = LLAMA_CFG
    t = idx.shape[1]
    cos, sin = (table[:t] for table in rope_tables(c))
    x = p["embed_tokens.weight"][idx]
    for i in range(c.layers):
        pre = f"layers.{i}"
        h = _jax_rms_norm(p, f"{pre}.input_layernorm.weight", x, c.norm_eps)
        x = x + _jax_gqa_attention(p, f"{pre}.self_attn", h, cos, sin)
        h = _jax_rms_norm(p, f"{pre}.post_attention_layernorm.weight", x, c.norm_eps)
        gate = jax.nn.silu(h @ p[f"{pre}.mlp.gate_proj.weight"].T)
        up = h @ p[f"{pre}.mlp.up_proj.weight"].T
        x = x + (gate * up) @ p[f"{pre}.mlp.down_proj.weight"].T
    logits = _jax_rms_norm(p, "norm.weight", x, c.norm_eps) @ p["lm_head.weight"].T
    return _jax_cross_entropy(logits.reshape(-1, c.vocab), tgt.reshape(-1))


# ------------------------------------------------------------------------------------------------
# Runners


def w6_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    return _eager(warmup, steps, check, gpu, new_llama(), new_adamw, gpt_loss, llama_data())


def w6_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    tr = _jax_trainer(jax_llama_loss, jax_adamw_init, jax_adamw_update, new_llama(), llama_data())
    return {**run_trainer(tr, warmup, steps, check), "device": str(jax.devices()[0])}


def w6_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import spmd_torch

    tr = spmd_trainer(new_llama(), new_adamw, gpt_loss, llama_data())
    result = harness.run_counting_fallbacks(tr, warmup, steps, check)
    return {**result, "device": str(spmd_torch.device())}


def w6_spmd_compile(
    warmup: int, steps: int, check: bool, gpu: bool, backend: str = compiled.BACKEND
) -> dict[str, Any]:
    return compiled.run(
        warmup, steps, check, new_llama(), new_adamw, gpt_loss, llama_data(), backend
    )
