"""`StageHandler`: executes one party's split-learning ops with its stages' jitted kernels.

Party state is explicit: ``params`` and ``opt_state`` map each local stage name to a pytree;
`StageHandler.begin` binds one batch (this party's feature rows, the labels if it owns the loss
stage, the group bounds, the chunks per group); `compute` runs ``F``/``L``/``B``/``U`` ops and
returns the tensors to send, keyed by ``(channel, micro-batch)`` of each send; `receive` checks
and stores what peers sent.

With ``chunks = c > 1`` (`tandem.engine.plan`) messages are parts of groups: a party computing per
group sends each output as ``c`` row slices and concatenates the ``c`` parts it receives before
the op that consumes them; the loss party computes per part.

Cut compression (`tandem.parties.split.compress`): with a compressor other than ``"none"``
every outgoing message is encoded (`_scatter`) and every arriving one checked and decoded
(`receive`); gradients carry per-sample error feedback keyed by the batch's row ids
(``begin(row_ids=...)``), whose residuals this handler keeps across batches, one table per
gradient channel. With ``"none"`` messages are the tensors themselves, as without it.

Bounded shapes: each compute op runs its group in *pieces*
(`tandem.engine.microbatch.kernel_pieces`): a group of more rows than the job's tile
(`tile_rows` of the party's batch size, ``pad_to``) in calls of the job's `tile_sizes` (the
tile, doubled up to twice: the largest that fits the rows left) and one for the rest, a
smaller group in one call. Each piece runs padded with zero rows to
`tandem.engine.microbatch.bucket_rows` of its size, so whatever group count the tuner tries,
the kernels see a few shapes and compile each once (counts cut on whole tiles: the tile
sizes alone). The ladder is capped at the party's batch size, and a batch shorter than that
(an epoch's last) runs each piece at the smallest size already compiled that holds it, so it
compiles nothing new. Pieces and padding stay inside the party: what it sends is the group's
real rows in one message (a peer cuts and pads what it receives itself), the loss stage masks
the padded rows out of the loss (``loss_step(mask=...)``), so their cotangents, and what they
add to any parameter gradient, are zero; `predictions` returns real rows only.

Summed cuts (``cut_sum``, `tandem.parties.privacy.securesum.CutSum`): the summing stage's
kernels take one input, the sum of its K cuts (`_inputs`), and its one input gradient goes back
on every cut's gradient channel; with a secure sum a follower sends its cut as masked ring words
(`_scatter`), keyed by the batch number (`begin` calls since construction) and the row ids.

Exactness: the loss stage scales each micro-batch's summed loss by ``1/B`` (``B`` = batch rows),
gradients are summed over micro-batches, and ``U`` applies one optax update per batch, so any
``n`` gives the parameters of ``n = 1`` up to floating-point reassociation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from tandem.engine.data import BatchRows
from tandem.engine.kernels import StageKernels, StageModel, owned_copy
from tandem.engine.microbatch import (
    bucket_rows,
    chunk_bounds,
    kernel_pieces,
    shared_shape_counts,
    tile_sizes,
)
from tandem.engine.plan import Kind, Op, computes_per_message
from tandem.engine.topology import FEATURES, Topology
from tandem.errors import ConfigError, ShapeError
from tandem.parties.privacy.audit import PartyAudit

from ..privacy.config import Privacy
from ..privacy.cut import CutDefenses
from ..privacy.securesum import CutSum
from .compress import CutCompressor, Feedback, payload_arrays


class StageHandler:
    """Implements `tandem.engine.runtime.OpHandler` for the stages ``party`` owns in
    ``topology``."""

    def __init__(
        self,
        topology: Topology,
        party: str,
        models: Mapping[str, StageModel],
        optimizer: optax.GradientTransformation,
        *,
        loss=None,
        key: jax.Array | None = None,
        params: Mapping[str, Any] | None = None,
        compressor: CutCompressor | None = None,
        privacy: Privacy | None = None,
        cut_sum: CutSum | None = None,
        pad_to: int = 0,
    ) -> None:
        self.topology = topology
        self.cut_sum = cut_sum
        #: the rows a group may be padded up to, at least the bound batch's: the party's batch
        #: size, so a shorter batch (an epoch's last) runs at sizes full batches compiled
        self.pad_to = pad_to
        self._batches = -1  # `begin` calls; the constructor's own makes it 0
        #: the padded sizes compute ops ran at so far, for prediction (False) and training
        self._sizes_run: dict[bool, set[int]] = {False: set(), True: set()}
        #: how cut messages travel; ``feedback`` holds each gradient channel's residuals
        self.compressor = compressor or CutCompressor()
        self.feedback: dict[str, Feedback | None] = {}
        self.party = party
        self.stages = {s.name: s for s in topology.stages_of(party)}
        missing = [s for s in self.stages if s not in models]
        if missing:
            raise ConfigError(f"party {party!r} needs a StageModel for stages {missing}")
        self.models = {s: models[s] for s in self.stages}
        known = [s.name for s in topology.stages if s.name in models]
        #: per known stage: the flat width of its output, the output's shape after the rows
        #: (``(width,)`` for a matrix) and its dtype: what its cut tensors must be
        self.out_dims = {s: models[s].out_dim for s in known}
        self.out_shapes = {s: tuple(models[s].out_shape or ()) for s in known}
        self.out_dtypes = {s: models[s].out_dtype for s in known}
        owns_loss = any(s.loss for s in self.stages.values())
        if owns_loss and loss is None:
            raise ConfigError(f"party {party!r} owns the loss stage; pass loss=...")
        # raw features need no gradient: their kernels skip it (`StageKernels`, differentiable)
        self.kernels = {
            s: StageKernels(
                self.models[s],
                optimizer,
                loss if self.stages[s].loss else None,
                differentiable=[i != FEATURES for i in self._read_inputs(s)],
            )
            for s in self.stages
        }
        if params is None:
            key = jax.random.PRNGKey(0) if key is None else key
            params = {}
            for s in sorted(self.stages):
                params[s] = self.models[s].init(jax.random.fold_in(key, _stable_hash(s)))
        # copied: the update kernel donates the parameters it is given (`tandem.engine.kernels`),
        # and the caller's arrays (often a template shared with another party or a reference
        # run) must outlive it
        self.params: dict[str, Any] = {s: owned_copy(p) for s, p in params.items()}
        self.opt_state = {s: self.kernels[s].init_opt(self.params[s]) for s in self.stages}
        self._check_inputs()
        #: the [privacy] defenses at the cut (`tandem.parties.privacy.cut`): two hooks below
        self.defenses = CutDefenses(
            privacy,
            label_owner=owns_loss,
            nopeek_stages={
                s.name: self.models[s.name].apply
                for s in self.stages.values()
                if tuple(s.inputs) == (FEATURES,)
                and any(c.name not in self.stages for c in topology.consumers(s.name))
            },
        )
        #: observes every cut tensor a training batch sends (`tandem.parties.privacy.audit`);
        #: None (the default) captures nothing
        self.audit: PartyAudit | None = None
        self.begin(np.zeros((1, 0), np.float32), None, [(0, 1)], train=False)
        self._sizes_run[False].clear()  # that placeholder batch runs nothing

    def _read_inputs(self, stage: str) -> tuple[str, ...]:
        """What ``stage``'s kernels read: its inputs, or their sum (named by the first)."""
        inputs = self.stages[stage].inputs
        return inputs[:1] if self._sums(stage) else inputs

    def _sums(self, stage: str) -> bool:
        return self.cut_sum is not None and self.cut_sum.stage == stage

    def _check_inputs(self) -> None:
        if self.cut_sum is not None:
            self.cut_sum.check(self.topology, self.out_dims)
            if self.cut_sum.secure and not self.compressor.exact:
                raise ConfigError(
                    "model.aggregate = 'secure_sum' sends ring words that a compressor would "
                    f"corrupt; set train.compress = 'none' (got {self.compressor.kind!r})"
                )
        for s in self.stages.values():
            model = self.models[s.name]
            inputs = self._read_inputs(s.name)
            if len(model.in_dims) != len(inputs):
                summed = " (model.aggregate sums them into one)" if self._sums(s.name) else ""
                raise ConfigError(
                    f"stage {s.name!r} has {len(inputs)} inputs {list(inputs)}{summed} "
                    f"but its model declares {len(model.in_dims)} in_dims"
                )
            for i, d in zip(inputs, model.in_dims, strict=True):
                if i != FEATURES and i in self.out_dims and self.out_dims[i] != d:
                    raise ConfigError(
                        f"stage {s.name!r} expects width {d} from {i!r}, which "
                        f"outputs {self.out_dims[i]}"
                    )

    # -- per batch ------------------------------------------------------------------------------
    def begin(
        self,
        features: np.ndarray | BatchRows | None,
        labels: np.ndarray | None,
        bounds: list[tuple[int, int]],
        *,
        train: bool,
        chunks: int = 1,
        row_ids: np.ndarray | None = None,
        step: int = 0,
        secret: np.ndarray | None = None,
    ) -> None:
        """Bind one batch: this party's feature rows, labels (loss owner), group bounds, and
        the messages per group (the plan's ``chunks``; every group needs >= ``chunks`` rows).
        ``row_ids``: the training-set ids of the batch's rows, which key the gradients' error
        feedback (none without them) and the [privacy] defenses' noise, with ``step`` (the
        training step; no defense acts without row ids). ``secret``: the true labels of the
        rows, which the audit scores against (default ``labels``; they differ under label DP)."""
        self.step = step
        self.row_ids = None if row_ids is None or not train else np.asarray(row_ids)
        self._batches += 1
        #: the ids keying this batch's secure-sum masks (row positions without ids)
        self.mask_rows = (
            np.arange(bounds[-1][1] if bounds else 0) if row_ids is None else (np.asarray(row_ids))
        )
        # kept as host numpy: a group is a zero-copy row slice that the jitted kernel takes
        # directly (an eager jax slice per op costs a dispatch of its own)
        self.features = (
            features
            if features is None or isinstance(features, BatchRows)
            else np.asarray(features)
        )
        self.labels = None if labels is None else np.asarray(labels)
        self.secret = self.labels if secret is None else np.asarray(secret)
        #: row ranges of the messages (micro-batch ``mb`` of an ``S``/``R`` op)
        self.msg_bounds = chunk_bounds(bounds, chunks)
        fine = computes_per_message(self.topology, self.party, chunks)
        #: row ranges of this party's compute ops; ``per_op`` messages each way per op
        self.bounds = self.msg_bounds if fine else bounds
        self.per_op = 1 if fine else chunks
        self.rows = bounds[-1][1] if bounds else 0
        #: per compute op: its kernel calls' row ranges (`kernel_pieces`) and the rows each
        #: runs at (padded to a bucket size)
        self.pieces = self._pieces(train)
        self.padded = [tuple(size for *_, size in p) for p in self.pieces]
        self.train = train
        #: per (stage, op): one array (or pullback) per kernel piece
        self.acts: dict[tuple[str, int], list[jax.Array]] = {}
        self.vjps: dict[tuple[str, int], list[Any]] = {}
        self.inbox: dict[tuple[str, int], np.ndarray] = {}  # host arrays, as received
        self.cots: dict[tuple[str, int], list[jax.Array]] = {}
        self.grads: dict[str, Any] = {}  # stage -> summed parameter gradients (on the device)
        self._loss: jax.Array | None = None  # summed scaled loss of the batch (on the device)
        self.logits: dict[int, list[jax.Array]] = {}
        if train and self.audit is not None:
            self.audit.new_batch()

    @property
    def loss_sum(self) -> float:
        """The bound batch's mean loss so far (the scaled micro-batch losses, summed). Reading
        it waits for the loss stage's kernels: read it once per batch, not per op."""
        return 0.0 if self._loss is None else float(self._loss)

    def _input(self, stage: str, name: str, m: int) -> list:
        """Op ``m``'s input ``name`` of ``stage``, one padded array per kernel piece."""
        if name == FEATURES:
            if self.features is None:
                raise ConfigError(
                    f"stage {stage!r} reads {self.party!r}'s features, but the batch was bound "
                    "without any; pass this party's feature rows to begin()"
                )
            return [self._pad(self.features[a:b], size) for a, b, size in self.pieces[m]]
        if name in self.stages:
            return self.acts[(name, m)]
        return self._split(self._gather(f"act/{name}->{stage}", m), m)

    def compile_ahead(
        self, features: np.ndarray | BatchRows | None = None, labels: np.ndarray | None = None
    ) -> float | None:
        """Compile now what the job's shapes fix, before the first batch: each stage's ``update``
        and ``zeros`` (a batch's fresh gradient accumulator; the parameters fix their shapes)
        and, for a batch of at least two whole tiles (`shared_shape_counts` of ``pad_to``), the
        training kernels at each size of `tile_sizes`: ``forward``, ``backward`` and the loss
        step, which every count up to the whole tiles runs (module docstring). ``features`` and
        ``labels``: any rows of this party's training features and, on the loss owner, labels
        (their dtypes and widths are what the batches will bring; none: the tile kernels of a
        stage reading them are left to the first batch). The kernels run once on zero rows, so
        their first batch finds them compiled for exactly the arguments it passes (host rows
        for what it reads or receives, device arrays for what its own stages hand on); the
        results are dropped and no state changes. A summing stage (``cut_sum``) is left to its
        first batch.

        A party process calls it (in a thread: it blocks while XLA compiles, about 1.7 s per
        size for the `bench.scale` stages on one core) before it reports ready, so peers
        compile at the same time instead of each waiting in the first batch for the kernels of
        the one before it. Calling it again, or running a batch after it, compiles nothing
        more.

        Returns the seconds the tile kernels took per size (what a count of other shapes would
        cost to compile again), or None when they were left to the first batch."""
        for s in sorted(self.stages):
            kernels, params = self.kernels[s], self.params[s]
            kernels.zeros.lower(params).compile()
            kernels.update.lower(params, self.opt_state[s], params).compile()
        if self.pad_to < 1 or not shared_shape_counts(self.pad_to):
            return None
        order = [st.name for st in self.topology.stages if st.name in self.stages]
        if any(self._sums(s) for s in order):
            return None  # a summing stage's input is a combined sum: left to the first batch
        started = time.perf_counter()
        sizes = [bucket_rows(t, self.pad_to) for t in tile_sizes(self.pad_to)]
        for size in sizes:
            if not self._run_zero_rows(order, size, features, labels):
                return None
            self._sizes_run[True].add(size)
        return (time.perf_counter() - started) / len(sizes)

    def _run_zero_rows(
        self,
        order: list[str],
        size: int,
        features: np.ndarray | BatchRows | None,
        labels: np.ndarray | None,
    ) -> bool:
        """`compile_ahead` at one kernel size: run the stages' forward, loss step and backward
        once on ``size`` zero rows; False when ``features`` or ``labels`` a stage needs is
        missing (what is left is compiled by the first batch)."""

        def zero(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
            return np.zeros((size, *shape), jax.numpy.dtype(dtype))

        acts: dict[str, Any] = {}  # own stage -> its output on the zero rows
        vjps: dict[str, Any] = {}
        cots: dict[str, Any] = {}  # own stage -> the cotangent its local consumer hands back
        for s in order:  # forward, the loss step
            xs = []
            for name in self.stages[s].inputs:
                if name == FEATURES:
                    if features is None:
                        return False
                    x = np.asarray(features[0:1])
                    xs.append(zero(x.dtype, x.shape[1:]))
                elif name in self.stages:
                    xs.append(acts[name])
                else:
                    xs.append(zero(self.out_dtypes[name], self.cut_shape(name)))
            k = self.kernels[s]
            if not self.stages[s].loss:
                acts[s], vjps[s] = k.forward(self.params[s], *xs)
                continue
            if labels is None:
                return False
            y = np.asarray(labels[0:1])
            *_, input_grads = k.loss_step(
                self.params[s],
                k.zeros(self.params[s]),
                _ZERO,
                zero(y.dtype, y.shape[1:]),
                np.float32(1.0 / self.pad_to),
                *xs,
                mask=np.ones(size, bool),
            )
            self._hand_back(s, input_grads, cots)
        for s in reversed(order):  # the backward passes, each after its consumers'
            if s in vjps:
                cot = cots.get(s)
                if cot is None:
                    cot = zero(self.out_dtypes[s], self.cut_shape(s))
                _, input_grads = self.kernels[s].backward(
                    vjps[s], cot, self.kernels[s].zeros(self.params[s])
                )
                self._hand_back(s, input_grads, cots)
        jax.block_until_ready((acts, cots))
        return True

    def _hand_back(self, stage: str, input_grads: Any, cots: dict[str, Any]) -> None:
        """`compile_ahead`: add ``stage``'s input gradients to the cotangents of the local
        stages it reads (as `_route_input_grads` does)."""
        for name, g in zip(self.stages[stage].inputs, input_grads, strict=True):
            if name in self.stages:
                cots[name] = g if name not in cots else cots[name] + g

    def _pieces(self, train: bool) -> list[list[tuple[int, int, int]]]:
        """Per compute op of the bound batch: ``(start, stop, size)`` of each kernel call,
        `kernel_pieces` of its rows with the job's tile, ``size`` the rows the call runs at:
        the piece's `bucket_rows` size, except in a batch shorter than ``pad_to`` (an epoch's
        last), where a piece runs at the smallest size this handler's kernels already ran at
        in the same mode (training or prediction) that holds it, so the short batch compiles
        nothing new. Padding a piece of one batch costs a few milliseconds; compiling a new
        size costs seconds."""
        cap = max(self.rows, self.pad_to)
        tiles = tile_sizes(cap)
        seen = self._sizes_run[train]
        out = []
        for lo, hi in self.bounds:
            pieces = []
            for a, b in kernel_pieces(lo, hi, tiles):
                rows = b - a
                fits = [s for s in seen if s >= rows] if self.rows < self.pad_to else []
                pieces.append((a, b, min(fits) if fits else bucket_rows(rows, cap)))
            seen.update(size for *_, size in pieces)
            out.append(pieces)
        return out

    @staticmethod
    def _pad(x: np.ndarray, size: int) -> np.ndarray:
        """Host rows ``x`` with zero rows appended up to ``size`` rows (``x`` itself when it
        has as many)."""
        extra = size - x.shape[0]
        if extra == 0:
            return x
        return np.concatenate([x, np.zeros((extra, *x.shape[1:]), x.dtype)])

    def _split(self, x: np.ndarray, m: int) -> list[np.ndarray]:
        """Host rows ``x`` of op ``m``'s whole group, cut into its kernel pieces, each padded."""
        lo = self.bounds[m][0]
        return [self._pad(x[a - lo : b - lo], size) for a, b, size in self.pieces[m]]

    def _joined(self, pieces: list, m: int):
        """Op ``m``'s per-piece outputs as one array of its group's rows: the one piece's
        output itself (possibly padded: `_scatter` takes the real rows), else the pieces' real
        rows concatenated on the host."""
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(
            [np.asarray(y)[: b - a] for y, (a, b, _) in zip(pieces, self.pieces[m], strict=True)]
        )

    def _inputs(self, stage: str, m: int) -> list[list]:
        """The arrays ``stage``'s kernels read for op ``m`` (one sum for a summing stage): per
        kernel piece, the list of its inputs."""
        names = self.stages[stage].inputs
        if not self._sums(stage):
            per_input = [self._input(stage, i, m) for i in names]
        else:
            assert self.cut_sum is not None
            parts = [self._gather(f"act/{i}->{stage}", m) for i in names]
            per_input = [self._split(self.cut_sum.combine(parts, self.cut_shape(names[0])), m)]
        return [list(xs) for xs in zip(*per_input, strict=True)]

    def _sealed(self, channel: str) -> bool:
        """Whether this party's messages on ``channel`` are a secure sum's masked words."""
        c = self.cut_sum
        return (
            c is not None
            and c.secure
            and channel.startswith("act/")
            and channel.endswith(f"->{c.stage}")
        )

    def _gather(self, channel: str, m: int) -> np.ndarray:
        """The arrived messages of op ``m`` on ``channel`` (taken out of the inbox), as one
        array in row order."""
        if self.per_op == 1:
            return self.inbox.pop((channel, m))
        k = m * self.per_op
        return np.concatenate([self.inbox.pop((channel, j)) for j in range(k, k + self.per_op)])

    def _scatter(self, channel: str, m: int, array, out: dict) -> None:
        """Put op ``m``'s output ``array`` into ``out`` as the op's messages on ``channel``
        (each encoded by the compressor unless it is ``"none"``), after the [privacy]
        defenses of a training batch (which the audit, when on, observes)."""
        lo, hi = self.bounds[m]
        if array.shape[0] != hi - lo:
            array = array[: hi - lo]  # the real rows only (the op ran padded to a bucket size)
        if self.defenses.active and self.row_ids is not None:
            array = self.defenses.outgoing(
                channel, array, ids=self.row_ids[lo:hi], step=self.step, rows=self.rows
            )
        if self.audit is not None and self.train:
            self._audit(self.audit, channel, m, array)
        if self._sealed(channel):
            assert self.cut_sum is not None
            host, base = np.asarray(array), self.bounds[m][0]
            for j in range(m * self.per_op, (m + 1) * self.per_op):
                lo, hi = self.msg_bounds[j]
                out[(channel, j)] = self.cut_sum.seal(
                    host[lo - base : hi - base],
                    self._batches,
                    self.mask_rows[lo:hi],
                    where=f"{self.party!r}'s cut on {channel!r}",
                )
            return
        if self.compressor.exact:
            if self.per_op == 1:
                out[(channel, m)] = np.asarray(array)
                return
            host, base = np.asarray(array), self.bounds[m][0]
            for j in range(m * self.per_op, (m + 1) * self.per_op):
                lo, hi = self.msg_bounds[j]
                out[(channel, j)] = host[lo - base : hi - base]
            return
        host, base = np.asarray(array), self.bounds[m][0]
        for j in range(m * self.per_op, (m + 1) * self.per_op):
            lo, hi = self.msg_bounds[j]
            out[(channel, j)] = self._encode(channel, host[lo - base : hi - base], lo, hi)

    def _audit(self, audit: PartyAudit, channel: str, m: int, array) -> None:
        """Hand op ``m``'s outgoing ``array`` on ``channel`` to ``audit``, with the true labels
        (loss owner: the secret, not label DP's randomized training labels) and, when asked,
        this party's features of the same rows."""
        lo, hi = self.bounds[m]
        labels = None if self.secret is None else self.secret[lo:hi]

        def features() -> np.ndarray | None:
            return None if self.features is None else np.asarray(self.features[lo:hi])

        audit.sent(channel, np.asarray(array), labels, features)

    def _encode(self, channel: str, x: np.ndarray, lo: int, hi: int):
        """The payload of batch rows ``lo:hi`` (tensor ``x``) on ``channel``; gradients of a
        training batch with row ids use (and update) the channel's feedback residuals."""
        ids, state = None, None
        if channel.startswith("grad/") and self.row_ids is not None:
            ids = self.row_ids[lo:hi]
            if channel not in self.feedback:
                self.feedback[channel] = self.compressor.init(x.shape[1:])
            state = self.feedback[channel]
        payload, state = self.compressor.encode(state, x, ids)
        if ids is not None:
            self.feedback[channel] = state
        return payload

    def _acc(self, stage: str):
        """The stage's gradient accumulator for this batch (zeros before its first backward)."""
        acc = self.grads.get(stage)
        return self.kernels[stage].zeros(self.params[stage]) if acc is None else acc

    def _route_input_grads(self, stage: str, m: int, per_piece: list, out: dict) -> None:
        """Send or keep op ``m``'s input gradients (``per_piece``: each kernel piece's)."""
        names = self.stages[stage].inputs
        sums = self._sums(stage)  # d(sum)/d(summand) = 1: each cut gets the sum's gradient
        for i, name in enumerate(names):
            if name == FEATURES:
                continue
            gs = [g[0 if sums else i] for g in per_piece]
            if name in self.stages:
                key = (name, m)
                held = self.cots.get(key)
                if held is not None:
                    gs = [a + b for a, b in zip(held, gs, strict=True)]
                self.cots[key] = gs
            else:
                self._scatter(f"grad/{name}->{stage}", m, self._joined(gs, m), out)

    def compute(self, op: Op) -> dict[tuple[str, int], np.ndarray]:
        out: dict[tuple[str, int], np.ndarray] = {}
        s, m = op.stage, op.mb
        k = self.kernels[s]
        if op.kind is Kind.UPDATE:
            grads = self.grads.pop(s)
            if self.train and self.row_ids is not None and self.features is not None:
                grads = self.defenses.regularise(
                    s, self.params[s], grads, self.features[0 : self.rows]
                )
            self.params[s], self.opt_state[s] = k.update(self.params[s], self.opt_state[s], grads)
            jax.block_until_ready(self.params[s])
            return out
        if op.kind is not Kind.BACKWARD:  # a backward's inputs live in its vjps
            pieces = self._inputs(s, m)
        if op.kind is Kind.FORWARD:
            ys, vjps = [], []
            for xs in pieces:
                if self.train:
                    y, vjp = k.forward(self.params[s], *xs)
                    vjps.append(vjp)
                else:
                    y = k.predict(self.params[s], *xs)
                ys.append(y)
            self.acts[(s, m)] = ys
            if self.train:
                self.vjps[(s, m)] = vjps
            sends = [c.name for c in self.topology.consumers(s) if c.name not in self.stages]
            for c in sends:
                self._scatter(f"act/{s}->{c}", m, self._joined(ys, m), out)
            if not sends:
                jax.block_until_ready(ys)
        elif op.kind is Kind.LOSS:
            if self.train:
                if self.labels is None:
                    raise ConfigError(
                        f"{self.party!r} trains the loss stage {s!r}, but the batch was bound "
                        "without labels; pass them to begin()"
                    )
                loss: Any = _ZERO if self._loss is None else self._loss
                acc, scale = self._acc(s), np.float32(1.0 / self.rows)
                logits, gxs = [], []
                for (a, b, size), xs in zip(self.pieces[m], pieces, strict=True):
                    acc, loss, piece_logits, piece_gxs = k.loss_step(
                        self.params[s],
                        acc,
                        loss,
                        self._pad(self.labels[a:b], size),
                        scale,
                        *xs,
                        mask=np.arange(size) < b - a,
                    )
                    logits.append(piece_logits)
                    gxs.append(piece_gxs)
                self.grads[s], self._loss = acc, loss
                self._route_input_grads(s, m, gxs, out)
            else:
                logits = [k.predict(self.params[s], *xs) for xs in pieces]
            self.logits[m] = logits  # fetched once per batch, by `predictions`
        elif op.kind is Kind.BACKWARD:
            cots: list | None = self.cots.pop((s, m), None)
            for consumer in self.topology.consumers(s):
                if consumer.name not in self.stages:
                    g = self._split(self._gather(f"grad/{s}->{consumer.name}", m), m)
                    cots = g if cots is None else [a + b for a, b in zip(cots, g, strict=True)]
            assert cots is not None  # every stage with a backward has a consumer
            acc, input_grads = self._acc(s), []
            for vjp, cot in zip(self.vjps.pop((s, m)), cots, strict=True):
                acc, piece_grads = k.backward(vjp, cot, acc)
                input_grads.append(piece_grads)
            self.grads[s] = acc
            self._route_input_grads(s, m, input_grads, out)
            self.acts.pop((s, m), None)
            if not out:
                jax.block_until_ready(self.grads[s])
        else:  # pragma: no cover - the runtime never hands other kinds to compute
            raise ConfigError(f"StageHandler cannot run {op}")
        return out

    def cut_shape(self, stage: str) -> tuple[int, ...]:
        """The shape after the rows of ``stage``'s output (``(out_dims[stage],)`` for a
        matrix)."""
        shape = self.out_shapes.get(stage, ())
        return shape if len(shape) > 1 else (self.out_dims[stage],)

    def channel_cut(self, channel: str) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape after the rows) of the tensors on ``channel``: its source stage's
        output and cotangent, or the flat ring words of a secure sum's cuts."""
        kind, _, edge = channel.partition("/")
        src, _, dst = edge.partition("->")
        c = self.cut_sum
        if kind == "act" and c is not None and c.ring is not None and c.stage == dst:
            return c.ring.dtype.name, (self.out_dims[src],)
        return self.out_dtypes[src], self.cut_shape(src)

    def receive(self, op: Op, array) -> None:
        """Store a peer's message after checking it is ``dtype[rows of the message, *shape]``
        of the stage whose output (activation) or its cotangent (gradient) it carries (the
        compressor's layout of it, which is then decoded); `ShapeError` naming the field that
        differs otherwise."""
        kind, _, edge = op.channel.partition("/")
        src, _, dst = edge.partition("->")
        lo, hi = self.msg_bounds[op.mb]
        if src not in self.out_dims:
            raise ShapeError(
                f"{self.party!r} received a tensor on {op.channel!r} but knows no model of "
                f"stage {src!r}; pass a StageModel for every stage of the topology"
            )
        dtype, shape = self.channel_cut(op.channel)
        expected = (hi - lo, *shape)
        if not self.compressor.exact:
            self._receive_encoded(op, array, dtype, expected)
            return
        wrong = [
            field
            for field, ok in (
                ("dtype", array.dtype.name == dtype),
                ("shape", tuple(array.shape) == expected),
            )
            if not ok
        ]
        if wrong:
            raise ShapeError(
                f"{self.party!r} received {array.dtype.name}{list(array.shape)} on "
                f"{op.channel!r} micro-batch {op.mb}; expected {dtype}{list(expected)} (rows of "
                f"the group x output shape of {src!r}): its {' and '.join(wrong)} differ"
                f"{'s' if len(wrong) == 1 else ''}. Check that both parties use the same model "
                f"of {src!r} (output shape and dtype)."
            )
        self.inbox[(op.channel, op.mb)] = array  # host array; the consuming kernel takes it as is

    def _receive_encoded(self, op: Op, payload, dtype: str, expected: tuple[int, ...]) -> None:
        arrays = payload_arrays(payload)
        c = self.compressor
        got = " + ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays)
        wrong = c.check(arrays, expected[1:], dtype)
        if not wrong and arrays[0].shape[0] != expected[0]:
            wrong = ["rows"]
        if wrong:
            raise ShapeError(
                f"{self.party!r} received {got} on {op.channel!r} micro-batch {op.mb}; with "
                f"compress={c.kind!r} expected {c.describe(expected[0], expected[1:], dtype)}: "
                f"its {' and '.join(wrong)} differ. Check that both parties use the same model "
                "and the same negotiated compression."
            )
        self.inbox[(op.channel, op.mb)] = c.decode(payload, expected[1:], dtype)

    def predictions(self) -> np.ndarray:
        """The loss stage's logits of the bound batch's real rows, in row order."""
        return np.concatenate(
            [
                np.asarray(y)[: b - a]
                for m in sorted(self.logits)
                for y, (a, b, _) in zip(self.logits[m], self.pieces[m], strict=True)
            ],
            axis=0,
        )


_ZERO = np.float32(0.0)  # the loss accumulator before a batch's first loss step


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h
