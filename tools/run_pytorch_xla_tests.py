"""Run PyTorch/XLA's own test suite (v2.9.0) through spmd_torch or through real PyTorch/XLA, one
line per test, and compare the two: the yardstick of spmd_torch's drop-in promise.

    python tools/run_pytorch_xla_tests.py --ptxla /work/ptxla --out /work/ptxla-run/results
    python tools/run_pytorch_xla_tests.py --target real --python /work/ptxla-venv/bin/python \\
        --out /work/ptxla-run/results
    python tools/run_pytorch_xla_tests.py --compare results/real.tsv results/spmd_torch.tsv
    python tools/run_pytorch_xla_tests.py --list                 # the file table and the skips
    python tools/run_pytorch_xla_tests.py --only spmd/test_xla_sharding.py --only test_mp_save

``--ptxla`` is an extracted PyTorch/XLA v2.9.0 source tree (its ``test/`` and ``examples/``; we do
not ship them). The files that run are those of ``SUITES``, each with its area, the numbers of CPU
devices it runs with and how it runs; ``IMPOSSIBLE`` lists the files that never run on CPU, with
the reason. Each file runs in its own subprocess (its own process group), killed after its
timeout (``error: timeout``); a pytest test that runs past ``Suite.test_timeout`` or kills its
process (an abort, a segfault) is an error, and the file runs again without the tests done:

- ``--target spmd_torch`` (default): ``python -m spmd_torch.run_as_torch_xla -m pytest FILE``
  with ``PYTHONPATH`` holding this checkout (or ``--spmd-root``, e.g. a ``git archive`` of one
  commit), so ``torch_xla`` is spmd_torch and nothing is installed; ``JAX_PLATFORMS=cpu``,
  ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
- ``--target real``: ``python -m pytest FILE`` with ``--python`` an environment holding
  PyTorch/XLA 2.9 (``torch==2.9.0 torch_xla==2.9.0``).
- ``--target as_tpu``: the TPU-gated Pallas files (``AS_TPU``), as ``spmd_torch`` runs its files
  but through ``tools/pose_as_tpu.py``: spmd_torch answers as a TPU host and interprets the Pallas
  TPU kernels, so the files check its TPU path on this CPU host.

Both get PyTorch/XLA's ``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES=N``. The tests also import
torchvision (NMS, the MNIST trainers), rich (SPMD visualization), absl-py, expecttest and
parameterized: give each target a ``--python`` that has them (for spmd_torch, a venv with
``--system-site-packages`` and a torchvision built for its torch works). Scripts (``test_mp_*.py``
and the other ``torch_xla.launch``/``xmp.spawn`` mains) run as ``python FILE`` and count as one
test, ``main[n=N]``: passed when they exit 0.

Files run from a scratch copy of ``test/`` and ``examples/`` under ``--out`` whose ``test/``,
``test/spmd/``, ``test/pjrt/``... lose their empty ``__init__.py``: pytest then imports each test
file as a top-level module, as ``python FILE`` does (its folder first on ``sys.path``), instead of
as ``test.spmd.X`` (which needs the tree's root, and so its source ``torch_xla/``, on
``sys.path``, and which processes spawned by the test could not import).

Results: ``OUT/<target>.tsv`` (area, file, test, outcome, why; outcome is passed, failed, error
or skipped; why is the exception type and the first line of its message), written file by file
(``--resume`` keeps the files already there), and each file's output in ``OUT/logs/<target>/``.
This script is also the pytest plugin of each child (``-p run_pytorch_xla_tests``): the
``pytest_*`` hooks below append one JSON line per test report to ``$PTXLA_TESTS_REPORT``, so a
file that crashes or times out keeps the results of the tests it finished.

``--compare REAL SPMD`` prints, per area, the tests that pass on real PyTorch/XLA, how many of them
pass through spmd_torch and the percentage (and how many pass only through spmd_torch), then each
test that passes on real but not through spmd_torch, grouped by reason class: missing module
``torch_xla.X``, missing attribute ``Y`` of ``Z``, wrong value, other.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = pathlib.Path(__file__).resolve().parent
PLUGIN = pathlib.Path(__file__).stem
REPORT_ENV = "PTXLA_TESTS_REPORT"
TEST_TIMEOUT_ENV = "PTXLA_TEST_TIMEOUT"
DONE_ENV = "PTXLA_TESTS_DONE"  # a file of node ids, one a line: tests a restart leaves out
MAX_RESTARTS = 20  # a pytest file that crashes or hangs restarts past the test at fault
COLUMNS = ("area", "file", "test", "outcome", "why")

SPMD = "SPMD sharding"
DTENSOR = "DTensor"
CHECKPOINT = "distributed checkpoint"
MP = "multiprocessing"
RUNTIME = "runtime/devices/metrics"
OPS = "test_operations.py"
KERNELS = "Pallas kernels (as on a TPU)"
AREAS = (SPMD, DTENSOR, CHECKPOINT, MP, RUNTIME, OPS, KERNELS)


@dataclasses.dataclass(frozen=True)
class Suite:
    """One test file: its area, the CPU device counts it runs with, and how it runs."""

    path: str  # relative to the tree's test/
    area: str
    devices: tuple[int, ...]
    script: bool = False  # `python FILE`, one test; else pytest
    args: tuple[str, ...] = ()  # in args and env, "{tmp}" is the file's scratch folder
    env: tuple[tuple[str, str], ...] = ()
    timeout: int = 600  # the file, restarts included
    test_timeout: int = 300  # one pytest test


def _spmd(path: str, n: int = 8, **kw) -> Suite:
    return Suite(f"spmd/{path}", SPMD, (n,), **kw)


def _mp_script(
    path: str, devices: tuple[int, ...] = (1, 4, 8), args: tuple[str, ...] = ()
) -> Suite:
    return Suite(path, MP, devices, script=True, args=args)


# The file table. Device counts: the SPMD files build meshes over every device and skip tests
# below 2, 4 or (spmd_debugging) exactly 8 devices, so 8; the DTensor files are the ones PyTorch/
# XLA's CI runs with 4 devices (`run_test_multi_devices`) and skip below 4; test_devices.py and
# pjrt/test_runtime_multi_cpu.py set CPU_NUM_DEVICES=4 themselves; the multiprocessing scripts
# and the files that spawn get one replica per device: world size 4 and 8 (the MNIST trainers,
# 60000 samples an epoch on 2 cores, 4 only), and 1 as PyTorch/XLA's CI runs them (`run_test`:
# CPU_NUM_DEVICES=1; on CPU its replicas are threads of one process, whose collectives can time
# out in XLA's CPU rendezvous on 2 cores); the rest is single-device as in that CI.
_FAKE_MNIST = ("--fake_data", "--num_epochs=1")
SUITES: tuple[Suite, ...] = (
    # SPMD sharding: test/spmd/ less DTensor and checkpoint
    _spmd("test_xla_sharding.py", timeout=1200),
    _spmd("test_xla_sharding_hlo.py"),
    _spmd("test_xla_virtual_device.py"),
    _spmd("test_xla_sharded_tensor.py"),
    _spmd("test_dynamo_spmd.py"),
    _spmd("test_spmd_debugging.py"),
    _spmd("test_xla_spmd_python_api_interaction.py"),
    _spmd("test_xla_auto_sharding.py"),
    _spmd("test_spmd_parameter_wrapping.py"),
    _spmd("test_mp_input_sharding.py"),
    _spmd("test_fsdp_v2.py"),
    _spmd("test_train_spmd_linear_model.py"),
    _spmd(
        "test_spmd_graph_dump.py",
        env=(("XLA_SAVE_TENSORS_FILE", "{tmp}/save_ir.txt"), ("XLA_SAVE_TENSORS_FMT", "text")),
    ),
    _spmd(
        "test_spmd_lowering_context.py",
        env=(("XLA_SAVE_TENSORS_FILE", "{tmp}/save_hlo.txt"), ("XLA_SAVE_TENSORS_FMT", "hlo")),
    ),
    # DTensor
    Suite("spmd/test_dtensor_integration.py", DTENSOR, (4,)),
    Suite("spmd/test_dtensor_integration2.py", DTENSOR, (4,)),
    Suite(
        "spmd/test_dtensor_integration3.py",
        DTENSOR,
        (4,),
        env=(("XLA_DISABLE_FUNCTIONALIZATION", "1"),),  # as PyTorch/XLA's CI runs it
    ),
    Suite("spmd/test_dtensor_convert_mesh.py", DTENSOR, (4,)),
    Suite("spmd/test_dtensor_redistribute.py", DTENSOR, (4,)),
    Suite("spmd/test_xla_dtensor_spec_conversion.py", DTENSOR, (4,)),
    Suite("spmd/test_xla_dtensor_placements.py", DTENSOR, (4,)),
    # distributed checkpoint
    Suite("spmd/test_xla_distributed_checkpoint.py", CHECKPOINT, (8,)),
    # multiprocessing: launch/spawn scripts, then the unittest files that spawn
    _mp_script("test_mp_all_gather.py"),
    _mp_script("test_mp_all_to_all.py"),
    _mp_script("test_mp_collective_matmul.py"),
    _mp_script("test_mp_collective_permute.py"),
    _mp_script("test_mp_distributed_mm.py"),
    _mp_script("test_mp_mesh_reduce.py"),
    _mp_script("test_mp_reduce_scatter.py"),
    _mp_script("test_mp_rendezvous.py"),
    _mp_script("test_mp_replication.py"),
    _mp_script("test_mp_save.py"),
    _mp_script("test_mp_sync_batch_norm.py"),
    _mp_script("test_zero1.py"),
    _mp_script("test_fsdp_auto_wrap.py"),
    _mp_script("torch_distributed/test_torch_distributed_all_gather_xla_backend.py"),
    _mp_script("torch_distributed/test_torch_distributed_all_reduce_xla_backend.py"),
    _mp_script("torch_distributed/test_torch_distributed_bucketed_all_reduce_xla_backend.py"),
    _mp_script("torch_distributed/test_torch_distributed_multi_all_reduce_xla_backend.py"),
    _mp_script("torch_distributed/test_torch_distributed_reduce_scatter_xla_backend.py"),
    _mp_script("test_train_mp_mnist.py", (1, 4), _FAKE_MNIST),
    _mp_script("test_train_mp_mnist_amp.py", (1, 4), _FAKE_MNIST),
    _mp_script("test_train_mp_mnist_zero1.py", (1, 4), _FAKE_MNIST),
    _mp_script(  # its default checkpoint folder, /tmp/mnist-fsdp, outlives the run
        "test_train_mp_mnist_fsdp_with_ckpt.py",
        (1, 4),
        (*_FAKE_MNIST, "--ckpt_prefix={tmp}/mnist-fsdp/final_ckpt"),
    ),
    Suite("torch_distributed/test_ddp.py", MP, (1, 4)),
    Suite("torch_distributed/test_torch_distributed_fsdp_meta.py", MP, (1, 4)),
    Suite("pjrt/test_ddp.py", MP, (1, 4)),
    Suite("test_torch_distributed_xla_backend.py", MP, (1,)),
    # runtime, devices, metrics
    Suite("test_devices.py", RUNTIME, (4,)),
    Suite("test_metrics.py", RUNTIME, (1,)),
    Suite("pjrt/test_runtime.py", RUNTIME, (1,)),
    Suite("pjrt/test_runtime_multi_cpu.py", RUNTIME, (4,)),
    Suite("pjrt/test_mesh_service.py", RUNTIME, (1, 4)),
    Suite("pjrt/test_metrics.py", RUNTIME, (1,)),
    Suite("pjrt/test_dtypes.py", RUNTIME, (1,)),
    Suite("pjrt/test_profiler.py", RUNTIME, (1,)),
    Suite("test_async_closures.py", RUNTIME, (1,)),
    Suite("test_runtime_client_initialization_error.py", RUNTIME, (1,)),
    Suite("test_compilation_cache_utils.py", RUNTIME, (1,)),
    # operations
    Suite("test_operations.py", OPS, (1,), timeout=2400),
)

# The TPU-gated files that run posing as a TPU host (--target as_tpu).
AS_TPU: tuple[Suite, ...] = (
    Suite("test_pallas.py", KERNELS, (1,), timeout=1200),
    Suite("test_pallas_spmd.py", KERNELS, (8,)),
    Suite("test_gmm.py", KERNELS, (1,)),
    Suite("scan/test_scan_pallas.py", KERNELS, (8,), script=True),  # its mesh is set in __main__
    # its mesh is set in __main__; its batch of 4 spans the mesh, as on a 4-chip TPU host
    Suite("test_splash_attention.py", KERNELS, (4,), script=True, timeout=1200),
)

# Files of these areas that never run on a CPU host, or are not tests.
IMPOSSIBLE = {
    "pjrt/test_runtime_tpu.py": "TPU only (libtpu, TPU topologies)",
    "pjrt/test_internal_tpu.py": "TPU only (torch_xla._internal.tpu against libtpu)",
    "pjrt/test_collective_ops_tpu.py": "TPU only (collectives on TPU chips)",
    "pjrt/test_dynamic_plugin_tpu.py": "TPU only (the libtpu PJRT plugin)",
    "pjrt/test_torchrun.py": "must be launched by torchrun (exits 1 otherwise); TPU collectives",
    "pjrt/test_train_hf_transformer.py": "downloads a Hugging Face model and data set (no network)",
    "test_mp_early_exit.py": "must be launched by torchrun; its body runs on TPU only",
    "test_persistent_cache.py": "skipUnless TPU or NEURON for the whole class",
    "spmd/test_sharding_strategies.py": "a benchmark (131072 rows per device), not a test",
    "spmd/test_train_spmd_imagenet.py": "ResNet-50 ImageNet trainer: hours on 2 CPU cores",
    "test_train_mp_imagenet.py": "ResNet-50 ImageNet trainer: hours on 2 CPU cores",
    "test_train_mp_imagenet_amp.py": "ResNet-50 ImageNet trainer (AMP): hours on 2 CPU cores",
    "test_train_mp_imagenet_fsdp.py": "ResNet-50 ImageNet trainer (FSDP): hours on 2 CPU cores",
    "test_profile_mp_mnist.py": "a profiling harness for a TPU profiler server, not a test",
    "test_pallas.py": "Pallas kernels: TPU/GPU only (--target as_tpu)",
    "test_pallas_spmd.py": "Pallas kernels: TPU only (--target as_tpu)",
    "test_splash_attention.py": "Pallas splash attention: TPU only (--target as_tpu)",
    "test_ragged_paged_attention_kernel.py": "Pallas kernel: TPU only",
    "test_multi_queries_paged_attention_kernel.py": "Pallas kernel: TPU only",
    "test_quantized_matmul_pallas_kernel.py": "Pallas kernel: TPU only",
    "test_gmm.py": "Pallas grouped matmul: TPU only (--target as_tpu)",
    "test_fp8.py": "fp8 matmuls: TPU/GPU only",
    "neuron/": "AWS Neuron devices only",
    "tpu/": "TPU only",
}


# ---------------------------------------------------------------------------------------------
# The pytest plugin: runs inside each child (`-p run_pytorch_xla_tests`), writes JSON lines.


def _report_line(record: dict) -> None:
    """Append one record to the parent's report file at once, so a crash keeps what ran."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _longrepr_why(longrepr) -> str:
    """The exception type and the first line of its message, from a pytest report."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return exception_line(text)


def pytest_collection_modifyitems(config, items) -> None:
    """Leave out the tests already done (exact node ids: --deselect would match prefixes)."""
    path = os.environ.get(DONE_ENV)
    if not path or not os.path.exists(path):
        return
    done = set(pathlib.Path(path).read_text().splitlines())
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]


def pytest_collection_finish(session) -> None:
    _report_line({"event": "collected", "tests": [item.nodeid for item in session.items]})


_WATCHDOG: list = []


def _hung(nodeid: str) -> None:
    """A test ran past its limit: say which, then end the process (the parent restarts it)."""
    _report_line({"event": "hang", "test": nodeid})
    os.kill(os.getpid(), signal.SIGKILL)


def pytest_runtest_logstart(nodeid, location) -> None:
    _report_line({"event": "start", "test": nodeid})
    limit = float(os.environ.get(TEST_TIMEOUT_ENV, "0"))
    if limit > 0:
        timer = threading.Timer(limit, _hung, args=(nodeid,))
        timer.daemon = True
        timer.start()
        _WATCHDOG.append(timer)


def pytest_runtest_logfinish(nodeid, location) -> None:
    while _WATCHDOG:
        _WATCHDOG.pop().cancel()


def pytest_runtest_logreport(report) -> None:
    record = {"event": "report", "test": report.nodeid, "when": report.when}
    record["outcome"] = report.outcome
    record["xfail"] = hasattr(report, "wasxfail")
    if report.outcome != "passed":
        record["why"] = _longrepr_why(report.longrepr)
    _report_line(record)


def pytest_collectreport(report) -> None:
    if report.failed:
        why = _longrepr_why(report.longrepr)
        _report_line({"event": "collecterror", "test": report.nodeid, "why": why})


# ---------------------------------------------------------------------------------------------
# Reasons


_EXC = re.compile(
    r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Warning))\b"
)


def exception_line(text: str) -> str:
    """The exception as `SomeError: message`: pytest's first `E   SomeError...` line if any
    (a collection error's text starts with its own summary), else the first line that reads so,
    a message starting on the next line joined; else the first line; at most 300 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    e_lines = [line[1:].strip() for line in lines if line.startswith("E ")]
    for candidates in (e_lines, lines):
        for i, line in enumerate(candidates):
            if _EXC.match(line):
                if line.endswith(":") and i + 1 < len(candidates):
                    line = f"{line} {candidates[i + 1]}"
                return line[:300]
    return (lines[0] if lines else "")[:300]


def last_exception_line(text: str) -> str:
    """The last `SomeError: message` line of a script's output (its uncaught exception)."""
    found = ""
    for line in text.splitlines():
        line = line.removeprefix("INTERNALERROR> ")
        if _EXC.match(line.strip()) and not line.startswith(" "):
            found = line.strip()
    if found:
        return found[:300]
    tail = [line.strip() for line in text.splitlines() if line.strip()]
    return tail[-1][:300] if tail else ""


# ---------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class Run:
    """What one run needs: target, interpreter, trees and output places."""

    target: str
    python: str
    tree: pathlib.Path  # the scratch copy: tree/test, tree/examples
    out: pathlib.Path
    spmd_root: pathlib.Path


def prepare_tree(ptxla: pathlib.Path, out: pathlib.Path, target: str) -> pathlib.Path:
    """Copy test/ and examples/ to OUT/tree-TARGET, dropping the test folders' __init__.py."""
    tree = out / f"tree-{target}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for name in ("test", "examples"):
        shutil.copytree(ptxla / name, tree / name, symlinks=True)  # dangling links as they are
    test = tree / "test"
    for folder in {(test / s.path).parent for s in (*SUITES, *AS_TPU)}:
        init = folder / "__init__.py"
        if init.exists() and init.stat().st_size == 0:
            init.unlink()
    (tree / "pytest.ini").write_text("[pytest]\n")  # no outer config (addopts, filterwarnings)
    return tree


def child_env(run: Run, suite: Suite, n: int, tmp: pathlib.Path, report: pathlib.Path) -> dict:
    """The environment of one file's process."""
    env = dict(os.environ)
    test = run.tree / "test"
    paths = [str((test / suite.path).parent), str(test)]
    if run.target != "real":
        paths.insert(0, str(run.spmd_root))
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    paths.append(str(TOOLS))  # last: the plugin; tools/bench must not hide test/bench.py
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PJRT_DEVICE"] = "CPU"
    env["CPU_NUM_DEVICES"] = str(n)
    env["TMPDIR"] = str(tmp)
    env[REPORT_ENV] = str(report)
    env[TEST_TIMEOUT_ENV] = str(suite.test_timeout)
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in suite.env:
        env[key] = value.replace("{tmp}", str(tmp))
    return env


def child_command(run: Run, suite: Suite, tmp: pathlib.Path) -> list[str]:
    """`python [-m spmd_torch.run_as_torch_xla [pose_as_tpu.py]] (-m pytest FILE ... | FILE
    args)`."""
    cmd = [run.python]
    if run.target != "real":
        cmd += ["-m", "spmd_torch.run_as_torch_xla"]
    if run.target == "as_tpu":
        cmd.append(str(TOOLS / "pose_as_tpu.py"))
    path = str(run.tree / "test" / suite.path)
    args = [arg.replace("{tmp}", str(tmp)) for arg in suite.args]
    if suite.script:
        return cmd + [path, *args]
    pytest = ["-m", "pytest", path, "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "-rN"]
    return cmd + pytest + ["-c", str(run.tree / "pytest.ini"), *args]


def run_process(cmd: list[str], env: dict, cwd: pathlib.Path, log: pathlib.Path, timeout: float):
    """Run in a new process group, appending to log; on timeout kill it, and afterwards whatever
    it left running. Returns (returncode, or None on timeout; the output)."""
    start = log.stat().st_size if log.exists() else 0
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    with open(log, errors="replace") as f:
        f.seek(start)
        return code, f.read()


def exit_why(code: int | None, output: str) -> str:
    """Why a process did not exit 0: timeout, a signal, or its last exception line."""
    if code is None:
        return "timeout"
    if code < 0:
        return f"crash: {signal.Signals(-code).name}"
    return last_exception_line(output) or f"exit status {code}"


def script_rows(suite: Suite, n: int, code: int | None, output: str) -> list[dict]:
    """One row for a script: passed when it exits 0."""
    test = f"main[n={n}]"
    if code == 0:
        return [_row(suite, test, "passed", "")]
    outcome = "error" if code is None or code < 0 else "failed"
    return [_row(suite, test, outcome, exit_why(code, output))]


def _row(suite: Suite, test: str, outcome: str, why: str) -> dict:
    why = why.replace("\t", " ").replace("\n", " ")
    return {"area": suite.area, "file": suite.path, "test": test, "outcome": outcome, "why": why}


def _outcome(rec: dict) -> tuple[str, str]:
    """(outcome, why) of one setup/call/teardown report."""
    if rec["xfail"]:
        if rec["outcome"] == "passed":
            return "failed", "unexpected success"
        return "passed", "expected failure"
    if rec["outcome"] == "failed" and rec["when"] != "call":
        return "error", rec.get("why", "")
    return rec["outcome"], rec.get("why", "")


def _merge(prev: tuple[str, str] | None, rec: dict) -> tuple[str, str]:
    """Fold a test's setup, call and teardown reports: the first that did not pass decides."""
    return _outcome(rec) if prev is None or prev[0] == "passed" else prev


@dataclasses.dataclass
class Progress:
    """What the pytest runs of one file reported so far, restarts included."""

    collected: list[str] = dataclasses.field(default_factory=list)
    results: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    finished: set[str] = dataclasses.field(default_factory=set)
    collect_errors: list[str] = dataclasses.field(default_factory=list)


def read_reports(report: pathlib.Path, progress: Progress) -> tuple[str | None, bool]:
    """Fold one run's records into progress; returns (the test in flight at its end, hung)."""
    records = report.read_text().splitlines() if report.exists() else []
    in_flight, hung = None, False
    for rec in map(json.loads, records):
        event, test = rec["event"], rec.get("test")
        if event == "collected":
            progress.collected = progress.collected or rec["tests"]
        elif event == "start":
            in_flight = test
        elif event == "report":
            progress.results[test] = _merge(progress.results.get(test), rec)
            if rec["when"] == "teardown":
                progress.finished.add(test)
                in_flight = None
        elif event == "collecterror" and not progress.collect_errors:
            progress.collect_errors.append(rec["why"])
        elif event == "hang":
            hung = True
    return in_flight, hung


def run_pytest(run: Run, suite: Suite, n: int, tmp: pathlib.Path, log: pathlib.Path) -> Progress:
    """Run a pytest file; when a test crashes the process or hangs, record it as an error and
    run the file again without the tests already done, until the file's timeout."""
    progress = Progress()
    deadline = time.monotonic() + suite.timeout
    for attempt in range(MAX_RESTARTS + 1):
        report = tmp / f"report{attempt}.jsonl"
        env = child_env(run, suite, n, tmp, report)
        env[DONE_ENV] = str(tmp / "done.txt")
        (tmp / "done.txt").write_text("".join(f"{test}\n" for test in sorted(progress.finished)))
        left = deadline - time.monotonic()
        code, output = run_process(child_command(run, suite, tmp), env, tmp, log, left)
        in_flight, hung = read_reports(report, progress)
        if code is not None and code >= 0:
            break
        why = f"timeout: one test over {suite.test_timeout} s" if hung else exit_why(code, output)
        if in_flight is None:  # died outside a test: what is left never ran
            _fill_unrun(progress, f"not run: {why}")
            break
        progress.results[in_flight] = ("error", why)
        progress.finished.add(in_flight)
        if code is None or not set(progress.collected) - progress.finished:
            _fill_unrun(progress, f"not run: file timeout ({suite.timeout} s)")
            break
    if not progress.collected and not progress.collect_errors and code not in (0, 5):
        progress.collect_errors.append(exit_why(code, output))
    return progress


def _fill_unrun(progress: Progress, why: str) -> None:
    for test in progress.collected:
        if test not in progress.finished:
            progress.results[test] = ("error", why)


def progress_rows(suite: Suite, n: int, progress: Progress) -> list[dict]:
    """One row per collected test (a row for a file that failed to collect)."""
    suffix = f"[n={n}]" if len(suite.devices) > 1 else ""
    rows = [_row(suite, "<collection>" + suffix, "error", why) for why in progress.collect_errors]
    for test in progress.collected or list(progress.results):
        outcome, why = progress.results.get(test, ("error", "not run (no report)"))
        rows.append(_row(suite, test.split("::", 1)[-1] + suffix, outcome, why))
    return rows


def run_suite(run: Run, suite: Suite, n: int) -> list[dict]:
    """Run one file with n devices in its own process; its rows."""
    name = suite.path.replace("/", "__") + f".n{n}"
    tmp = run.out / "tmp" / run.target / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log = run.out / "logs" / run.target / f"{name}.log"
    log.unlink(missing_ok=True)
    if not suite.script:
        return progress_rows(suite, n, run_pytest(run, suite, n, tmp, log))
    env = child_env(run, suite, n, tmp, tmp / "report.jsonl")
    code, output = run_process(child_command(run, suite, tmp), env, tmp, log, suite.timeout)
    return script_rows(suite, n, code, output)


def selected(target: str, only: list[str]) -> list[Suite]:
    """The target's suites whose path contains one of the --only strings (all without --only)."""
    suites = AS_TPU if target == "as_tpu" else SUITES
    return [s for s in suites if not only or any(o in s.path for o in only)]


def write_rows(path: pathlib.Path, rows: list[dict]) -> None:
    """Append rows as tab-separated lines (the header first); no field holds a tab or newline."""
    with open(path, "a") as f:
        if f.tell() == 0:
            f.write("\t".join(COLUMNS) + "\n")
        for r in rows:
            f.write("\t".join(r[c] for c in COLUMNS) + "\n")


def read_rows(path: pathlib.Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [dict(zip(COLUMNS, line.split("\t"))) for line in lines[1:] if line]


def run_all(run: Run, suites: list[Suite], resume: bool) -> pathlib.Path:
    """Run every (file, device count) in turn, appending to OUT/<target>.tsv."""
    tsv = run.out / f"{run.target}.tsv"
    done = set()
    if resume and tsv.exists():
        done = {r["file"] for r in read_rows(tsv)}
    elif tsv.exists():
        tsv.unlink()
    (run.out / "logs" / run.target).mkdir(parents=True, exist_ok=True)
    for suite in suites:
        if suite.path in done:
            continue
        rows = []
        for n in suite.devices:
            start = time.monotonic()
            new = run_suite(run, suite, n)
            counts = collections.Counter(r["outcome"] for r in new)
            took = time.monotonic() - start
            rows += new
            print(f"{suite.path} n={n}: {dict(counts)} {took:.0f}s", flush=True)
        write_rows(tsv, rows)
    return tsv


# ---------------------------------------------------------------------------------------------
# Summaries and the comparison


def print_summary(rows: list[dict]) -> None:
    """Outcome counts per area."""
    outcomes = ("passed", "failed", "error", "skipped")
    by_area = collections.defaultdict(collections.Counter)
    for r in rows:
        by_area[r["area"]][r["outcome"]] += 1
    print(f"\n{'area':<26}" + "".join(f"{o:>9}" for o in outcomes) + f"{'total':>9}")
    for area in AREAS:
        c = by_area.get(area, collections.Counter())
        print(f"{area:<26}" + "".join(f"{c[o]:>9}" for o in outcomes) + f"{c.total():>9}")


_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
_MISSING_ATTR = re.compile(
    r"(?:module |<module )?'([\w.]+)'(?: object|[^']*)? (?:has no|does not have the) attribute '(\w+)'"
)
_CANNOT_IMPORT = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def wrong_value_key(why: str) -> str:
    """What kind of wrong value: an HLO-text check, a missing exception, or other values."""
    if re.search(r"not found in '(?:module @|HloModule)", why):
        return "text check on the HLO/IR dump"
    if m := re.search(r"(\w+) not raised", why):
        return f"expected {m.group(1)} not raised"
    if why.startswith("AssertionError"):
        return "values differ"
    return why.split(":", 1)[0]


def reason_class(why: str) -> tuple[str, str]:
    """(class, key): missing module, missing attribute, wrong value or other."""
    why = re.sub(r"\bspmd_torch\b", "torch_xla", why)  # the shim's modules by their torch_xla names
    if m := _MISSING_MODULE.search(why):
        return "missing module", m.group(1)
    if m := _CANNOT_IMPORT.search(why):
        return "missing attribute", f"{m.group(1)} of {m.group(2)}"
    if m := _MISSING_ATTR.search(why):
        return "missing attribute", f"{m.group(2)} of {m.group(1)}"
    if why.startswith("AssertionError"):  # assertEqual, assertTrue, torch.testing, assert
        return "wrong value", wrong_value_key(why)
    if why.startswith(("timeout", "crash", "not run")):
        return "other", why.split(":", 1)[0].split(" in ")[0]
    return "other", why.split(":", 1)[0] or "?"


def compare(real_path: pathlib.Path, spmd_path: pathlib.Path, examples: int) -> None:
    """Per area: tests passing on real, how many pass through spmd_torch; then the gaps."""
    real = {(r["file"], r["test"]): r for r in read_rows(real_path)}
    spmd = {(r["file"], r["test"]): r for r in read_rows(spmd_path)}
    passing = [k for k, r in real.items() if r["outcome"] == "passed"]
    uncollected = {r["file"]: r["why"] for r in spmd.values() if r["test"].startswith("<")}
    print(f"{'area':<26}{'real passed':>12}{'spmd also':>11}{'%':>7}{'spmd only':>11}")
    for area in AREAS + ("all",):
        keys = [k for k in passing if area == "all" or real[k]["area"] == area]
        ok = sum(1 for k in keys if spmd.get(k, {}).get("outcome") == "passed")
        pct = f"{100 * ok / len(keys):.1f}" if keys else "-"
        only = sum(  # pass through spmd_torch, not on real PyTorch/XLA on CPU
            1
            for k, r in spmd.items()
            if r["outcome"] == "passed"
            and real.get(k, {}).get("outcome") != "passed"
            and (area == "all" or r["area"] == area)
        )
        print(f"{area:<26}{len(keys):>12}{ok:>11}{pct:>7}{only:>11}")
    gaps = collections.defaultdict(lambda: collections.defaultdict(list))
    for k in passing:
        r = spmd.get(k)
        if r is None:  # its file did not collect (or did not run) through spmd_torch
            r = {"outcome": "error", "why": uncollected.get(k[0], "not run through spmd_torch")}
        if r["outcome"] != "passed":
            why = r["why"] if r["outcome"] != "skipped" else f"skipped: {r['why']}"
            cls, key = reason_class(why)
            gaps[cls][key].append((k, r["outcome"], why))
    for cls in ("missing module", "missing attribute", "wrong value", "other"):
        groups = gaps.get(cls, {})
        total = sum(len(v) for v in groups.values())
        print(f"\n== {cls}: {total} tests")
        for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(items):>5}  {key}")
            for (file, test), outcome, why in items[:examples]:
                print(f"           {file}::{test}  {outcome}: {why}")


# ---------------------------------------------------------------------------------------------


def print_table() -> None:
    for s in (*SUITES, *AS_TPU):
        how = "script" if s.script else "pytest"
        extra = " ".join(s.args + tuple(f"{k}={v}" for k, v in s.env))
        print(f"{s.area:<26}{s.path:<66}n={','.join(map(str, s.devices)):<5}{how:<7}{extra}")
    print("\nskipped (never on CPU):")
    for path, why in IMPOSSIBLE.items():
        print(f"  {path:<50}{why}")


def unlisted(ptxla: pathlib.Path) -> list[str]:
    """Test files of the areas' folders that neither table names."""
    test = ptxla / "test"
    files = [*test.glob("spmd/test_*.py"), *test.glob("pjrt/test_*.py"), *test.glob("test_mp_*.py")]
    files = [f for f in files if not f.name.endswith("_base.py")]  # a TestCase base, no tests
    known = {s.path for s in SUITES} | set(IMPOSSIBLE)
    return sorted(p for f in files if (p := str(f.relative_to(test))) not in known)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("spmd_torch", "real", "as_tpu"), default="spmd_torch")
    p.add_argument("--python", default=sys.executable, help="interpreter of the children")
    p.add_argument("--ptxla", type=pathlib.Path, default=pathlib.Path("/work/ptxla"))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("ptxla-results"))
    p.add_argument("--spmd-root", type=pathlib.Path, default=ROOT, help="put on PYTHONPATH")
    p.add_argument("--only", action="append", default=[], help="run files whose path has this")
    p.add_argument("--resume", action="store_true", help="keep the files already in the TSV")
    p.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("REAL", "SPMD"))
    p.add_argument("--examples", type=int, default=3, help="examples per reason in --compare")
    p.add_argument("--list", action="store_true", help="print the file table and the skips")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        print_table()
        return
    if args.compare:
        compare(*args.compare, args.examples)
        return
    for path in unlisted(args.ptxla):
        print(f"note: {path} is in neither SUITES nor IMPOSSIBLE", file=sys.stderr)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = out / f"tree-{args.target}"
    if not (args.resume and tree.exists()):
        tree = prepare_tree(args.ptxla.resolve(), out, args.target)
    run = Run(args.target, args.python, tree, out, args.spmd_root.resolve())
    tsv = run_all(run, selected(args.target, args.only), args.resume)
    print(f"\nresults: {tsv}")
    print_summary(read_rows(tsv))


if __name__ == "__main__":
    main()
