"""torch_xla._internal: the internal modules libraries and PyTorch/XLA's tests reach into.

``tpu`` answers what TPU hardware this host has (from JAX's devices and the TPU environment
variables); ``pjrt`` runs a function on every local device's replica (the multiprocessing
emulation of ``spmd_torch.distributed.xla_multiprocessing``). Import them as submodules:
``from spmd_torch._internal import pjrt, tpu``.
"""
