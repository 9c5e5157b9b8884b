"""Named configurations shared by ``tandem fl demo`` and ``bench/fl.py``.

``compressed`` is the setting the benchmark measures: rand-k uplink keeping 1/``uplink_ratio``
of the coordinates, server momentum 0.9 with error feedback applying the top 1/``topk_ratio``
coordinates at server learning rate 0.1, version-delta downlink.
"""

from __future__ import annotations

from .aggregate import ServerRule
from .server import FLConfig


def dense(**kw) -> FLConfig:
    """Plain FedAvg: dense updates both ways."""
    return FLConfig(**kw)


def compressed(
    d: int,
    *,
    uplink_ratio: int = 60,
    topk_ratio: int = 50,
    momentum: float = 0.9,
    server_lr: float = 0.1,
    downlink: str = "version",
    sketch: bool = False,
    **kw,
) -> FLConfig:
    """Compressed both ways (see module doc); ``sketch`` uses a 1-row count sketch of the
    same size instead of rand-k."""
    size = max(1, d // uplink_ratio)
    uplink = {"kind": "sketch", "rows": 1, "cols": size} if sketch else {"kind": "randk", "k": size}
    rule = ServerRule(
        momentum=momentum, topk=max(1, d // topk_ratio), lr=server_lr, momentum_stop=sketch
    )
    return FLConfig(uplink=uplink, rule=rule, downlink=downlink, **kw)
