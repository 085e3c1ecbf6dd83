"""Every Python block of the five seed guides (PyTorch/XLA's public guides: 000 GPU->TPU
migration, 001 PyTorch on XLA devices, 002 performance, 003 overview, 004 lazy tensor core), as a
new user runs it: imports renamed (``torch_xla`` -> ``spmd_torch``; ``torch_xla_py.xla_model``,
``lazy_tensor_core.core.lazy_model``... -> the modules the migration table names, which
``run_as_torch_xla`` gives those names), the guides' typos fixed (docs/migration.md lists them),
what a block leaves undefined defined, and sizes shrunk. Each checks its result against eager CPU
PyTorch with the same seed and weights. Test ids name the guide and block: ``g001-b04`` is the
fourth Python block of guide 001.

000 b08 is examples/mnist_mp.py's ``_mp_mnist_fn`` (the guide's code), run here on a smaller
network; 001's pod section runs that script on two hosts through the local launcher. Not here: the
blocks that are only comments (000 b11-b13), the CUDA code the guides replace (000 b01, b03, b05;
003 b04), and 003 b06 (``pipe.to(device)`` on a diffusers pipeline, which
tests/libraries/test_libraries.py::test_diffusers_pipeline runs).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn, optim

import spmd_torch
import spmd_torch.core.lazy_model as ltm  # lazy_tensor_core.core.lazy_model
import spmd_torch.core.xla_model as xm  # torch_xla.core.xla_model, torch_xla_py.xla_model
import spmd_torch.debug.graph as graph
import spmd_torch.distributed.legacy_data_parallel as dp  # torch_xla_py.data_parallel
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
import spmd_torch.utils.serialization as xser  # lazy_tensor_core.utils.serialization too
from spmd_torch.amp import autocast, syncfree
from tests.helpers import (
    ROOT,
    assert_close,
    assert_compiles,
    assert_counter_delta,
    load_example,
    tolerance,
)
from tests.xla_codegen import child_flags


def small_mnist() -> nn.Module:
    """The guides' MNIST network (guide 000's ``MNISTNet``) for 8x8 images and fewer channels."""
    return nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=3, stride=1, padding=1),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Conv2d(4, 8, kernel_size=3, stride=1, padding=1),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * 2 * 8, 16),
        nn.ReLU(),
        nn.Linear(16, 10),
        nn.LogSoftmax(dim=1),
    )


def mnist_dataset(count: int) -> torch.utils.data.TensorDataset:
    """Fake MNIST (the guides download it with torchvision): ``count`` 8x8 images, 10 classes."""
    generator = torch.Generator().manual_seed(count)
    images = torch.randn(count, 1, 8, 8, generator=generator)
    return torch.utils.data.TensorDataset(
        images, torch.randint(0, 10, (count,), generator=generator)
    )


def eager_sgd(model, batches, lr=0.01, momentum=0.5) -> tuple[torch.Tensor, dict]:
    """The reference: the guides' loop on the CPU, eagerly; its losses and final state."""
    model = copy.deepcopy(model)
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for data, target in batches:
        optimizer.zero_grad()
        loss = nn.NLLLoss()(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), on_cpu(model.state_dict())


def on_cpu(state: dict) -> dict:
    """A state dict as a plain dict of CPU tensors, to compare with another."""
    return {name: value.detach().cpu() for name, value in state.items()}


# --- 001 b01-b05, 002 b01, 004 b01-b05: tensors and modules on the device -----------------------

DEVICE_OF_BLOCK = {"g001": xm.xla_device, "g004": ltm.lazy_device, "g002": xm.xla_device}


@pytest.mark.parametrize(
    "guide, shape",
    [("g001", (2, 2)), ("g002", (4, 2)), ("g004", (2, 2))],
    ids=["g001-b01", "g002-b01", "g004-b01"],
)
def test_b01_create_and_print_a_tensor(guide, shape, capsys):
    t = torch.randn(*shape, device=DEVICE_OF_BLOCK[guide]())
    print(t.device)
    print(t)
    device_line, *tensor_lines = capsys.readouterr().out.splitlines()
    assert device_line == "xla:0"
    values = repr(t.cpu())[len("tensor(") : -1]
    assert "\n".join(tensor_lines) == f"tensor({values}, device='xla:0')"


