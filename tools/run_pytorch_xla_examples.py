"""Run PyTorch/XLA's own decoder-only example scripts here with only the import rename, and print
each one's losses next to the same model trained eagerly on CPU.

    python tools/run_pytorch_xla_examples.py --examples-dir ~/xla/examples            # as they are
    python tools/run_pytorch_xla_examples.py --examples-dir ~/xla/examples --small    # shrunk
    python tools/run_pytorch_xla_examples.py --examples-dir ~/xla/examples --small base fsdp_v2

The scripts are PyTorch/XLA's (a pytorch/xla checkout's ``examples/``; we do not ship them). They
are copied to a scratch folder with every ``torch_xla`` replaced by ``spmd_torch`` (what a user
migrating does with ``sed``), then each runs as ``__main__`` in a subprocess with 8 virtual CPU
devices: the script is imported and its ``if __name__ == '__main__':`` block then runs in its
namespace (see ``_main``). Full length is 200 steps of a ~200M-parameter model at batch 16 x 512
tokens (x8 for the SPMD scripts): hours on a CPU host, minutes on an accelerator.

Shrinking (``--small``): the scripts size their run with attributes written in
``TrainDecoderOnlyBase.__init__`` and with ``DecoderOnlyConfig``'s defaults. Before the script
runs, the subprocess gives ``DecoderOnlyConfig`` the defaults of ``SMALL_CONFIG`` and installs data
descriptors on ``TrainDecoderOnlyBase`` for the run-length attributes: every value the script
writes to ``num_steps`` becomes ``SMALL_STEPS``, to ``seq_len`` becomes ``SMALL_SEQ_LEN``, and to
``batch_size`` is scaled by ``SMALL_BATCH_SCALE`` (16 -> 2 on one device; the SPMD scripts'
``16 * 8`` -> 16). A script whose argparse builds the config (v2.9's base script) gets the small
sizes as its own command-line options. Nothing else in the scripts changes: data, optimizer,
loss, seeds, step functions and loops are theirs; the eager reference starts from the seed the
script's ``__main__`` block sets, if it sets one.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The decoder-only scripts of PyTorch/XLA's examples/, by the name the tests use.
SCRIPTS = {
    "base": "train_decoder_only_base.py",
    "eager": "eager/train_decoder_only_eager.py",
    "eager_with_compile": "eager/train_decoder_only_eager_with_compile.py",
    "eager_spmd_data_parallel": "eager/train_decoder_only_eager_spmd_data_parallel.py",
    "fsdp_v2": "fsdp/train_decoder_only_fsdp_v2.py",
    "eager_multi_process": "eager/train_decoder_only_eager_multi_process.py",
    "flash_attention": "flash_attention/train_decoder_only_flash_attention.py",
    "flash_attention_fsdp_v2": "flash_attention/train_decoder_only_flash_attention_fsdp_v2.py",
    # the base script given the scan example's model class, as examples/scan's README runs it
    "scan": "train_decoder_only_base.py scan.decoder_with_scan.DecoderWithScan",
}

SEED = 0  # torch.manual_seed before the script: its model is initialised on CPU
SMALL_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 128,
}
# The options through which a script's own argparse sets the config (v2.9's base script builds
# its DecoderOnlyConfig from them, with the full sizes as their defaults).
CONFIG_OPTIONS = {
    "hidden_size": "--hidden-size",
    "num_hidden_layers": "--num-layers",
    "num_attention_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-key-value-heads",
    "intermediate_size": "--intermediate-size",
}
SMALL_STEPS = 22  # losses print every 10 steps (0, 10, 20), each at the next step's barrier
SMALL_SEQ_LEN = 32
SMALL_BATCH_SCALE = 1 / 8
SCRIPT_BATCH_SIZE = 16  # what TrainDecoderOnlyBase sets per device
FULL_STEPS = 200

_LOSS_LINE = re.compile(r"step: (\d+), loss: (?:tensor\()?([-+0-9.eE]+|nan|inf)")


@dataclasses.dataclass
class Run:
    """One script's run: its printed losses by step, and its whole output."""

    script: str
    losses: dict[int, float]
    output: str


