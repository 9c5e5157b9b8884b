"""The kernel-by-kernel breakdown of `bench.scale`: where a batch's time goes, in the parties'
kernels and in the centralized reference's, measured one kernel at a time.

``python -m bench.scale_kernels FOLDER --parties leader,f1 --groups N --which pipelined``
(`bench.scale` starts it, once per side, under the same CPU pinning and XLA flags as the
party processes for ``pipelined``, and as its own process for ``centralized``; ``--which
both`` times both sides in one process, as `bench.scale` does when the parties start as it
does, ``--party-threads shared``) prints ONE JSON line (with ``both``: ``{"pipelined": ...,
"centralized": ...}``, each side's keys as it prints them alone): for ``--batches`` batches
of ``--batch-size`` rows after one warm-up batch (its compilations), each kernel's
milliseconds per batch, by the wall clock (``wall_ms``) and by this process's CPU clock
(``cpu_ms``: on a loaded machine the wall clock also counts the time other processes held
the CPU; CPU time does not).

``pipelined`` runs what the parties run per batch with ``N`` groups, each as its kernel
pieces (`kernel_pieces`: whole tiles, then the rest) at their `bucket_rows` sizes
(`StageKernels`, the same calls as `StageHandler.compute`; every piece is sent on its own
here, where the parties send a group's pieces as one message), every kernel followed by
``jax.block_until_ready``: ``forward`` (every bottom, every group), ``loss`` (the top's fused
loss step), ``backward`` (every bottom), ``update`` and ``zeros`` (once per stage),
``d2h`` (activations and cut gradients copied to the host to be sent), ``h2d`` (received
ones copied to the device), ``encode``/``decode`` (the frame codec, both directions). It also
reports ``padded_rows``: rows computed ÷ rows of the batch at this ``N`` (the bucket
ladder's padding). The parties run these on two CPUs at once; the per-party sums
(``by_party``) show the critical path: the leader's lane.

``centralized`` runs the reference's fused step (forward, gradients, Adam: one kernel), and,
for the split of its time, its ``forward``, ``value_and_grad`` and ``update`` alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class Clock:
    """Milliseconds per kernel name, by the wall clock and the CPU clock."""

    def __init__(self) -> None:
        self.wall: collections.Counter[str] = collections.Counter()
        self.cpu: collections.Counter[str] = collections.Counter()
        self.on = True

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, waited for (``jax.block_until_ready``) and timed."""
        import jax

        w, c = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn(*args, **kwargs))
        if self.on:
            self.wall[name] += (time.perf_counter() - w) * 1e3
            self.cpu[name] += (time.process_time() - c) * 1e3
        return out

    def per_batch(self, batches: int) -> dict[str, dict[str, float]]:
        def table(c: collections.Counter[str]) -> dict[str, float]:
            return {k: round(v / batches, 3) for k, v in sorted(c.items())}

        return {"wall_ms": table(self.wall), "cpu_ms": table(self.cpu)}


def load(folder: Path, parties: list[str], cut: int) -> dict[str, Any]:
    """The parties' training data and stage models, built from their TOMLs as
    `bench.scale.centralized` builds them."""
    import jax

    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.stages import _stable_hash

    os.environ.setdefault("TANDEM_SECRET", "breakdown")  # the TOMLs name it; nothing is sent
    configs = {p: load_party_config(folder / f"{p}.toml") for p in parties}
    data = {p: configs[p].load_data() for p in parties}
    top = configs[parties[0]].topology().by_name["top"]
    order = [str(s) for s in top.inputs]
    models = {
        f"bottom_{p}": configs[p].stage_model(
            f"bottom_{p}", [data[p].train.shape[1]], data[p].vocab
        )
        for p in parties
    }
    models["top"] = configs[parties[0]].stage_model("top", [cut] * len(order))
    key = jax.random.PRNGKey(0)
    init = {s: m.init(jax.random.fold_in(key, _stable_hash(s))) for s, m in models.items()}
    return {"data": data, "models": models, "init": init, "order": order}


def _encode(channel: str, host: np.ndarray) -> bytes:
    from tandem.transports.base import Frame
    from tandem.transports.codec import encode

    return encode(Frame(channel=channel, arrays=(host,)))


def _decode(wire: bytes) -> np.ndarray:
    from tandem.transports.codec import decode

    return decode(wire).arrays[0]