@pytest.mark.parametrize("guide", ["g001", "g004"], ids=lambda g: f"{g}-b02")
def test_b02_add_two_tensors(guide):
    t0 = torch.randn(2, 2, device=DEVICE_OF_BLOCK[guide]())
    t1 = torch.randn(2, 2, device=DEVICE_OF_BLOCK[guide]())
    print(t0 + t1)
    assert_close(t0 + t1, t0.cpu() + t1.cpu(), tol="exact")


@pytest.mark.parametrize("guide", ["g001", "g004"], ids=lambda g: f"{g}-b03")
def test_b03_matrix_multiply(guide):
    t0 = torch.randn(2, 2, device=DEVICE_OF_BLOCK[guide]())
    t1 = torch.randn(2, 2, device=DEVICE_OF_BLOCK[guide]())
    print(t0.mm(t1))
    assert_close(t0.mm(t1), t0.cpu().mm(t1.cpu()), tol="single_op")


@pytest.mark.parametrize("guide", ["g001", "g004"], ids=lambda g: f"{g}-b04")
def test_b04_a_module_on_the_device(guide):
    device = DEVICE_OF_BLOCK[guide]
    l_in = torch.randn(10, device=device())
    linear = torch.nn.Linear(10, 20).to(device())
    l_out = linear(l_in)
    print(l_out)
    assert l_out.device == torch.device("xla:0")
    expected = F.linear(l_in.cpu(), linear.weight.cpu(), linear.bias.cpu())
    assert_close(l_out, expected, tol="single_op")


@pytest.mark.parametrize("guide", ["g001", "g004"], ids=lambda g: f"{g}-b05")
def test_b05_a_cpu_module_refuses_a_device_tensor(guide):
    l_in = torch.randn(10, device=DEVICE_OF_BLOCK[guide]())
    linear = torch.nn.Linear(10, 20)
    with pytest.raises(RuntimeError, match="cpu") as raised:  # as PyTorch for CPU and CUDA
        linear(l_in)
    assert "xla" in str(raised.value)


# --- 000 b02, b04: the device, lazy execution and sync ------------------------------------------


def test_g000_b02_model_and_data_to_the_device():
    torch.manual_seed(0)
    model, data = small_mnist(), torch.randn(4, 1, 8, 8)
    cpu_model = copy.deepcopy(model)
    device = xm.xla_device()
    model.to(device)
    data = data.to(device)
    assert all(p.device == device for p in model.parameters())
    assert_close(model(data), cpu_model(data.cpu()), tol="training", kind="grad")


def test_g000_b04_sync_then_read_the_loss():
    torch.manual_seed(0)
    model, (data, target) = small_mnist(), mnist_dataset(4)[:]
    (expected,), _ = eager_sgd(model, [(data, target)])
    model.to("xla")
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    loss = nn.NLLLoss()(model(data.to("xla")), target.to("xla"))
    loss.backward()
    optimizer.step()  # Operations are added to a graph, not executed yet
    assert graph.pending_count() > 0
    spmd_torch.sync()
    with assert_compiles(0):  # computed by the sync: the reads run nothing
        print(loss.item())
        print(loss.cpu().item())
    assert_close(loss.cpu(), expected, tol="training", kind="grad")


# --- 000 b06, b07, 001 b06, 004 b06: one device's training loop ---------------------------------


