"""Named configurations shared by ``tandem fl demo`` and ``bench/fl.py``.

``compressed`` is the setting the benchmark measures: rand-k uplink keeping 1/``uplink_ratio``
of the coordinates, server momentum 0.9 with error feedback applying the top 1/``topk_ratio``
coordinates at server learning rate 0.1, version-delta downlink. With ``sketch=True`` the uplink
is a count sketch of the same payload (`sketch_shape`) instead of rand-k.
"""

from __future__ import annotations

from tandem.errors import ConfigError

from .aggregate import ServerRule
from .server import FLConfig
from .warmup import Warmup

SKETCH_ROWS = 5
"""Rows of the preset count sketch: the robust estimate (`compression.sketch_estimate`) then
takes what 4 of the 5 rows agree on, so a light coordinate outranks the heavy ones only when 4
rows put heavy coordinates of one sign in its bucket (see docs/federated.md, "Count sketch")."""


def dense(**kw) -> FLConfig:
    """Plain FedAvg: dense updates both ways."""
    return FLConfig(**kw)


def sketch_shape(d: int, uplink_ratio: int = 60, rows: int = SKETCH_ROWS) -> tuple[int, int]:
    """``(rows, cols)`` of a count sketch carrying about ``d / uplink_ratio`` floats:
    ``cols = max(1, d // uplink_ratio // rows)``, so ``rows * cols <= max(rows, d //
    uplink_ratio)``."""
    if d < 1 or uplink_ratio < 1 or rows < 1:
        raise ConfigError(
            f"sketch_shape needs d, uplink_ratio and rows >= 1, got {d}, {uplink_ratio}, {rows}"
        )
    return rows, max(1, d // uplink_ratio // rows)


def compressed(
    d: int,
    *,
    uplink_ratio: int = 60,
    topk_ratio: int = 50,
    momentum: float = 0.9,
    server_lr: float = 0.1,
    downlink: str = "version",
    sketch: bool = False,
    sketch_rows: int = SKETCH_ROWS,
    warmup: Warmup | None = None,
    uplink_bits: int = 0,
    quant_block: int = 256,
    feedback_max_gap: int = 3,
    **kw,
) -> FLConfig:
    """Compressed both ways (see module doc); ``sketch`` uses a ``sketch_rows`` x ``cols``
    count sketch of the same payload (`sketch_shape`) instead of rand-k. ``warmup`` (a
    `Warmup`; ``[compression]`` of a server's TOML gives ``Warmup(2, 4)``) starts dense and
    ramps to these ratios; None compresses from round one.

    ``uplink_bits`` (2, 4 or 8; 0: off) sends every coordinate at that many bits instead
    (`quantize`, blocks of ``quant_block``, each client's error feedback kept for
    ``feedback_max_gap`` rounds) and applies every coordinate of the server's step (no top-k:
    ``topk_ratio``, ``sketch`` and ``uplink_ratio`` are then unused, and ``warmup`` changes
    nothing). On ``bench.fl_compressed`` 4 bits track dense round by round."""
    if uplink_bits:
        uplink = {
            "kind": "quant",
            "bits": uplink_bits,
            "block": quant_block,
            "max_gap": feedback_max_gap,
        }
        rule = ServerRule(momentum=momentum, topk=None, lr=server_lr)
        return FLConfig(uplink=uplink, rule=rule, downlink=downlink, warmup=warmup, **kw)
    if sketch:
        rows, cols = sketch_shape(d, uplink_ratio, sketch_rows)
        uplink = {"kind": "sketch", "rows": rows, "cols": cols}
    else:
        uplink = {"kind": "randk", "k": max(1, d // uplink_ratio)}
    rule = ServerRule(
        momentum=momentum, topk=max(1, d // topk_ratio), lr=server_lr, momentum_stop=sketch
    )
    return FLConfig(uplink=uplink, rule=rule, downlink=downlink, warmup=warmup, **kw)