def pipelined(
    loaded: dict[str, Any], groups: int, batch: int, batches: int, lr: float
) -> dict[str, Any]:
    """The parties' kernels per batch (module docstring)."""
    import jax.numpy as jnp
    import optax

    from tandem.engine.kernels import StageKernels, get_loss, owned_copy
    from tandem.engine.microbatch import bucket_rows, group_bounds, kernel_pieces, tile_sizes

    data, models, order = loaded["data"], loaded["models"], loaded["order"]
    leader = next(iter(data))
    k = {
        s: StageKernels(m, optax.adam(lr), get_loss("binary") if s == "top" else None)
        for s, m in models.items()
    }
    params = {s: owned_copy(loaded["init"][s]) for s in models}  # update donates them
    opt = {s: k[s].init_opt(params[s]) for s in models}
    tiles = tile_sizes(batch)  # each group runs as its kernel pieces, as the parties run it
    bounds = [p for lo, hi in group_bounds(batch, groups) for p in kernel_pieces(lo, hi, tiles)]
    padded = [bucket_rows(hi - lo, batch) for lo, hi in bounds]
    clock = Clock()
    owner = {s: s.removeprefix("bottom_") if s != "top" else leader for s in models}
    by_party = {p: Clock() for p in data}  # each kernel's time on its party's lane

    def timed(where: str, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` timed as kernel ``name`` on the lane of ``where`` (a stage or a party)."""
        party = owner.get(where, where)
        wall, cpu = clock.wall[name], clock.cpu[name]
        out = clock.run(name, fn, *args, **kwargs)
        by_party[party].wall[name] += clock.wall[name] - wall
        by_party[party].cpu[name] += clock.cpu[name] - cpu
        return out

    def pad(x: np.ndarray, rows: int) -> np.ndarray:
        return (
            x
            if len(x) == rows
            else np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)])
        )

    y_all = data[leader].y_train
    for b in range(batches + 1):
        clock.on = b > 0
        lo_b = (b * batch) % max(len(y_all) - batch, 1)
        acc = {s: timed(s, "zeros", k[s].zeros, params[s]) for s in models}
        loss_acc = jnp.zeros((), jnp.float32)
        for (lo, hi), rows in zip(bounds, padded, strict=True):
            mask = np.arange(rows) < hi - lo
            acts, vjps = [], {}
            for s in order:
                x = pad(
                    np.asarray(data[s.removeprefix("bottom_")].train[lo_b + lo : lo_b + hi]), rows
                )
                y, vjps[s] = timed(s, "forward", k[s].forward, params[s], x)
                if owner[s] != leader:  # sent to the leader: to the host, the codec, the device
                    host = timed(s, "d2h", np.asarray, y)
                    wire = timed(s, "encode", _encode, "act", host)
                    got = timed(leader, "decode", _decode, wire)
                    y = timed(leader, "h2d", jnp.asarray, got)
                acts.append(y)
            labels = pad(y_all[lo_b + lo : lo_b + hi], rows)
            acc["top"], loss_acc, _, gxs = timed(
                "top",
                "loss",
                k["top"].loss_step,
                params["top"],
                acc["top"],
                loss_acc,
                labels,
                np.float32(1 / batch),
                *acts,
                mask=mask,
            )
            for s, g in zip(order, gxs, strict=True):
                if owner[s] != leader:
                    host = timed(leader, "d2h", np.asarray, g)
                    wire = timed(leader, "encode", _encode, "grad", host)
                    g = timed(s, "decode", _decode, wire)
                    g = timed(s, "h2d", jnp.asarray, g)
                acc[s], _ = timed(s, "backward", k[s].backward, vjps[s], g, acc[s])
        for s in models:
            params[s], opt[s] = timed(s, "update", k[s].update, params[s], opt[s], acc[s])
    out = clock.per_batch(batches)
    for clock_name, of in (("by_party_wall_ms", "wall"), ("by_party_cpu_ms", "cpu")):
        out[clock_name] = {
            p: round(sum(getattr(c, of).values()) / batches, 3) for p, c in by_party.items()
        }
    out["padded_rows"] = round(sum(padded) / batch, 4)
    out["groups"] = groups
    return out


def centralized(loaded: dict[str, Any], batch: int, batches: int, lr: float) -> dict[str, Any]:
    """The reference's step per batch, and its parts alone (module docstring)."""
    import jax
    import optax

    from tandem.engine.kernels import get_loss, owned_copy

    data, models, order = loaded["data"], loaded["models"], loaded["order"]
    leader = next(iter(data))
    loss = get_loss("binary")
    optimizer = optax.adam(lr)
    params = {s: owned_copy(loaded["init"][s]) for s in models}  # update donates them
    opt_state = optimizer.init(params)

    def forward(params, xs):
        zs = [models[b].apply(params[b], x) for b, x in zip(order, xs, strict=True)]
        return models["top"].apply(params["top"], *zs)

    def objective(params, xs, labels):
        return jax.numpy.sum(loss(forward(params, xs), labels)) / labels.shape[0]

    grad = jax.jit(jax.value_and_grad(objective))
    fwd = jax.jit(forward)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def step(params, opt_state, xs, labels):
        value, grads = jax.value_and_grad(objective)(params, xs, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    clock = Clock()
    y_all = data[leader].y_train
    for b in range(batches + 1):
        clock.on = b > 0
        lo = (b * batch) % max(len(y_all) - batch, 1)
        xs = [np.asarray(data[s.removeprefix("bottom_")].train[lo : lo + batch]) for s in order]
        labels = y_all[lo : lo + batch]
        clock.run("forward", fwd, params, xs)
        _, grads = clock.run("value_and_grad", grad, params, xs, labels)
        clock.run("update", update, params, opt_state, grads)
        params, opt_state, _ = clock.run("step", step, params, opt_state, xs, labels)
    return clock.per_batch(batches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.scale_kernels", description=__doc__.split("\n")[0]
    )
    ap.add_argument("folder", type=Path)
    ap.add_argument("--parties", required=True, help="comma-separated, the leader first")
    ap.add_argument(
        "--which",
        choices=("pipelined", "centralized", "both"),
        required=True,
        help="the parties' kernels, the centralized reference's, or both in this process",
    )
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--learning-rate", type=float, default=0.002)
    ap.add_argument("--cut", type=int, required=True)
    args = ap.parse_args(argv)
    loaded = load(args.folder, args.parties.split(","), args.cut)
    out: dict[str, Any] = {}
    if args.which in ("pipelined", "both"):
        out["pipelined"] = pipelined(
            loaded, args.groups, args.batch_size, args.batches, args.learning_rate
        )
    if args.which in ("centralized", "both"):
        out["centralized"] = centralized(loaded, args.batch_size, args.batches, args.learning_rate)
    print(json.dumps(out if args.which == "both" else out[args.which]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
