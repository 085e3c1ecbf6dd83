"""Wscan4, Wscan16, Wscan64: depth against trace, compile and step time, with and without a scan.

A Llama-style decoder (W6's block at width 128: 4 query heads, 2 kv heads, SwiGLU 384, vocab 512,
seq 64, batch 2) trained with W3's AdamW, 4, 16 or 64 layers deep, four ways: ``spmd_torch``
(``for layer in layers``), ``spmd_scan`` (``scan_layers`` with ``is_layer_pure=True``: the block
is pure, so its recording is replayed after the first step, as PyTorch/XLA's tracing cache
does), ``jax`` (a Python loop inside ``jax.jit``) and ``jax_scan`` (``lax.scan`` over
parameters stored stacked). Each (depth,
implementation) runs in a child of its own, so its first step pays for all of its own tracing
and compiling.

Figures: ``trace_s``, the first step's tracing (spmd_torch: recording the step's ops; JAX: its
jaxpr); ``compile_s``, the first step's compile (spmd_torch: CompileTime, which lowers the graph to
JAX, then StableHLO, then XLA; JAX: lowering and XLA); ``first_s``, the first step's wall time
(trace, compile, run, wait; the optimizer's state made in it: torch.optim makes it inside the first
step, so JAX's anchor makes its own inside the clock too, ``init_s`` of it); ``second_s`` (until
b5d3400 spmd_torch's second step compiled a program of its own, reading the optimizer state its
first step made); ``step_ms``, the median of the blocked steps after the warm-up; ``pipelined_ms``,
as many steps again issued back to back, one wait at the end (as a training loop runs them:
spmd_torch traces a step while the last one runs). Targets (issue 33): spmd_scan's first step at
64 layers at most 1.5x its first step at 4; at 16 layers its steady step at least 0.9x as fast as
spmd_torch's and as jax_scan's.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import harness
from .llama import Llama, LlamaBlock, LlamaConfig, _jax_rms_norm, _jax_rope, rope_tables
from .models import _jax_cross_entropy, jax_adamw_init, jax_adamw_update, jax_train_step, new_adamw

CFG = LlamaConfig(d_model=128, heads=4, kv_heads=2, ffn=384, vocab=512, seq=64, batch=2)
DEPTHS = (4, 16, 64)
WORKLOADS = tuple(f"Wscan{n}" for n in DEPTHS)
IMPLS = ("jax", "jax_scan", "spmd_torch", "spmd_scan")
TARGETS = {"first_64_over_4": 1.5, "speed_at_16": 0.9}


class Block(LlamaBlock):
    """A Llama block whose output is its next input, (x, cos, sin): a scanned layer's carry."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        return super().forward(x, cos, sin), cos, sin


class Decoder(Llama):
    block = Block

    def __init__(self, cfg: LlamaConfig, scanned: bool) -> None:
        super().__init__(cfg)
        self.scanned = scanned

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from spmd_torch.experimental.scan_layers import scan_layers

        carry = (self.embed_tokens(idx), self.cos, self.sin)
        if self.scanned:
            carry = scan_layers(self.layers, carry, is_layer_pure=True)
        else:
            for layer in self.layers:
                carry = layer(*carry)
        return self.lm_head(self.norm(carry[0]))


def _new_decoder(cfg: LlamaConfig, scanned: bool) -> Decoder:
    """Seed 0's weights: every implementation starts from them."""
    torch.manual_seed(0)
    return Decoder(cfg, scanned)


def _data(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.RandomState(3).randint(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1))
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def _timed(first: dict[str, Any], issue, wait, warmup: int, steps: int, check: bool) -> dict:
    """The first step's figures, then the warm-up and the timed steps, each ``issue()``d (it
    returns the loss) and waited for, then as many again pipelined (one wait at the end); under
    --check, the losses of every step."""
    losses, times = [first.pop("loss")], [first["first_s"]]
    for _ in range(steps - 1 if check else max(warmup, 2) - 1 + steps):
        start = harness.now()
        losses.append(float(issue()))
        times.append(harness.now() - start)
    if check:
        return {"losses": losses}
    start = harness.now()
    for _ in range(steps):
        issue()
    wait()
    return {
        **first,
        "second_s": times[1],
        "step_ms": 1e3 * statistics.median(times[max(warmup, 2) :]),
        "pipelined_ms": 1e3 * (harness.now() - start) / steps,
    }


