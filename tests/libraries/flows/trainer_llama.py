"""transformers' Trainer on a tiny randomly initialised Llama: train, evaluate, save. With
``fsdp`` as argument, its FSDPv2 path (``fsdp_config`` with ``xla`` and ``xla_fsdp_v2``) over an
8-device mesh, as its docs set it up: ``xr.use_spmd()`` and a global mesh with an ``fsdp`` axis."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from _common import captured, compiles, report
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CompilesPerStep(TrainerCallback):
    def __init__(self) -> None:
        self.counts = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.counts.append(compiles())


class FsdpXlaTrainer(Trainer):
    """transformers 5.x delays creating the optimizer on its FSDP-XLA path and then never creates
    it for the wrapped model (the scheduler gets None); create it first, as 4.x did."""

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.optimizer is None:
            self.create_optimizer()
        return super().create_scheduler(num_training_steps, optimizer)


def fsdp_setup() -> dict:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    xs.set_global_mesh(xs.Mesh(np.arange(n), (n, 1), ("fsdp", "tensor")))
    config = {
        "xla": True,
        "xla_fsdp_v2": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    }
    return {"fsdp": "full_shard", "fsdp_config": config}


def main(fsdp: bool) -> None:
    set_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    out = tempfile.mkdtemp()
    args = TrainingArguments(
        output_dir=out, max_steps=5, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_drop_last=True, train_sampling_strategy="sequential",
        **(fsdp_setup() if fsdp else {}),
    )  # fmt: skip
    counter = CompilesPerStep()
    trainer = (FsdpXlaTrainer if fsdp else Trainer)(
        model=model, args=args, train_dataset=Tokens(48, 3), eval_dataset=Tokens(16, 4),
        callbacks=[counter],
    )  # fmt: skip
    trainer.train()
    evaluation = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    sharding = ""
    if fsdp:
        import torch_xla.distributed.spmd as xs

        weight = trainer.model.module.model.layers[0].mlp.up_proj.weight
        sharding = xs.get_xla_sharding_spec(weight)
    report(
        device=str(args.device),
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        eval_loss=evaluation["eval_loss"],
        saved=sorted(os.listdir(os.path.join(out, "final"))),
        compiles_per_step=counter.counts,
        sharding=sharding,
        captured=captured(),
    )


main(fsdp="fsdp" in sys.argv[1:])