@pytest.mark.parametrize(
    "block",
    ["g000-b06-mp_device_loader", "g000-b07-sync", "g001-b06-mark_step", "g004-b06-ltm"],
)
def test_single_device_training_loop(block):
    torch.manual_seed(0)
    initial = small_mnist()
    train_loader = torch.utils.data.DataLoader(mnist_dataset(12), batch_size=4)
    expected_losses, expected_state = eager_sgd(initial, list(train_loader))

    device = ltm.lazy_device() if block.startswith("g004") else xm.xla_device()
    model = copy.deepcopy(initial).train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    losses = []
    if block.startswith("g000-b06"):
        mp_train_loader = pl.MpDeviceLoader(train_loader, device)
        for batch_idx, (data, target) in enumerate(mp_train_loader):  # the guide omits enumerate
            optimizer.zero_grad()
            loss = loss_fn(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    else:
        barrier = {"g000": spmd_torch.sync, "g001": xm.mark_step, "g004": ltm.mark_step}
        for data, target in train_loader:
            optimizer.zero_grad()
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()
            barrier[block[:4]]()
            losses.append(loss.detach())
    assert_close(torch.stack(losses), expected_losses, tol="training", kind="grad")
    assert_close(on_cpu(model.state_dict()), expected_state, tol="training")


# --- 000 b08, 001 b07: multi-process training (launch, spawn) -----------------------------------


mnist_mp = load_example("mnist_mp")  # guide 000 b08's script with its imports renamed


@pytest.mark.parametrize(
    "num_workers",
    [0, 1],
    ids=["g000-b08", "g000-b08-workers"],
)
def test_g000_b08_launch_mnist(num_workers, capsys, monkeypatch):
    monkeypatch.setattr(mnist_mp, "MNISTNet", small_mnist)
    args = mnist_mp.Args()
    args.epochs, args.batch_size, args.log_interval = 2, 4, 2
    args.train_loader = torch.utils.data.DataLoader(
        mnist_dataset(16), batch_size=args.batch_size, shuffle=True, num_workers=num_workers
    )
    losses = spmd_torch.launch(mnist_mp._mp_mnist_fn, args=(args,))

    # Every process loads every batch (the loader is not split: no DistributedSampler), in the
    # order its own seeded RNG shuffles them, so each step averages equal gradients: the eager
    # reference is one process's run.
    torch.manual_seed(args.seed)
    initial = small_mnist()
    batches = [batch for _ in range(args.epochs) for batch in args.train_loader]
    expected, _ = eager_sgd(initial, batches)
    world = xr.global_runtime_device_count()
    assert sorted(losses) == list(range(world))
    for replica_losses in losses.values():
        assert_close(torch.tensor(replica_losses), expected, tol="training", kind="grad")
    out = capsys.readouterr().out.splitlines()
    starts = {
        f"Process {i} (Global Ordinal {i}): Starting training on CPU..." for i in range(world)
    }
    assert starts <= set(out)
    logged = [line for line in out if " - Train Epoch: " in line]
    assert len(logged) == 4 and all(line.startswith("Process 0 - ") for line in logged)
    assert logged[1].startswith(f"Process 0 - Train Epoch: 1 [{2 * 4 * world}/16 (50%)]")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_g001_pods_the_same_script_on_every_host():
    """Guide 001's pod section: the same MNIST script on every host (here 2 processes of 4 CPU
    devices each, through the local launcher, as ``gcloud ... --worker=all`` runs it on a pod)."""
    script = ROOT / "examples" / "mnist_mp.py"
    command = [sys.executable, "-m", "spmd_torch.distributed.run", "--hosts", "2"]
    command += ["--devices-per-host", "4", str(script), "--steps", "4", "--batch-size", "8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_TORCH_", "XLA_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=child_flags())
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.findall(r"\[host (\d)\] replica (\d) loss (\S+) -> (\S+) over 4 steps", done.stdout)
    assert sorted((host, replica) for host, replica, *_ in found) == [("0", "0"), ("1", "4")]
    torch.manual_seed(mnist_mp.Args.seed)
    initial = mnist_mp.MNISTNet()
    loader = torch.utils.data.DataLoader(mnist_mp.SyntheticMNIST(4 * 8), batch_size=8, shuffle=True)
    expected, _ = eager_sgd(initial, list(loader))
    for *_, first, last in found:  # printed to 4 decimals
        assert_close(
            torch.tensor([float(first), float(last)]), expected[[0, -1]], rtol=0, atol=6e-5
        )


TRAIN_LOADER = torch.utils.data.DataLoader(mnist_dataset(12), batch_size=4)
SPAWNED: dict = {}


def _mp_fn(index):
    """Guide 001's per-process function: a global loader, MpDeviceLoader, optimizer_step."""
    torch.manual_seed(0)
    device = xm.xla_device()
    mp_device_loader = pl.MpDeviceLoader(TRAIN_LOADER, device)

    model = small_mnist().train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

    for data, target in mp_device_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        xm.optimizer_step(optimizer)
    SPAWNED[index] = on_cpu(model.state_dict())


def test_g001_b07_spawn_with_a_device_loader():
    SPAWNED.clear()
    xmp.spawn(_mp_fn, args=())
    torch.manual_seed(0)
    _, expected = eager_sgd(small_mnist(), list(TRAIN_LOADER))
    assert sorted(SPAWNED) == list(range(xr.global_runtime_device_count()))
    for state in SPAWNED.values():
        assert_close(state, expected, tol="training")


# --- 002 b02: the legacy DataParallel -----------------------------------------------------------


def test_g002_b02_data_parallel():
    torch.manual_seed(0)
    devices = xm.get_xla_supported_devices()
    model_parallel = dp.DataParallel(small_mnist, device_ids=devices)
    num_epochs, lr, momentum = 2, 0.01, 0.5
    train_loader = torch.utils.data.DataLoader(mnist_dataset(4 * 2 * len(devices)), batch_size=4)

    def train_loop_fn(model, loader, device, context):
        loss_fn = nn.NLLLoss()
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=momentum)

        model.train()
        for _, (data, target) in loader:
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
        return on_cpu(model.state_dict())

    for epoch in range(1, num_epochs + 1):
        states = model_parallel(train_loop_fn, train_loader)

    # Batch k goes to device k % 8; each step averages a round of 8 batches' gradients, and each
    # epoch makes a new optimizer (its momentum starts over).
    torch.manual_seed(0)
    reference = small_mnist()
    batches = list(train_loader)
    for _ in range(num_epochs):
        optimizer = optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
        for start in range(0, len(batches), len(devices)):
            optimizer.zero_grad()
            rounds = batches[start : start + len(devices)]
            torch.stack([nn.NLLLoss()(reference(x), y) for x, y in rounds]).mean().backward()
            optimizer.step()
    assert len(states) == len(devices)
    for state in states:
        assert_close(state, on_cpu(reference.state_dict()), tol="training")


# --- 002 b03: clip_grad_norm_ without .item() ---------------------------------------------------


def clip_grad_norm_(parameters, max_norm, norm_type=2.0):
    """Guide 002's ``clip_grad_norm_`` body (its ``...``/``else:`` fragment, made a function)."""
    parameters = [p for p in parameters if p.grad is not None]
    device = parameters[0].device
    total_norm = torch.zeros([], device=device if parameters else None)
    for p in parameters:
        param_norm = p.grad.data.norm(norm_type) ** norm_type
        total_norm.add_(param_norm)
    total_norm = total_norm ** (1.0 / norm_type)
    clip_coef = torch.tensor(max_norm, device=device) / (total_norm + 1e-6)
    for p in parameters:
        p.grad.data.mul_(torch.where(clip_coef < 1, clip_coef, torch.tensor(1.0, device=device)))


@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["g002-b03-clips", "g002-b03-keeps"])
def test_g002_b03_clip_grad_norm_stays_on_the_device(max_norm):
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    data, target = torch.randn(4, 6), torch.randn(4, 3)
    model = copy.deepcopy(cpu_model).to("xla")
    F.mse_loss(cpu_model(data), target).backward()
    torch.nn.utils.clip_grad_norm_(cpu_model.parameters(), max_norm)
    F.mse_loss(model(data.to("xla")), target.to("xla")).backward()
    with assert_compiles(0), assert_counter_delta("TransferFromDevice", 0):
        clip_grad_norm_(model.parameters(), max_norm)
    grads = [p.grad for p in model.parameters()]
    assert_close(grads, [p.grad for p in cpu_model.parameters()], tol="training", kind="grad")