def renamed_copy(examples: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
    """The scripts of ``examples`` under ``destination``, ``torch_xla`` renamed ``spmd_torch``."""
    for source in examples.rglob("*.py"):
        target = destination / source.relative_to(examples)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text().replace("torch_xla", "spmd_torch"))
    return destination


def run(
    examples: pathlib.Path, name: str, scratch: pathlib.Path, full: bool, timeout: float
) -> Run:
    """Run example ``name`` (a key of SCRIPTS) renamed, in a subprocess on 8 CPU devices."""
    folder = renamed_copy(examples, scratch / name)
    path, *script_args = SCRIPTS[name].split()
    script = folder / path
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("XLA_USE_SPMD", None)
    command = [sys.executable, __file__, "--child", str(folder), str(script)]
    result = subprocess.run(
        [*command, *(["--full"] if full else []), "--", *script_args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{SCRIPTS[name]} exited with {result.returncode}:\n{output}")
    losses = {int(step): float(loss) for step, loss in _LOSS_LINE.findall(result.stdout)}
    return Run(SCRIPTS[name], losses, output)


def eager_losses(examples: pathlib.Path, full: bool, seed: int) -> dict[int, float]:
    """The scripts' training run on eager CPU: same model, seed, data, optimizer and loss.

    Every decoder-only script trains on all-zero tokens and targets, so the mean loss does not
    depend on the batch size: one reference per seed serves the single-device and the SPMD
    scripts.
    """
    model_module = _load_model_module(examples)
    config = model_module.DecoderOnlyConfig(**({} if full else SMALL_CONFIG))
    steps, seq_len = (FULL_STEPS, 512) if full else (SMALL_STEPS, SMALL_SEQ_LEN)
    batch = SCRIPT_BATCH_SIZE if full else int(SCRIPT_BATCH_SIZE * SMALL_BATCH_SCALE)
    torch.manual_seed(seed)
    model = model_module.DecoderOnlyModel(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0001)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = torch.zeros(batch, seq_len, dtype=torch.int64)
    losses = {}
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(data).view(-1, config.vocab_size), data.view(-1))
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            losses[step] = loss.item()
    return losses


def _load_model_module(examples: pathlib.Path):
    """The scripts' ``decoder_only_model`` (plain PyTorch: it imports no torch_xla)."""
    spec = importlib.util.spec_from_file_location(
        "pytorch_xla_decoder_only_model", examples / "decoder_only_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _RunLength:
    """A class attribute that replaces what the script writes to a run-length knob."""

    def __init__(self, shrink):
        self.shrink = shrink

    def __set_name__(self, owner, name):
        self.slot = "_shrunk_" + name

    def __get__(self, instance, owner=None):
        return self if instance is None else getattr(instance, self.slot)

    def __set__(self, instance, value):
        setattr(instance, self.slot, self.shrink(value))


def _shrink_run_length() -> None:
    """Give the scripts' config and trainer the small sizes of the module docstring."""
    decoder_only_model = importlib.import_module("decoder_only_model")  # the renamed copy
    small = dataclasses.make_dataclass(
        "DecoderOnlyConfig",
        [(field, int, dataclasses.field(default=value)) for field, value in SMALL_CONFIG.items()],
        bases=(decoder_only_model.DecoderOnlyConfig,),
    )
    decoder_only_model.DecoderOnlyConfig = small
    # imported only now, so that its `from decoder_only_model import DecoderOnlyConfig` gets it
    train_decoder_only_base = importlib.import_module("train_decoder_only_base")
    knobs = {
        "num_steps": lambda value: SMALL_STEPS,
        "seq_len": lambda value: SMALL_SEQ_LEN,
        "batch_size": lambda value: max(1, math.floor(value * SMALL_BATCH_SCALE)),
    }
    for name, shrink in knobs.items():
        descriptor = _RunLength(shrink)
        descriptor.__set_name__(train_decoder_only_base.TrainDecoderOnlyBase, name)
        setattr(train_decoder_only_base.TrainDecoderOnlyBase, name, descriptor)


def _main_body(source: str, path: str) -> list[ast.stmt]:
    """The statements of the script's ``if __name__ == '__main__':`` block."""
    tree = ast.parse(source, path)
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node.body
    raise ValueError(f"{path} has no `if __name__ == '__main__':` block")


def _main_block(source: str, path: str):
    """The body of the script's ``if __name__ == '__main__':`` block, compiled."""
    return compile(ast.Module(body=_main_body(source, path), type_ignores=[]), path, "exec")


def script_seed(source: str, path: str) -> int:
    """The seed the script's ``__main__`` block gives ``torch.manual_seed`` (v2.9's base script
    seeds 42 there, after ours), else ours: the eager reference must start from the same
    weights."""
    for node in ast.walk(ast.Module(body=_main_body(source, path), type_ignores=[])):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "torch.manual_seed"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return node.args[0].value
    return SEED


def _small_options(source: str) -> list[str]:
    """The small sizes as the command-line options the script's argparse takes, if it has them."""
    return [
        part
        for field, option in CONFIG_OPTIONS.items()
        if f'"{option}"' in source
        for part in (option, str(SMALL_CONFIG[field]))
    ]


def _main(folder: str, script: str, full: bool, script_args: list[str]) -> None:
    """Subprocess entry: run ``script`` from the renamed ``folder`` as its ``__main__`` would.

    The script is imported as a module and then its ``__main__`` block runs in that module's
    namespace: the same code as ``python script.py``, but the trainer class the block uses is the
    one the run-length shrinking has already patched (running the file as ``__main__`` would
    define the base script's class afresh).
    """
    sys.path.insert(0, folder)
    source = pathlib.Path(script).read_text()
    sys.argv = [script, *script_args, *([] if full else _small_options(source))]
    if not full:
        _shrink_run_length()
    torch.manual_seed(SEED)
    name = pathlib.Path(script).stem
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    exec(_main_block(source, script), module.__dict__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="*", help=f"some of {sorted(SCRIPTS)}")
    parser.add_argument(
        "--examples-dir",
        type=pathlib.Path,
        required=True,
        help="the examples/ folder of a pytorch/xla checkout (v2.9)",
    )
    parser.add_argument("--small", action="store_true", help="the shrunk run-length knobs")
    parser.add_argument("--timeout", type=float, default=24 * 3600, help="seconds per script")
    args = parser.parse_args()
    unknown = sorted(set(args.scripts) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown scripts {unknown}; known: {sorted(SCRIPTS)}")
    full = not args.small
    references: dict[int, dict[int, float]] = {}  # seed -> eager CPU's losses
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.scripts or SCRIPTS:
            path = args.examples_dir / SCRIPTS[name].split()[0]
            seed = script_seed(path.read_text(), str(path))
            if seed not in references:
                references[seed] = eager_losses(args.examples_dir, full, seed)
                print(f"eager CPU, seed {seed}: {_row(references[seed])}")
            eager = references[seed]
            start = time.perf_counter()
            try:
                run_ = run(args.examples_dir, name, pathlib.Path(scratch), full, args.timeout)
            except RuntimeError as error:
                print(f"{name}: FAILED\n{error}")
                continue
            worst = max(
                (abs(run_.losses[s] - e) / abs(e) for s, e in eager.items() if s in run_.losses),
                default=float("nan"),
            )
            seconds = time.perf_counter() - start
            print(f"{name} ({seconds:.0f} s): {_row(run_.losses)}  max rel diff {worst:.2e}")


def _row(losses: dict[int, float]) -> str:
    return "  ".join(f"step {step}: {loss:.4f}" for step, loss in sorted(losses.items()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        rest = sys.argv[4:]  # [--full] -- [the script's own arguments]
        cut = rest.index("--") if "--" in rest else len(rest)
        _main(sys.argv[2], sys.argv[3], "--full" in rest[:cut], rest[cut + 1 :])
    else:
        main()
