"""Where a pipelined window of W7gpu's compiled step loses time that blocked steps do not show:
each step's host time, blocked and pipelined, the compiles and Python's garbage collections in
the window (a full collection of a large heap pauses a step for hundreds of milliseconds), and,
with ``--sample``, the main thread's stack sampled every millisecond.

    python -m tools.bench.pipeline_probe [--tiny] [--lazy] [--sample]

Found with it (H200, torch 2.11, jax 0.11.2): one step in ten took 440-550 ms against ~40, a
full collection walking ~780k objects; see docs/performance-log.md, "The pipelined anomaly".
"""

from __future__ import annotations

import collections
import gc
import statistics
import sys
import threading
import time

from . import compiled, gpu
from .training import spmd_trainer


def sample(main_id: int, stop: threading.Event, counts: collections.Counter) -> None:
    """Counts the main thread's innermost four frames, once a millisecond, until `stop`."""
    while not stop.is_set():
        frame = sys._current_frames().get(main_id)
        stack = []
        while frame is not None and len(stack) < 4:
            code = frame.f_code
            stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        del frame  # a held frame keeps its locals alive: they would become program outputs
        counts[" < ".join(stack)] += 1
        time.sleep(0.001)


def collections_timed(pauses: list) -> object:
    """A gc callback appending (generation, ms) for each collection."""
    started = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        else:
            pauses.append((info["generation"], (time.perf_counter() - started.pop()) * 1e3))

    return callback


def main() -> None:
    import spmd_torch.debug.metrics as met

    cfg = gpu.config("--tiny" in sys.argv)
    args = (gpu.new_gpt2(cfg), gpu.new_adamw, gpu.gpt_loss, gpu.gpt2_data(cfg))
    if "--lazy" in sys.argv:
        tr = spmd_trainer(*args, autocast_dtype=gpu.AUTOCAST_DTYPE)
    else:
        tr = compiled.trainer(*args, compiled.BACKEND, gpu.AUTOCAST_DTYPE)
    for _ in range(3):
        tr.step()
        tr.wait()
    blocked = []
    for _ in range(5):
        t0 = time.perf_counter()
        tr.step()
        t1 = time.perf_counter()
        tr.wait()
        blocked.append(f"{(t1 - t0) * 1e3:.1f}+{(time.perf_counter() - t1) * 1e3:.1f}")
    print("blocked steps, host+wait ms:", " ".join(blocked))

    counts: collections.Counter = collections.Counter()
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(threading.get_ident(), stop, counts))
    if "--sample" in sys.argv:
        sampler.start()
    pauses: list = []
    gc.callbacks.insert(0, collections_timed(pauses))
    compiles = met.counter_value("UncachedCompile") or 0
    host = []
    t_start = time.perf_counter()
    for _ in range(20):
        t0 = time.perf_counter()
        tr.step()
        host.append(time.perf_counter() - t0)
    t_wait = time.perf_counter()
    tr.wait()
    t_end = time.perf_counter()
    stop.set()
    gc.callbacks.pop(0)
    print("pipelined steps, host ms:", " ".join(f"{h * 1e3:.1f}" for h in host))
    print(
        f"pipelined: {(t_end - t_start) * 50:.1f} ms/step, host median "
        f"{statistics.median(host) * 1e3:.1f}, final wait {(t_end - t_wait) * 1e3:.1f} ms, "
        f"compiles {(met.counter_value('UncachedCompile') or 0) - compiles}"
    )
    full = [f"{ms:.0f}" for generation, ms in pauses if generation == 2]
    young = sum(ms for generation, ms in pauses if generation < 2)
    print(
        f"collections: {len(pauses)}, young ones {young / 20:.2f} ms/step, full ones (ms): "
        f"{' '.join(full) or 'none'}; {len(gc.get_objects())} objects tracked, "
        f"{gc.get_freeze_count()} frozen"
    )
    if counts:
        sampler.join()
        total = sum(counts.values())
        for stack, n in counts.most_common(12):
            print(f"{n / total:6.1%}  {stack}")


if __name__ == "__main__":
    main()
