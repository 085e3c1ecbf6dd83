"""A Llama-style decoder trained on a 2-D (fsdp x tensor) mesh, checkpointed, resumed elsewhere.

The model is plain PyTorch: ``nn.RMSNorm``, rotary position embeddings, a SwiGLU MLP and
grouped-query attention through ``F.scaled_dot_product_attention``. It is built on the meta device
(no memory anywhere), allocated on the xla device already split over the mesh and initialised
there, so no host ever holds a whole copy of the weights. Every weight matrix is split over both
mesh axes: Megatron-style over 'tensor' (q/k/v, gate and up by their output features, o and down
by their input features, so each tensor-parallel group needs one all-reduce per block), FSDP-style
over 'fsdp' along the other dimension; the batch is split over 'fsdp'. The layers run as one
``scan_layers`` loop (the program holds one layer, whatever the depth), each layer's activations
recomputed in the backward (per-layer gradient checkpointing); the forward runs under bf16
autocast; AdamW's state is laid out like its parameters, so it is split over all devices too.

With ``--ckpt DIR`` the run starts from the newest checkpoint in DIR, if any, on whatever mesh and
host count it is given, and saves its last step there (``CheckpointManager``: every host writes its
own shards). A checksum of every parameter and optimizer-state bit is saved with the checkpoint
and compared after a restore: the script exits non-zero unless the restore is bit-exact, the loss
falls, and the training loop compiles at most three programs: the layers' stacks (a few ops,
once per run), AdamW's state (its zeros, made in the first step and computed before it), then
the step every later step runs. A resumed run's state comes
with the checkpoint, one tensor per layer: its first step stacks it beside the layers' weights (a
small program), then compiles the step every later step runs. ``--check-eager N`` (small sizes only: it copies the weights to the host) also trains
a CPU copy for N steps in float32 and compares the losses.

Run, on one host with 8 virtual CPU devices, then resumed as 2 hosts of 4 on another mesh shape:

    python examples/llama_pod.py --ckpt /tmp/llama --steps 4 --mesh 2x4
    python -m spmd_torch.distributed.run --hosts 2 --devices-per-host 4 \\
        examples/llama_pod.py --ckpt /tmp/llama --steps 8 --mesh 4x2

``--size 1b`` is the real shape: TinyLlama-1.1B's (22 layers, d_model 2048, 32 query heads over
4 key/value heads, SwiGLU width 5632, vocabulary 32000, 2048-token sequences), 1.10B parameters.
Its float32 parameters, gradients and AdamW moments take 17.6 GB in all: 1.1 GB per chip of a TPU
v5e-16 (16 GB each; e.g. ``--mesh 4x4``), 2.2 GB per GPU of 8 H100s (80 GB each; ``--mesh 2x4``),
leaving the rest to activations (``docs/scale.md`` has the arithmetic).
"""

from __future__ import annotations