def test_g002_metrics_report_after_each_step():
    """Guide 002's ``print(torch_xla._XLAC._xla_metrics_report())`` (inline in its text)."""
    x = torch.randn(4, 4, device=xm.xla_device())
    for _ in range(2):
        x = x @ x.t() / 4
        xm.mark_step()
        report = spmd_torch._XLAC._xla_metrics_report()
        assert "Metric: CompileTime" in report and "Counter: MarkStep" in report


# --- 003 b01, b02: graphs with and without a barrier --------------------------------------------


def _tensors_on_device(device):
    generator = torch.Generator().manual_seed(3)
    pairs = [(torch.randn(3, 7, generator=generator), torch.randn(3, 7)) for _ in range(3)]
    return pairs, [(x.to(device), y.to(device)) for x, y in pairs]


def test_g003_b01_a_loop_without_a_barrier_is_one_graph():
    pairs, tensors_on_device = _tensors_on_device(xm.xla_device())
    z, expected = torch.zeros(3, 7).to(xm.xla_device()), torch.zeros(3, 7)
    for x, y in tensors_on_device:
        z += x + y
    for x, y in pairs:
        expected += x + y
    with assert_compiles(1):
        assert_close(z, expected, tol="single_op")


def test_g003_b02_a_barrier_makes_one_small_graph_run_each_iteration():
    pairs, tensors_on_device = _tensors_on_device(xm.xla_device())
    z, expected = torch.zeros(3, 7).to(xm.xla_device()) + 1, torch.ones(3, 7)
    xm.mark_step()  # z is data from here on, as each iteration leaves it
    with assert_compiles(1), assert_counter_delta("CachedCompile", 2):
        for x, y in tensors_on_device:
            z += x + y
            xm.mark_step()
    for x, y in pairs:
        expected += x + y
    assert_close(z, expected, tol="single_op")


