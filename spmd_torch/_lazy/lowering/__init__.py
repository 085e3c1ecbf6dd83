"""THE registry of lowerings (registry.py) with every table loaded: importing this package fills
``LOWERINGS``. Each table module registers its ops at import."""

from . import (  # noqa: F401  (each module fills LOWERINGS at import)
    amp,
    attention,
    barrier,
    collectives,
    ctc,
    elementwise,
    factories,
    fft,
    foreach,
    grid_sample,
    indexing,
    ldl,
    linalg,
    nn,
    paged,
    quantized,
    random,
    reductions,
    rnn,
    sharding,
    special,
    splash,
)
from .registry import LOWERINGS, EngineOp, Lowering, lowers, register_table

foreach.register_all()  # each foreach op over its element op's lowering: the tables come first

__all__ = ["LOWERINGS", "EngineOp", "Lowering", "lowers", "register_table"]