import os

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and (
    "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spmd_torch.core.auto_capture as auto_capture  # noqa: E402
import spmd_torch.core.xla_model as xm  # noqa: E402
import spmd_torch.debug.metrics as met  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.experimental.distributed_checkpoint as xc  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402
from spmd_torch.experimental.scan_layers import scan_layers  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    layers: int
    dim: int
    heads: int  # query heads
    kv_heads: int  # each serves heads // kv_heads query heads
    ffn: int  # SwiGLU hidden width
    vocab: int
    seq: int
    batch: int  # sequences per global batch
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SIZES = {
    # Fast on 8 virtual CPU devices; every split dimension divides by 4 on either mesh axis.
    "small": LlamaConfig(
        layers=2, dim=128, heads=8, kv_heads=4, ffn=384, vocab=512, seq=64, batch=8
    ),
    # TinyLlama-1.1B's shape.
    "1b": LlamaConfig(
        layers=22, dim=2048, heads=32, kv_heads=4, ffn=5632, vocab=32000, seq=2048, batch=8
    ),
}


# ------------------------------------------------------------------------------------------------
# The model: plain PyTorch modules, nothing spmd_torch-specific


def rotary_tables(length: int, cfg: LlamaConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (length, head_dim), computed where the
    model runs (no buffers: nothing to fill in after building on the meta device)."""
    half = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta**half
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the rotate-half form: frequency i acts on features i and i + hd/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """The rotary tables come back out with the hidden state, so layers chain as they are."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x)), cos, sin


def run_in_loop(layers: nn.ModuleList, inputs: tuple) -> tuple:
    for layer in layers:
        inputs = layer(*inputs)
    return inputs


def run_scanned(layers: nn.ModuleList, inputs: tuple) -> tuple:
    """The layers as one scan over their stacked weights (the program holds one layer, whatever
    the depth), each keeping only its input for the backward, which recomputes the rest."""
    return scan_layers(layers, inputs, partition_fn=jax.checkpoint_policies.nothing_saveable)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, run_layers: Callable = run_in_loop) -> None:
        super().__init__()
        self.cfg = cfg
        self.run_layers = run_layers
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(tokens.shape[1], self.cfg, tokens.device)
        x, _, _ = self.run_layers(self.layers, (self.embed_tokens(tokens), cos, sin))
        return self.lm_head(self.norm(x))


@torch.no_grad()
def init_weights(parameters) -> None:
    """Llama's initialisation, in place: N(0, 0.02) matrices, unit norm scales."""
    for param in parameters:
        if param.dim() == 2:
            nn.init.normal_(param, std=0.02)
        else:
            nn.init.ones_(param)


# ------------------------------------------------------------------------------------------------
# Sharding and building

# nn.Linear weights are [out, in] and nn.Embedding's [vocab, dim]. Column-parallel matrices split
# their output features over 'tensor', row-parallel ones their input features; 'fsdp' splits the
# other dimension. RMSNorm scales (1-D, tiny) stay replicated.
MEGATRON_SPECS = {
    "embed_tokens.weight": ("tensor", "fsdp"),
    "q_proj.weight": ("tensor", "fsdp"),
    "k_proj.weight": ("tensor", "fsdp"),
    "v_proj.weight": ("tensor", "fsdp"),
    "o_proj.weight": ("fsdp", "tensor"),
    "gate_proj.weight": ("tensor", "fsdp"),
    "up_proj.weight": ("tensor", "fsdp"),
    "down_proj.weight": ("fsdp", "tensor"),
    "lm_head.weight": ("tensor", "fsdp"),
}


def shard(model: Llama, mesh: xs.Mesh) -> None:
    """Mark every weight matrix with its split; one without a rule is an error, not replicated."""
    for name, param in model.named_parameters():
        if param.dim() == 1:
            continue
        rule = ".".join(name.split(".")[-2:])
        if rule not in MEGATRON_SPECS:
            raise ValueError(f"shard: no partition spec for {name} {tuple(param.shape)}")
        xs.mark_sharding(param, mesh, MEGATRON_SPECS[rule])


def build_sharded(
    cfg: LlamaConfig, mesh: xs.Mesh, run_layers: Callable = run_scanned, initialise: bool = True
) -> Llama:
    """The model built on the meta device, allocated on the xla device under its shardings and
    initialised there: each device only ever holds its own shards. Each layer is initialised by
    one program (compiled once, run per layer), so the random numbers in flight are one layer's.
    Without ``initialise`` the weights are left for a checkpoint restore to fill."""
    with torch.device("meta"):
        model = Llama(cfg, run_layers)
    model.to_empty(device=xm.xla_device())
    shard(model, mesh)
    if initialise:
        xm.mark_step()  # the allocations apart: then every layer's program is the same one
        for layer in model.layers:
            init_weights(layer.parameters())
            xm.mark_step()
        init_weights(p for name, p in model.named_parameters() if not name.startswith("layers."))
        xm.mark_step()
    return model


def make_mesh(shape: str) -> xs.Mesh:
    """'FxT': F-way 'fsdp' by T-way 'tensor' over every device of the job, hosts in order, so the
    'tensor' axis (the chattier one) stays inside a host."""
    fsdp, tensor = (int(n) for n in shape.split("x"))
    devices = xr.global_runtime_device_count()
    if fsdp * tensor != devices:
        raise SystemExit(f"--mesh {shape} needs {fsdp * tensor} devices; the job has {devices}")
    return xs.Mesh(np.arange(devices), (fsdp, tensor), ("fsdp", "tensor"))


# ------------------------------------------------------------------------------------------------
# Training


def batch(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch every step trains on, the same on every host and in every run (the model
    memorises it, so the loss falls within a few steps): sequences counting up by a stride of
    their own, mod the vocabulary."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=generator)
    stride = torch.randint(1, 8, (cfg.batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return tokens[:, :-1], tokens[:, 1:]


def new_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def train_step(model, optimizer, tokens, targets, bf16: bool) -> torch.Tensor:
    optimizer.zero_grad()
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def checksum(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every bit of the parameters and of the optimizer state (float32), as one integer: the
    bits times their flat positions, summed in wrapping int64 arithmetic, so it is the same
    whatever the mesh (integer sums have no rounding) and changes when any bit moves or flips.
    Tensors of one shape are added up first and weighed once (the same integer: a sum of
    products with one weight each is the product of the sum), a program a third the size."""
    device = xm.xla_device()
    by_shape: dict[torch.Size, torch.Tensor] = {}
    for param in model.parameters():
        state = optimizer.state.get(param, {})
        for tensor in (param, *(state[key] for key in sorted(state))):
            bits = tensor.detach().to(device).view(torch.int32).to(torch.int64)
            if tensor.shape in by_shape:
                bits = bits + by_shape[tensor.shape]
            by_shape[tensor.shape] = bits
    weighed = [(bits * flat_positions(shape, device)).sum() for shape, bits in by_shape.items()]
    return int(torch.stack(weighed).sum().item())


def flat_positions(shape: torch.Size, device) -> torch.Tensor:
    """1 + each element's row-major position, as a sum of one small range per dimension: it
    broadcasts to ``shape`` without being flattened, so it splits like the tensor it weighs (a
    flattened one would be gathered whole onto every device)."""
    positions, stride = torch.ones((), dtype=torch.int64, device=device), 1
    for dim in reversed(range(len(shape))):
        along = [1] * len(shape)
        along[dim] = shape[dim]
        positions = positions + torch.arange(shape[dim], device=device).view(along) * stride
        stride *= shape[dim]
    return positions


def eager_losses(model: Llama, steps: int) -> list[float]:
    """The first ``steps`` losses of a CPU copy of ``model`` trained eagerly in float32."""
    reference = Llama(model.cfg)
    reference.load_state_dict({name: t.cpu() for name, t in model.state_dict().items()})
    optimizer = new_optimizer(reference)
    return [
        train_step(reference, optimizer, *batch(model.cfg), bf16=False).item() for _ in range(steps)
    ]


def train(model: Llama, optimizer, mesh: xs.Mesh, steps: range, bf16: bool, say) -> list[float]:
    """Train ``steps``, each batch split over 'fsdp'; the losses."""
    losses = []
    for step in steps:
        tokens, targets = (t.to(xm.xla_device()) for t in batch(model.cfg))
        xs.mark_sharding(tokens, mesh, ("fsdp", None))
        xs.mark_sharding(targets, mesh, ("fsdp", None))
        started = time.perf_counter()
        loss = train_step(model, optimizer, tokens, targets, bf16)
        xm.mark_step()
        losses.append(loss.item())
        say(f"step {step} loss {losses[-1]:.9e} ({time.perf_counter() - started:.1f}s)")
    return losses


def save(manager: xc.CheckpointManager, step: int, model: Llama, optimizer) -> int:
    """Checkpoint ``step`` with the checksum of what it saves; the checksum."""
    total = checksum(model, optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "checksum": total}
    manager.save(step, state, force=True)
    return total


def restore(manager: xc.CheckpointManager, step: int, model: Llama, optimizer) -> tuple[int, int]:
    """Fill the model and the fresh optimizer from checkpoint ``step``, each device reading its
    own shards; (the checksum saved with it, the checksum of what was restored)."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "checksum": 0}
    manager.restore(step, state)
    optimizer.load_state_dict(state["optim"])
    return state["checksum"], checksum(model, optimizer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    for field in ("layers", "seq", "batch"):
        parser.add_argument(f"--{field}", type=int, help=f"override the size's {field}")
    parser.add_argument("--mesh", default="2x4", help="'fsdp'x'tensor' sizes, e.g. 4x2")
    parser.add_argument("--steps", type=int, default=6, help="train up to this step count")
    parser.add_argument("--ckpt", metavar="DIR", help="resume from and save to this directory")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--check-eager", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.check_eager and args.precision != "fp32":
        parser.error("--check-eager compares float32 losses: pass --precision fp32")
    overrides = {f: getattr(args, f) for f in ("layers", "seq", "batch") if getattr(args, f)}
    cfg = dataclasses.replace(SIZES[args.size], **overrides)
    master = xm.is_master_ordinal(local=False)

    def say(line: str) -> None:
        if master:
            print(line, flush=True)

    xr.use_spmd()
    mesh = make_mesh(args.mesh)
    manager = xc.CheckpointManager(args.ckpt, save_interval=1) if args.ckpt else None
    resume = max(manager.all_steps()) if manager is not None and manager.all_steps() else None
    if args.check_eager and resume is not None:
        parser.error(f"--check-eager compares a fresh run; {args.ckpt} holds step {resume}")
    started = time.perf_counter()
    model = build_sharded(cfg, mesh, initialise=resume is None)
    optimizer = new_optimizer(model)
    parameters = sum(p.numel() for p in model.parameters())
    say(
        f"{args.size}: {parameters:,} parameters, mesh {dict(mesh.shape())} over "
        f"{xr.process_count()} host(s), built sharded in {time.perf_counter() - started:.1f}s"
    )
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight"):
        say(f"  {name} {xs.get_xla_sharding_spec(model.get_parameter(name))}")

    failures = []
    expected = eager_losses(model, args.check_eager) if args.check_eager else []
    start = 0
    if resume is not None:
        saved, restored = restore(manager, resume, model, optimizer)
        say(f"resumed from step {resume}: checksum {restored:#x}, bit-exact {restored == saved}")
        if restored != saved:
            failures.append(f"restored checksum {restored:#x}, saved {saved:#x}")
        start = resume + 1

    met.clear_all()
    losses = train(model, optimizer, mesh, range(start, args.steps), args.precision == "bf16", say)
    compiles = met.counter_value("UncachedCompile") or 0
    say(f"training compilations {compiles}")
    for step, want in enumerate(expected):
        error = abs(losses[step] - want) / abs(want)
        say(f"eager cpu step {step} loss {want:.9e} relative difference {error:.1e}")
        if error > 1e-5:
            failures.append(f"step {step}: loss {losses[step]} here, {want} on eager CPU")
    if manager is not None and args.steps > start:
        total = save(manager, args.steps - 1, model, optimizer)
        say(f"saved step {args.steps - 1}: checksum {total:#x}")

    if len(losses) > 1 and not losses[-1] < losses[0]:
        failures.append(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    # The layers' stacks, then the step every step runs (AdamW's moments filled on the host);
    # automatic capture (SPMD_TORCH_AUTO_CAPTURE=1) compiles the step once more when it starts,
    # and one small program stacking the optimizer's step counters.
    limit = 4 if auto_capture.enabled() else 2
    if compiles > limit:
        failures.append(f"{compiles} compilations in the training loop, expected at most {limit}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
