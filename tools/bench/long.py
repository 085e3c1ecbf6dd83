"""Wlong: a Llama-style decoder trained at a sequence that plain attention cannot fit.

W6's model (llama.py: ``nn.RMSNorm``, rotary embeddings, SwiGLU, grouped-query attention through
``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``) at 8 layers, d_model
2048, 32 query heads of 64 and 8 key/value heads, SwiGLU 5632, vocab 32000, seq 8192, batch 4
(about 490M parameters), the forward under bfloat16 autocast, W3's AdamW on float32 parameters and
state. Plain attention keeps each layer's probabilities for the backward, batch x heads x seq x seq
in bfloat16: 17.2 GB a layer, 137 GB for the eight, more than an H100 or H200 holds beside the rest
of the step; a fused kernel keeps one float32 log-sum-exp per row instead (4 MB a layer).
Implementations: eager PyTorch on CUDA (its SDPA picks its own kernel), hand-written JAX twice
(``jax``: cuDNN's fused attention; ``jax_plain``: XLA's plain attention, whose row says "out of
memory" where the device runs out), spmd_torch lazy and with automatic capture (``spmd_capture``,
opt-in), whose attention lowers to cuDNN's kernel on NVIDIA GPUs (docs/performance-log.md, "Attention
as one op each way").
Figures: ms/step, tokens/s, peak device memory, the loss before and after (it trains).

Wlong runs only with --gpu; ``--tiny`` runs a small config anywhere (a smoke test of every
implementation end to end, the CPU's attention where there is no GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from . import harness
from .gpu import AUTOCAST_DTYPE, cudnn_skip, torch_device
from .harness import run_trainer
from .llama import Llama, LlamaConfig, _jax_rms_norm, _jax_rope, llama_data, rope_tables
from .models import _jax_cross_entropy, gpt_loss, jax_adamw_init, jax_adamw_update, new_adamw
from .training import _eager, _jax_trainer, spmd_trainer

LONG_GPU = LlamaConfig(
    layers=8, d_model=2048, heads=32, kv_heads=8, ffn=5632, vocab=32000, seq=8192, batch=4
)
LONG_TINY = LlamaConfig(
    layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=128, batch=2
)


def config(tiny: bool) -> LlamaConfig:
    return LONG_TINY if tiny else LONG_GPU


def new_model(cfg: LlamaConfig) -> Llama:
    """Seed 0's weights: every implementation starts from them."""
    torch.manual_seed(0)
    return Llama(cfg)