# --- 003 b03, b05, b07: a model's device, buffers, launch ---------------------------------------


class FrozenEmbedder(nn.Module):
    """Guide 003 b03's edit: an encoder that keeps its device (``self.device = xm.xla_device()``)
    and moves its tokens there."""

    def __init__(self):
        super().__init__()
        self.device = xm.xla_device()
        self.embedding = nn.Embedding(16, 8)

    def forward(self, tokens):
        return self.embedding(tokens.to(self.device)).mean(dim=1)


def test_g003_b03_a_module_holding_its_device():
    torch.manual_seed(0)
    embedder = FrozenEmbedder()
    cpu_embedder = copy.deepcopy(embedder)
    tokens = torch.randint(0, 16, (2, 5))
    out = embedder.to(embedder.device)(tokens)
    assert out.device == torch.device("xla:0")
    assert_close(out, F.embedding(tokens, cpu_embedder.embedding.weight).mean(dim=1))


def test_g003_b05_a_buffer_moved_with_torch_device_of_a_device():
    attr = torch.linspace(0.1, 0.9, 5, dtype=torch.float64)  # DDIM's schedule, float64
    expected = attr.clone()
    device = xm.xla_device()
    attr = attr.to(torch.device(device))
    assert attr.device == device and attr.dtype == torch.float64
    assert_close(attr, expected, tol="exact")


LAUNCHED: list[int] = []


def my_function(index):
    LAUNCHED.append(index)  # the guide's body is a comment alone, an IndentationError


@pytest.mark.parametrize(
    "debug_single_process, expected",
    [(False, list(range(8))), (True, [0])],
    ids=["g003-b07", "g003-b07-single"],
)
def test_g003_b07_launch(debug_single_process, expected):
    LAUNCHED.clear()
    # The guide's args=(0,) would pass my_function a second argument it does not take.
    spmd_torch.launch(my_function, args=(), debug_single_process=debug_single_process)
    assert sorted(LAUNCHED) == expected


# --- 000 b09: bf16 AMP with a syncfree optimizer ------------------------------------------------


def test_g000_b09_bf16_amp_with_a_syncfree_optimizer():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    model = copy.deepcopy(cpu_model).to("xla")
    cpu_optimizer = torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9)
    optimizer = syncfree.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = [(torch.randn(16, 12), torch.randint(0, 4, (16,))) for _ in range(4)]
    losses, cpu_losses = [], []
    for input, target in data:
        optimizer.zero_grad()
        with autocast(spmd_torch.device()):
            output = model(input.to("xla"))
            loss = loss_fn(output, target.to("xla"))
        loss.backward()
        xm.optimizer_step(optimizer)  # the guide has xm.optimizer_step.(optimizer)
        losses.append(loss.detach())

        cpu_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu_loss = loss_fn(cpu_model(input), target)
        cpu_loss.backward()
        cpu_optimizer.step()
        cpu_losses.append(cpu_loss.detach())
    assert output.dtype == torch.bfloat16 and loss.dtype == torch.float32
    # bf16 products may round differently on the two sides (CPU's kernels, XLA's): bf16 tolerance
    assert_close(
        torch.stack([x.cpu() for x in losses]), torch.stack(cpu_losses), **tolerance(torch.bfloat16)
    )