def run_spmd(warmup: int, steps: int, check: bool, gpu: bool, *, layers: int, scanned: bool):
    import spmd_torch
    import spmd_torch.core.xla_model as xm
    import spmd_torch.debug.metrics as met

    cfg = replace(CFG, layers=layers)
    dev = spmd_torch.device()
    model = _new_decoder(cfg, scanned).to(dev)
    optimizer = new_adamw(model)
    idx, tgt = (torch.from_numpy(a).to(dev) for a in _data(cfg))
    spmd_torch.sync()
    xm.wait_device_ops()

    def traced() -> torch.Tensor:
        loss = F.cross_entropy(model(idx).reshape(-1, cfg.vocab), tgt.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def issue() -> torch.Tensor:
        loss = traced()
        spmd_torch.sync()
        return loss

    def compile_ns() -> float:
        data = met.metric_data("CompileTime")
        return 0.0 if data is None else data[1]

    start, compiled = harness.now(), compile_ns()
    loss = traced()
    trace_s = harness.now() - start
    spmd_torch.sync()
    first = {"loss": loss.item(), "first_s": harness.now() - start, "trace_s": trace_s}
    first["compile_s"] = (compile_ns() - compiled) / 1e9
    result = _timed(first, issue, xm.wait_device_ops, warmup, steps, check)
    return {**result, "compiles": harness.spmd_compiles(), "device": str(dev)}


def _jax_block(p: dict, x: Any, cos: Any, sin: Any, cfg: LlamaConfig) -> Any:
    """One layer (``p``: its parameters by their names inside the layer), as ``LlamaBlock``."""
    import jax
    import jax.numpy as jnp

    b, t, _ = x.shape
    h = _jax_rms_norm(p, "input_layernorm.weight", x, cfg.norm_eps)

    def heads(name: str, n: int) -> Any:
        return (h @ p[f"self_attn.{name}.weight"].T).reshape(b, t, n, -1).transpose(0, 2, 1, 3)

    q, k, v = (
        heads("q_proj", cfg.heads),
        heads("k_proj", cfg.kv_heads),
        heads("v_proj", cfg.kv_heads),
    )
    group = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(_jax_rope(k, cos, sin), group, axis=1), jnp.repeat(v, group, axis=1)
    att = (_jax_rope(q, cos, sin) @ k.transpose(0, 1, 3, 2)) / np.sqrt(cfg.head_dim)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf), axis=-1)
    x = x + (att @ v).transpose(0, 2, 1, 3).reshape(b, t, -1) @ p["self_attn.o_proj.weight"].T
    h = _jax_rms_norm(p, "post_attention_layernorm.weight", x, cfg.norm_eps)
    gate = jax.nn.silu(h @ p["mlp.gate_proj.weight"].T)
    return x + (gate * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T


def run_jax(warmup: int, steps: int, check: bool, gpu: bool, *, layers: int, scanned: bool):
    import jax
    import jax.numpy as jnp

    cfg = replace(CFG, layers=layers)
    weights = {
        k: jnp.asarray(v.detach().numpy()) for k, v in _new_decoder(cfg, False).named_parameters()
    }
    inside = [k[len("layers.0.") :] for k in weights if k.startswith("layers.0.")]
    layer_params = [{n: weights[f"layers.{i}.{n}"] for n in inside} for i in range(layers)]
    params = {k: v for k, v in weights.items() if not k.startswith("layers.")}
    params["layers"] = (
        jax.tree.map(lambda *w: jnp.stack(w), *layer_params) if scanned else (layer_params)
    )
    cos, sin = (jnp.asarray(t) for t in rope_tables(cfg))

    def loss_fn(p: dict, idx: Any, tgt: Any) -> Any:
        x = p["embed_tokens.weight"][idx]
        if scanned:
            x = jax.lax.scan(lambda x, w: (_jax_block(w, x, cos, sin, cfg), None), x, p["layers"])[
                0
            ]
        else:
            for w in p["layers"]:
                x = _jax_block(w, x, cos, sin, cfg)
        logits = _jax_rms_norm(p, "norm.weight", x, cfg.norm_eps) @ p["lm_head.weight"].T
        return _jax_cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))

    batch = [jnp.asarray(a.astype(np.int32)) for a in _data(cfg)]
    jax.block_until_ready((params, batch))
    # The optimizer's state is made inside the clock, as torch.optim makes it inside the first
    # step: both first steps start from the same parameters on the device.
    start = harness.now()
    state = {"params": params, "opt": jax.block_until_ready(jax_adamw_init(params))}
    init_s = harness.now() - start
    traced = jax_train_step(loss_fn, jax_adamw_update).trace(state["params"], state["opt"], *batch)
    trace_s = harness.now() - start - init_s
    train_step = traced.lower().compile()
    compile_s = harness.now() - start - init_s - trace_s

    def issue() -> Any:
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], *batch)
        return loss

    first = {"loss": float(issue()), "first_s": harness.now() - start, "trace_s": trace_s}
    first.update(compile_s=compile_s, init_s=init_s)
    result = _timed(first, issue, lambda: jax.block_until_ready(state), warmup, steps, check)
    return {**result, "compiles": 1, "device": str(jax.devices()[0])}


