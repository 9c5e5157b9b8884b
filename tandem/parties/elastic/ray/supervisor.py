"""How many workers: the pure scaling rule `decide` (no Ray here).

`decide` is called every ``[ray] poll`` seconds with what `ray.available_resources()` reports
(nodes that joined since count at once) and the job's own workers. It returns +1 (start a
worker), -1 (stop one) or 0:

* fewer than ``min_workers`` live or starting: +1, room or not (Ray queues the actor until a
  node can hold it);
* a worker still starting (asked for, not yet placed): 0, since available resources do not
  show its claim yet;
* fewer than ``max_workers``, every resource a worker claims available beyond the reserve
  (``available[r] >= claim[r] + reserve[r]``) and no reserve short (below): +1 (a worker that
  claims no CPU must not be added while CPUs are short, or it would be stopped at once);
* more than ``min_workers`` and available CPUs below ``reserve_cpus`` (or GPUs below
  ``reserve_gpus``): -1, giving the room back to whoever needs it;
* otherwise 0.

One step at a time. A start shows as a starting worker at once; a stop frees its claim in
Ray's resources only later, so the launcher decides nothing after a stop until the freed CPUs
show (or a settle time passes), and the rule never overshoots. A worker that died (its node
went away) is simply no longer live; the rule replaces it when it may.
"""

from __future__ import annotations

from collections.abc import Mapping

from .job import RaySection


def fits(
    available: Mapping[str, float], claim: Mapping[str, float], reserve: Mapping[str, float]
) -> bool:
    """True when ``available`` holds ``claim`` and still keeps ``reserve`` free."""
    return all(available.get(r, 0.0) >= need + reserve.get(r, 0.0) for r, need in claim.items())


def decide(available: Mapping[str, float], live: int, starting: int, cfg: RaySection) -> int:
    """+1, -1 or 0 workers (module docstring)."""
    reserve = {"CPU": cfg.reserve_cpus, "GPU": cfg.reserve_gpus}
    if live + starting < cfg.min_workers:
        return 1
    if starting:
        return 0
    short = any(reserve[r] > 0 and available.get(r, 0.0) < reserve[r] for r in ("CPU", "GPU"))
    if live < cfg.max_workers and not short and fits(available, cfg.worker_claim(), reserve):
        return 1
    if live > cfg.min_workers and short:
        return -1
    return 0