# --- 000 b10, 001 b08-b11, 004 b07-b10: saving and loading --------------------------------------


def test_g000_b10_save_from_the_device_and_from_cpu_copies(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    device = xm.xla_device()
    model = small_mnist().to(device)
    # Saving
    xm.save(model.state_dict(), "model_xla.pt", master_only=True)  # master_only recommended
    # Or for more complex scenarios (the guide has this line as code, a SyntaxError):
    if xm.is_master_ordinal():
        cpu_state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.save(cpu_state_dict, "model_cpu.pt")

    # Loading
    model = small_mnist()
    model.load_state_dict(torch.load("model_cpu.pt"))
    model.to(device)  # Then move to XLA device
    saved = torch.load("model_xla.pt")
    assert all(v.device.type == "cpu" for v in saved.values())
    assert_close(on_cpu(saved), cpu_state_dict, tol="exact")
    assert_close(on_cpu(model.state_dict()), cpu_state_dict, tol="exact")


@pytest.mark.parametrize("guide", ["g001-b08", "g004-b07"])
def test_save_cpu_copies_and_load_them_back(guide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    device = ltm.lazy_device() if guide.startswith("g004") else xm.xla_device()

    t0 = torch.randn(2, 2, device=device)
    t1 = torch.randn(2, 2, device=device)

    tensors = (t0.cpu(), t1.cpu())
    expected = tensors

    torch.save(tensors, "tensors.pt")

    tensors = torch.load("tensors.pt")

    t0 = tensors[0].to(device)
    t1 = tensors[1].to(device)
    assert t0.device == t1.device == device
    assert_close((t0, t1), expected, tol="exact")


@pytest.mark.parametrize("guide", ["g001-b09", "g004-b08"])
def test_save_a_state_dict_through_the_cpu(guide, tmp_path):
    save = ltm.save if guide.startswith("g004") else xm.save
    path = tmp_path / "model.pt"
    torch.manual_seed(0)
    model = small_mnist().to(xm.xla_device())

    save(model.state_dict(), path)

    state = torch.load(path)
    assert all(v.device.type == "cpu" for v in state.values())
    assert_close(on_cpu(state), on_cpu(model.state_dict()), tol="exact")


def test_saving_device_tensors_directly_loads_them_on_the_device(tmp_path):
    """Guide 001's text: directly saving xla tensors works, and loads them back on the device."""
    t = torch.arange(6.0, device=xm.xla_device()).reshape(2, 3)
    torch.save(t, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=False)
    assert loaded.device == xm.xla_device()
    assert_close(loaded, torch.arange(6.0).reshape(2, 3), tol="exact")


@pytest.mark.parametrize("guide", ["g001-b10", "g004-b09"])
def test_stream_a_state_dict_to_the_cpu(guide, tmp_path):
    path = str(tmp_path / "model.pt")
    torch.manual_seed(0)
    model = small_mnist().to(xm.xla_device())

    xser.save(model.state_dict(), path)

    assert_close(on_cpu(xser.load(path)), on_cpu(model.state_dict()), tol="exact")


@pytest.mark.parametrize("guide", ["g001-b11", "g004-b10"])
def test_load_a_streamed_state_dict(guide, tmp_path):
    path = str(tmp_path / "model.pt")
    torch.manual_seed(0)
    saved = small_mnist()
    xser.save(copy.deepcopy(saved).to(xm.xla_device()).state_dict(), path)
    model = small_mnist().to(xm.xla_device())

    state_dict = xser.load(path)
    model.load_state_dict(state_dict)

    data = torch.randn(2, 1, 8, 8)
    assert_close(model(data.to(xm.xla_device())), saved(data), tol="training", kind="grad")


# --- 001 b12: the persistent compilation cache --------------------------------------------------


def test_g001_b12_initialize_cache(tmp_path, restore_jax_cache_config):
    xr.initialize_cache(str(tmp_path / "YOUR_CACHE_PATH"), readonly=False)
    x = torch.arange(3 * 1039.0).reshape(3, 1039)
    with assert_compiles(1):
        result = (x.to(xm.xla_device()) * 7 + 5).cpu()  # a shape no other test compiles
    assert_close(result, x * 7 + 5, tol="exact")
    assert os.listdir(tmp_path / "YOUR_CACHE_PATH")