RUNNERS = {
    (f"Wscan{n}", impl): partial(
        run_jax if impl.startswith("jax") else run_spmd, layers=n, scanned=impl.endswith("scan")
    )
    for n in DEPTHS
    for impl in IMPLS
}


def _speed(results: dict, than: str, what: str) -> float | None:
    """How fast spmd_scan's steps (``what``: blocked or pipelined ms) are against ``than``'s
    (>1: faster)."""
    a, b = (results.get(i, {}).get(what) for i in ("spmd_scan", than))
    return None if a is None or b is None else b / a


_STEPS = {"step_ms": "blocked", "pipelined_ms": "pipelined"}


def report(workload: str, results: dict, table: Any) -> dict[str, Any]:
    """A workload's table (``table(headers, rows)`` prints it) and spmd_scan's speed ratios."""
    figures = ("trace_s", "compile_s", "init_s", "first_s", "second_s", "step_ms", "pipelined_ms")
    headers = ["impl", "trace s", "compile s", "state init s", "first step s", "second step s"]
    headers += ["step ms", "pipelined ms"]
    rows = []
    for label, r in results.items():
        shown = [f"{r[f]:.2f}" if f in r else "-" for f in figures]
        rows.append([label, *(["error", *[""] * 6] if "error" in r else shown)])
    layers = int(workload[len("Wscan") :])
    print(f"\n{workload} Llama {layers}L d{CFG.d_model} seq{CFG.seq} batch {CFG.batch}, AdamW")
    print(table(headers, rows))
    ratios = {}
    for than in ("spmd_torch", "jax_scan", "jax"):
        target = TARGETS["speed_at_16"] if layers == 16 and than != "jax" else None
        for what in ("step_ms", "pipelined_ms"):
            ratios[f"spmd_scan_over_{than}_{what}"] = value = _speed(results, than, what)
            shown = "-" if value is None else f"{value:.2f}x"
            print(
                f"  spmd_scan's speed over {than}'s, {_STEPS[what]} steps: {shown}"
                + ("" if target is None else f" (target ≥ {target}x)")
            )
    return ratios


def report_depths(results: dict) -> dict[str, float | None]:
    """Each implementation's first step at 64 layers over its first step at 4 (both must have
    run: --workloads Wscan4,Wscan64); the target is spmd_scan's."""
    if not all(w in results for w in (WORKLOADS[0], WORKLOADS[-1])):
        return {}
    growth = {}
    print(f"\nfirst step at {DEPTHS[-1]} layers over {DEPTHS[0]} (median of the rounds):")
    for impl in IMPLS:
        a, b = (_first_s(results[w], impl) for w in (WORKLOADS[-1], WORKLOADS[0]))
        growth[impl] = None if a is None or b is None else a / b
        shown = "-" if growth[impl] is None else f"{growth[impl]:.2f}x"
        most = TARGETS["first_64_over_4"]
        print(f"  {impl}: {shown}" + (f" (target ≤ {most}x)" if impl == "spmd_scan" else ""))
    return growth


def _first_s(entry: dict, impl: str) -> float | None:
    values = [r.get(impl, {}).get("first_s") for r in entry.get("rounds", [entry])]
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
