"""Cut-layer compression: how a split-learning message (an activation or its gradient) travels.

A `CutCompressor` is a pure triple, as optax's transformations are: `CutCompressor.init` makes
the state of one channel, `CutCompressor.encode` turns ``x = dtype[rows, *shape]`` into a
*payload* (a tuple of arrays the frame codec carries as they are: no pickle) and the next
state, `CutCompressor.decode` rebuilds ``dtype[rows, *shape]`` from a payload. Nothing is
random, so no key is needed: a sender and a receiver that agree on the kind and the fraction
agree on every byte. Kinds (`KINDS`; the task spec records the kind, `spec.build_spec`):

* ``"none"`` (the default): the tensor itself, one array; exact training.
* ``"bfloat16"``: one ``bfloat16[rows, *shape]`` array (2 bytes per value).
* ``"int8"``: ``int8[rows, *shape]`` and ``float32[rows]`` scales; row ``r`` decodes as
  ``q[r] * scale[r]`` with ``scale[r] = max|x[r]| / 127`` (round to nearest), so the error of
  each value is at most ``scale[r] / 2``.
* ``"topk"``: per row, the ``k = ceil(fraction * width)`` values of largest magnitude of the
  row flattened to ``width`` values: ``int32[rows, k]`` indices and ``dtype[rows, k]`` values
  (ties: lower index first); the other values decode as zero.

**Error feedback at the cut** (``int8`` and ``topk``, `CutCompressor.feedback`). A cut
message's rows are samples, and the next message holds other samples, so a residual carried
from one message to the next (per channel, per slot) would add sample ``i``'s compression
error to sample ``j``'s tensor: noise, not feedback. The residual is therefore kept *per
sample*, keyed by the row's id in the training set, and only on the gradient direction:

* gradients: the party sending ``grad/...`` adds to each row the residual of that sample
  (``v = g + e[id]``), sends ``C(v)`` and keeps ``e[id] = v - D(C(v))``. The bottom stage's
  parameter gradient is a sum over samples of ``J_i^T g_i``; each sample's dropped part is
  applied when that sample comes back (next epoch), through its own Jacobian, which is the
  error-feedback argument applied per sample. The residual stays bounded: for int8 every entry
  is at most half a quantisation step of its row; for top-k ``|e| <= |v|`` (a contraction).
* activations: no feedback. A forward value is not summed over time: adding last epoch's
  error to this epoch's activation makes this forward pass wrong by that error instead of
  correcting anything. (Delta compression against a per-sample reference both sides keep, as
  AQ-SGD does, is the activation-side alternative; it costs the same per-sample memory on
  both parties.) SplitFC and the randomized top-k of split learning compress activations
  without feedback as well.

Memory cost of feedback: ``float32[train rows, width]`` per gradient channel on the party
sending gradients (the loss party in a two-party job), allocated as the largest row id seen
grows; e.g. 1M rows at a 64-wide cut hold 256 MB. Evaluation batches and messages without row
ids carry no feedback. Residuals are not checkpointed: a resumed run starts them at zero.

Invariants: ``decode(encode(x)) `` has ``x``'s shape and dtype; ``"none"`` returns ``x``
itself (bit for bit); `CutCompressor.layout` gives the dtype and shape of every payload array,
which the receiver, the plan admission and the spec's validator check before decoding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from tandem.errors import ConfigError, ShapeError

KINDS = ("none", "bfloat16", "int8", "topk")
DEFAULT_KIND = "none"
DEFAULT_TOPK = 0.1
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: one message (`tandem.engine.runtime.Payload`, spelled out here so that this module and the
#: spec that imports it import no asyncio): the tensor itself, or a tuple of arrays
Payload = np.ndarray | tuple[np.ndarray, ...]


@dataclasses.dataclass
class Feedback:
    """State of one channel of a compressor with error feedback: ``residual[id]`` is the part
    of sample ``id``'s last tensor that did not travel (zeros for samples not seen yet).

    The table is owned by this state and updated in place for the rows of each message
    (copying a table of every training row per message would cost more than the message);
    `CutCompressor.encode` returns the state it was given."""

    width: int
    residual: np.ndarray  # float32[capacity, width]

    @property
    def nbytes(self) -> int:
        return int(self.residual.nbytes)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The residuals of samples ``ids`` (a copy), growing the table to hold them.

        Invariant: ``len(residual)`` is the largest id seen + 1."""
        top = int(ids.max()) + 1 if len(ids) else 0
        if top > len(self.residual):
            # exactly to the largest id: shuffled batches reach near the last row within the
            # first few, so this copies a few times per run, and the table never holds more
            # rows than the training set
            grown = np.zeros((top, self.width), np.float32)
            grown[: len(self.residual)] = self.residual
            self.residual = grown
        return self.residual[ids]


