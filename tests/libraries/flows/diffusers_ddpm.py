"""A diffusers pipeline built from randomly initialised components (a tiny UNet and the DDPM
scheduler), run on the device: diffusers marks each denoising step itself when it sees torch_xla."""

from __future__ import annotations

import torch
from _common import compiles, report
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel


def main() -> None:
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    )  # fmt: skip
    scheduler = DDPMScheduler(num_train_timesteps=10, variance_type="fixed_small")
    pipeline = DDPMPipeline(unet=unet, scheduler=scheduler)
    try:
        import torch_xla

        device = torch_xla.device()
    except ImportError:
        device = torch.device("cpu")
    pipeline.to(device)
    noise = torch.Generator().manual_seed(1)  # the same noise on both runs
    images = pipeline(batch_size=2, generator=noise, num_inference_steps=10, output_type="np")
    report(device=str(device), image=images.images.tolist(), compiles=compiles())


main()