def _info(cfg: LlamaConfig, model: torch.nn.Module, device: str) -> dict[str, Any]:
    return {
        "config": "tiny" if cfg == LONG_TINY else "gpu",
        "tokens_per_step": cfg.batch * cfg.seq,
        "params": sum(p.numel() for p in model.parameters()),
        "device": device,
    }


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device running out of memory (torch's or XLA's words for it)."""
    text = f"{type(error).__name__}: {error}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _guarded(run, *args: Any) -> dict[str, Any]:
    """``run(*args)``, or where the device ran out of memory, a row saying so (the outcome the
    workload expects of plain attention) instead of a failure."""
    try:
        return run(*args)
    except Exception as error:
        if not out_of_memory(error):
            raise
        return {"out_of_memory": str(error).strip().splitlines()[0][:300]}


# ------------------------------------------------------------------------------------------------
# JAX: the same math by hand, with autocast's dtypes written out


def jax_long_loss(cfg: LlamaConfig, implementation: str) -> Any:
    """The loss as bfloat16 autocast runs the torch model: linear layers and attention take
    bfloat16 operands; embeddings, the residual stream, RMSNorms, the rotary products (bfloat16
    times float32 tables) and the loss are float32. Attention through
    ``jax.nn.dot_product_attention`` with ``implementation`` ('cudnn' or 'xla'), whose grouped
    key/value heads serve their query heads as ``enable_gqa`` does."""
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16
    cos, sin = (jnp.asarray(t)[:, None, :] for t in rope_tables(cfg))  # (seq, 1, head_dim)

    def linear(p: dict[str, Any], name: str, x: Any) -> Any:
        return x.astype(bf16) @ p[f"{name}.weight"].astype(bf16).T

    def attention(p: dict[str, Any], pre: str, x: Any) -> Any:
        b, t, _ = x.shape

        def heads(name: str, n: int) -> Any:  # (b, t, n, head_dim): JAX's layout
            return linear(p, f"{pre}.{name}", x).reshape(b, t, n, cfg.head_dim)

        q, k, v = (
            heads("q_proj", cfg.heads),
            heads("k_proj", cfg.kv_heads),
            heads("v_proj", cfg.kv_heads),
        )
        q, k = (_jax_rope(a, cos[:t], sin[:t]).astype(bf16) for a in (q, k))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return linear(p, f"{pre}.o_proj", y.reshape(b, t, -1))

    def loss(p: dict[str, Any], idx: Any, tgt: Any) -> Any:
        x = p["embed_tokens.weight"][idx]
        for i in range(cfg.layers):
            pre = f"layers.{i}"
            h = _jax_rms_norm(p, f"{pre}.input_layernorm.weight", x, cfg.norm_eps)
            x = x + attention(p, f"{pre}.self_attn", h)
            h = _jax_rms_norm(p, f"{pre}.post_attention_layernorm.weight", x, cfg.norm_eps)
            gate = jax.nn.silu(linear(p, f"{pre}.mlp.gate_proj", h))
            x = x + linear(p, f"{pre}.mlp.down_proj", gate * linear(p, f"{pre}.mlp.up_proj", h))
        logits = linear(p, "lm_head", _jax_rms_norm(p, "norm.weight", x, cfg.norm_eps))
        return _jax_cross_entropy(
            logits.astype(jnp.float32).reshape(-1, cfg.vocab), tgt.reshape(-1)
        )

    return loss


# ------------------------------------------------------------------------------------------------
# Runners


def _eager_run(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    torch_device(gpu, "Wlong eager")
    cfg = config(tiny)
    model = new_model(cfg)
    data = llama_data(cfg)
    result = _eager(warmup, steps, check, gpu, model, new_adamw, gpt_loss, data, AUTOCAST_DTYPE)
    return {**result, **_info(cfg, model, result["device"])}


def _jax_run(warmup: int, steps: int, check: bool, tiny: bool, implementation: str):
    import jax

    cfg = config(tiny)
    model = new_model(cfg)
    loss = jax_long_loss(cfg, implementation)
    tr = _jax_trainer(loss, jax_adamw_init, jax_adamw_update, model, llama_data(cfg))
    info = _info(cfg, model, str(jax.devices()[0]))
    return {**run_trainer(tr, warmup, steps, check), **info, "attention": implementation}


def _spmd_run(warmup: int, steps: int, check: bool, tiny: bool) -> dict[str, Any]:
    import spmd_torch

    cfg = config(tiny)
    model = new_model(cfg)
    tr = spmd_trainer(model, new_adamw, gpt_loss, llama_data(cfg), autocast_dtype=AUTOCAST_DTYPE)
    result = harness.run_counting_fallbacks(tr, warmup, steps, check)
    return {**result, **_info(cfg, model, str(spmd_torch.device()))}


def wlong_eager(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return _guarded(_eager_run, warmup, steps, check, gpu, tiny)


def wlong_jax(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """Attention through cuDNN's fused kernel (skipped where JAX has no CUDA device)."""
    return cudnn_skip() or _guarded(_jax_run, warmup, steps, check, tiny, "cudnn")


def wlong_jax_plain(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """XLA's plain attention: out of memory at the GPU size, which its row says."""
    return _guarded(_jax_run, warmup, steps, check, tiny, "xla")


def wlong_spmd(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    """spmd_torch's lazy loop (spmd_capture: the same, with automatic capture on)."""
    return _guarded(_spmd_run, warmup, steps, check, tiny)


def sizes(cfg: LlamaConfig, params: int | None) -> str:
    """The config in a report's title."""
    shown = "-" if params is None else f"{params / 1e6:.0f}M"
    return (
        f"{cfg.layers}L d{cfg.d_model} {cfg.heads}H/{cfg.kv_heads}KV ffn {cfg.ffn} vocab "
        f"{cfg.vocab}, {shown} params, seq {cfg.seq} batch {cfg.batch}"
    )