@dataclasses.dataclass(frozen=True)
class CutCompressor:
    """One kind of cut-layer compression (see the module docstring).

    Args:
      kind: one of `KINDS`.
      fraction: for ``"topk"``, the share of each row's values sent, in (0, 1].
    """

    kind: str = DEFAULT_KIND
    fraction: float = DEFAULT_TOPK

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                f"unknown cut compression {self.kind!r}; choose one of {list(KINDS)} "
                f"({DEFAULT_KIND!r}, the default, trains exactly)"
            )
        if isinstance(self.fraction, bool) or not 0.0 < float(self.fraction) <= 1.0:
            raise ConfigError(
                f"compress_topk must be a fraction in (0, 1] of each row's values, got "
                f"{self.fraction!r}"
            )

    @property
    def exact(self) -> bool:
        """True for ``"none"``: the tensor travels as it is."""
        return self.kind == "none"

    @property
    def feedback(self) -> bool:
        """Whether gradients carry per-sample error feedback (``int8``, ``topk``)."""
        return self.kind in ("int8", "topk")

    def k(self, width: int) -> int:
        """Values a top-k row keeps out of ``width``."""
        return max(1, min(width, math.ceil(float(self.fraction) * width)))

    # -- the contract --------------------------------------------------------------------------
    def init(self, shape: Sequence[int]) -> Feedback | None:
        """The state of one channel whose tensors are ``[rows, *shape]``: a `Feedback` for the
        kinds with feedback, else None."""
        if not self.feedback:
            return None
        return Feedback(math.prod(shape), np.zeros((0, math.prod(shape)), np.float32))

    def encode(
        self, state: Feedback | None, x: np.ndarray, ids: np.ndarray | None = None
    ) -> tuple[Payload, Feedback | None]:
        """``(payload, state)`` of tensor ``x = dtype[rows, *shape]``. With ``ids`` (the rows'
        sample ids) and a `Feedback` state, each row's residual is added before compressing
        and what did not travel becomes its new residual; without either, no feedback."""
        if self.exact:
            return x, state
        x = np.asarray(x)
        if self.kind == "bfloat16":
            return x.astype(_BF16), state
        rows = x.shape[0]
        flat = x.reshape(rows, -1).astype(np.float32, copy=False)
        if state is None or ids is None:
            return self._encode_flat(flat, x.shape, x.dtype), state
        flat = flat + state.rows(ids)
        payload = self._encode_flat(flat, x.shape, x.dtype)
        sent = self.decode(payload, x.shape[1:], "float32").reshape(rows, -1)
        state.residual[ids] = flat - sent
        return payload, state

    def decode(self, payload: Payload, shape: Sequence[int], dtype: str) -> np.ndarray:
        """``dtype[rows, *shape]`` from a payload whose layout was checked (`check`)."""
        if self.exact:
            return payload  # type: ignore[return-value]
        out_dtype = np.dtype(_BF16 if dtype == "bfloat16" else dtype)
        if self.kind == "bfloat16":
            return np.asarray(payload).astype(out_dtype)
        q, second = payload
        rows = q.shape[0]
        if self.kind == "int8":
            flat = q.reshape(rows, -1).astype(np.float32) * second.astype(np.float32)[:, None]
        else:
            width = math.prod(shape)
            if q.size and (int(q.min()) < 0 or int(q.max()) >= width):
                raise ShapeError(
                    f"top-k indices reach {int(q.min())}..{int(q.max())}; a row has {width} "
                    "values (0..width-1)"
                )
            flat = np.zeros((rows, width), np.float32)
            np.put_along_axis(flat, q.astype(np.int64), second.astype(np.float32), axis=1)
        return flat.reshape(rows, *shape).astype(out_dtype, copy=False)

    def _encode_flat(
        self, flat: np.ndarray, shape: tuple[int, ...], dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        rows = flat.shape[0]
        if self.kind == "int8":
            peak = np.max(np.abs(flat), axis=1) if flat.shape[1] else np.zeros(rows, np.float32)
            scale = (peak / 127.0).astype(np.float32)
            safe = np.where(scale > 0, scale, np.float32(1.0))
            q = np.clip(np.rint(flat / safe[:, None]), -127, 127).astype(np.int8)
            return q.reshape(shape), scale
        k = self.k(flat.shape[1])
        # a stable sort of -|v| keeps ties in index order (argpartition does not)
        idx = np.argsort(-np.abs(flat), axis=1, kind="stable")[:, :k]
        idx.sort(axis=1)
        values = np.take_along_axis(flat, idx, axis=1).astype(dtype)
        return idx.astype(np.int32), values

    # -- what travels --------------------------------------------------------------------------
    def layout(
        self, rows: int, shape: Sequence[int], dtype: str
    ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(dtype name, shape)`` of each payload array of a ``dtype[rows, *shape]`` tensor."""
        shape = tuple(int(d) for d in shape)
        if self.kind == "none":
            return ((dtype, (rows, *shape)),)
        if self.kind == "bfloat16":
            return (("bfloat16", (rows, *shape)),)
        if self.kind == "int8":
            return (("int8", (rows, *shape)), ("float32", (rows,)))
        k = self.k(math.prod(shape))
        return (("int32", (rows, k)), (dtype, (rows, k)))

    def check(self, arrays: Sequence[np.ndarray], shape: Sequence[int], dtype: str) -> list[str]:
        """What differs between ``arrays`` and the layout of a message of ``shape`` and
        ``dtype`` (its rows read from the first array); [] when they match."""
        if not arrays or np.ndim(arrays[0]) < 1:
            return ["arrays"]
        want = self.layout(int(np.shape(arrays[0])[0]), shape, dtype)
        if len(arrays) != len(want):
            return ["arrays"]
        wrong = []
        for a, (wd, ws) in zip(arrays, want, strict=True):
            if a.dtype.name != wd and "dtype" not in wrong:
                wrong.append("dtype")
            if tuple(a.shape) != ws and "shape" not in wrong:
                wrong.append("shape")
        return wrong

    def describe(self, rows: int | str, shape: Sequence[int], dtype: str) -> str:
        """The layout as text, e.g. ``int8[rows, 64] + float32[rows]``."""
        r = str(rows)
        parts = []
        for d, s in self.layout(1, shape, dtype):
            parts.append(f"{d}[{', '.join([r, *(str(x) for x in s[1:])])}]")
        return " + ".join(parts)

    # -- the task spec -------------------------------------------------------------------------
    def spec_fields(self) -> dict[str, Any]:
        """What a task spec's ``hyper`` records: the kind, and the fraction for ``"topk"``
        (the only kind it applies to)."""
        return {
            "compress": self.kind,
            **({"compress_topk": self.fraction} if self.kind == "topk" else {}),
        }


def from_hyper(hyper: Mapping[str, Any]) -> CutCompressor:
    """The compressor a task spec's ``hyper`` (or a ``[train]`` table) names."""
    return CutCompressor(
        str(hyper.get("compress", DEFAULT_KIND)), float(hyper.get("compress_topk", DEFAULT_TOPK))
    )


def payload_arrays(payload: Payload) -> tuple[np.ndarray, ...]:
    """The arrays a frame carries for ``payload``."""
    return payload if isinstance(payload, tuple) else (payload,)


def mismatch_reasons(
    party: str, spec_hyper: Mapping[str, Any], train: Mapping[str, Any]
) -> list[str]:
    """Why a follower whose ``[train]`` table sets compression differently from the spec
    refuses it ([] when its table sets none or the same). A follower adopts the leader's
    compression; one it states itself must agree."""
    theirs = from_hyper(spec_hyper)
    reasons = []
    if "compress" in train and str(train["compress"]) != theirs.kind:
        reasons.append(
            f"[train] compress: the leader's spec says {theirs.kind!r} but {party!r}'s config "
            f"says {train['compress']!r}; set compress = {theirs.kind!r} in {party!r}'s "
            "[train] (or remove it: followers adopt the leader's)"
        )
    if (
        theirs.kind == "topk"
        and "compress_topk" in train
        and float(train["compress_topk"]) != theirs.fraction
    ):
        reasons.append(
            f"[train] compress_topk: the leader's spec says {theirs.fraction} but {party!r}'s "
            f"config says {train['compress_topk']}; set compress_topk = {theirs.fraction} in "
            f"{party!r}'s [train] (or remove it: followers adopt the leader's)"
        )
    return reasons


__all__ = [
    "KINDS",
    "CutCompressor",
    "Feedback",
    "Payload",
    "from_hyper",
    "mismatch_reasons",
    "payload_arrays",
]
