"""Wire format of federated rounds: channels, frame builders and the server's validation.

Channels (one FIFO each way per client):

* ``fl/model`` server -> client. ``meta.kind`` is ``"full"`` (arrays: the model),
  ``"delta"`` (arrays: indices, values; the client sets ``model[indices] = values``), or
  ``"stop"``. ``meta.train`` says whether a reply is expected; ``meta.uplink`` says how to
  compress it and ``meta.seed`` is the round's shared seed; ``meta.serial`` (16 hex digits)
  names the server process that asked.
* ``fl/update`` client -> server: ``meta = {round, n, version, kind, serial}`` and one array:
  the dense delta (``dense``), the ``k`` rand-k values (``randk``), the ``rows x cols`` sketch
  (``sketch``), or a uint8 block-quantized payload (``quant``, `tandem.parties.fl.quantize`).
  ``serial`` echoes the request's: a reply naming another server process (one that has since
  restarted; the client's transport delivered it again to the new one) is
  discarded like a late one. When the request said ``evaluate``, the update's meta also has
  ``eval = [rows, loss sum, correct count]`` (`tandem.parties.fl.evaluation`).
* ``fl/hello`` client -> server, when a client in its own process connects or reconnects:
  ``meta = {kind: "hello", version, url, lineage}`` (the model version it holds, 0 when it has
  none, where it listens, and the ``lineage`` of the last welcome, which names the history its
  version belongs to); no arrays. The server answers on ``fl/model`` with
  ``{kind: "welcome", task, client_seed, reset, lineage}``: the task
  (`tandem.parties.fl.task.Task`), the seed of the client's local shuffles, whether it must drop
  the model it holds (it holds a version this server never made: newer than the server's, or
  of another lineage, i.e. made by a server that has since started over without its
  checkpoint), and the server's lineage (`FLServer.lineage`). Before round one, under
  federated preprocessing, the server first asks for the client's data summary
  (``{kind: "summarize", ...}`` on ``fl/model``, answered by ``{kind: "summary", summary}``
  on ``fl/hello``; under secure aggregation the numeric sums go through a secure sum
  instead): `tandem.parties.fl.summary_exchange`.

* ``fl/secagg`` both ways, under secure aggregation (a training request then carries
  ``meta.secagg``): the four stages of `tandem.parties.fl.secagg` replace the ``fl/update``
  reply; `tandem.parties.fl.secagg.messages` has their format.

Optional lossless compression (``zlib``) replaces an array by its deflated bytes (uint8) and
records the original dtype and shape in ``meta.zlib``; inflation is bounded by the expected
size, so a small frame cannot expand into a huge buffer.

`check_update` validates everything a client controls and raises `UpdateError` naming the
field and the fix; the server then leaves that client out of the round and keeps serving.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.errors import TandemError
from tandem.transports.base import Frame
from tandem.transports.factory import is_transport_url, url_hint

from .quantize import check_quant, levels, payload_size, split_payload

MODEL = "fl/model"
UPDATE = "fl/update"
HELLO = "fl/hello"
WELCOME = "welcome"  # kind of a MODEL-channel message answering a hello
REFUSED = "refused"  # kind of a MODEL-channel message: your update was refused
RESYNC = "resync"  # kind of an UPDATE-channel message: "I hold version v; re-plan from it"
UPLINK_KINDS = ("dense", "randk", "sketch", "quant")
MODEL_KINDS = ("full", "delta")  # model messages; "stop" and the control kinds are not


class UpdateError(TandemError, ValueError):
    """A client's update was refused; the message says what was wrong and how to fix it."""


class DownlinkError(TandemError, ValueError):
    """A model message cannot be applied to the state this client holds."""


def pack_arrays(arrays: tuple[np.ndarray, ...], lossless: bool) -> tuple[tuple, list | None]:
    """Arrays as they travel: unchanged, or deflated when ``lossless`` (see module doc)."""
    if not lossless:
        return arrays, None
    packed, info = [], []
    for a in arrays:
        a = np.ascontiguousarray(a)
        packed.append(np.frombuffer(zlib.compress(a.tobytes(), 1), np.uint8))
        info.append([a.dtype.str, list(a.shape)])
    return tuple(packed), info


def unpack_arrays(frame: Frame, *, max_bytes: int) -> tuple[np.ndarray, ...]:
    """Inverse of `pack_arrays`; refuses to inflate more than ``max_bytes`` per array."""
    info = frame.meta.get("zlib")
    if info is None:
        return frame.arrays
    if not isinstance(info, list) or len(info) != len(frame.arrays):
        raise UpdateError("meta.zlib must list [dtype, shape] for every array")
    out = []
    for entry, buf in zip(info, frame.arrays, strict=True):
        dt, shape = _zlib_entry(entry)
        n = math.prod(shape) * dt.itemsize  # Python ints: a huge shape cannot wrap to 0
        if n > max_bytes:
            raise UpdateError(f"compressed array would inflate to {n} bytes > {max_bytes}")
        d = zlib.decompressobj()
        try:
            raw = d.decompress(np.asarray(buf, np.uint8).tobytes(), n + 1)
        except zlib.error as exc:
            raise UpdateError(f"array is not valid zlib data: {exc}") from None
        if len(raw) != n or d.unconsumed_tail:
            raise UpdateError(f"inflated array has {len(raw)}+ bytes, its descriptor says {n}")
        out.append(np.frombuffer(raw, dt).reshape(shape))
    return tuple(out)


def _zlib_entry(entry: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """One ``meta.zlib`` entry as ``(dtype, shape)``: a plain-data dtype and a list of
    integers >= 0; else `UpdateError` (a client controls it: it must not raise anything
    else)."""
    bad = UpdateError(
        f"meta.zlib entry {entry!r} is not [dtype, shape] (a numeric dtype and a list of "
        "integers >= 0); send the arrays as tandem.parties.fl.protocol.pack_arrays packs them"
    )
    if not isinstance(entry, list | tuple) or len(entry) != 2:
        raise bad
    dtype, shape = entry
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = [shape]
    if not isinstance(shape, list | tuple) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise bad
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        raise bad from None
    if dt.hasobject or dt.itemsize == 0:
        raise bad
    return dt, tuple(shape)


def expected_shape(uplink: Mapping[str, Any], d: int) -> tuple[int, ...]:
    kind = uplink["kind"]
    if kind == "dense":
        return (d,)
    if kind == "randk":
        return (int(uplink["k"]),)
    if kind == "quant":
        return (payload_size(d, int(uplink["bits"]), int(uplink["block"])),)
    return (int(uplink["rows"]), int(uplink["cols"]))


def _int_field(meta: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise UpdateError(f"update meta.{key} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise UpdateError(f"update meta.{key}={v} is outside [{lo}, {hi}]")
    return v


def check_resync(frame: Frame, *, version: int) -> tuple[int, int]:
    """Validate a client's ``resync`` message; returns ``(round, version it holds)``."""
    if frame.arrays:
        raise UpdateError("a resync message carries no arrays")
    return (
        _int_field(frame.meta, "round", 0, 2**62),
        _int_field(frame.meta, "version", 0, version),
    )


def check_hello(frame: Frame) -> tuple[int, str | None]:
    """Validate a client's ``hello``; returns ``(version it holds, its URL or None)``."""
    if frame.arrays:
        raise UpdateError("a hello message carries no arrays")
    if frame.meta.get("kind") != "hello":
        raise UpdateError(f"a message on {HELLO!r} must have kind 'hello', got {frame.meta!r}")
    version = _int_field(frame.meta, "version", 0, 2**62)
    url = frame.meta.get("url")
    if url is not None and not is_transport_url(url):
        raise UpdateError(f"hello meta.url must be {url_hint()}, or absent; got {url!r}")
    return version, url


def hello_lineage(frame: Frame) -> str | None:
    """The ``lineage`` a hello names (that of the model version it holds), or None when it
    names none or not a short string (the server then resets a client holding a version)."""
    lineage = frame.meta.get("lineage")
    return lineage if isinstance(lineage, str) and len(lineage) <= 64 else None


def check_update(
    frame: Frame, *, uplink: Mapping[str, Any], d: int, version: int, max_bytes: int
) -> tuple[int, int, int, np.ndarray]:
    """Validate a client update; returns ``(round, n, version, payload)`` (float32; uint8
    for a ``quant`` uplink).

    Raises `UpdateError` for: frames over ``max_bytes``, missing/ill-typed meta, a kind other
    than the round's ``uplink``, wrong array count/shape/dtype, NaN or Inf values.
    """
    if frame.nbytes > max_bytes:
        raise UpdateError(
            f"update of {frame.nbytes} bytes exceeds the limit of {max_bytes} bytes for uplink "
            f"{dict(uplink)}; compress it as the round's meta.uplink says"
        )
    meta = frame.meta
    rnd = _int_field(meta, "round", 0, 2**62)
    n = _int_field(meta, "n", 1, 2**31)
    ver = _int_field(meta, "version", 0, version)
    if meta.get("kind") != uplink["kind"]:
        raise UpdateError(
            f"update kind {meta.get('kind')!r} differs from the round's uplink {uplink['kind']!r}"
        )
    arrays = unpack_arrays(frame, max_bytes=max_bytes)
    if len(arrays) != 1:
        raise UpdateError(f"an update carries exactly one array, got {len(arrays)}")
    a = arrays[0]
    shape = expected_shape(uplink, d)
    if uplink["kind"] == "quant":
        _check_quant_payload(a, shape, uplink, d)
        return rnd, n, ver, a
    if a.dtype != np.float32 or a.shape != shape:
        raise UpdateError(f"update array must be float32 {shape}, got {a.dtype} {a.shape}")
    if not np.isfinite(a).all():
        raise UpdateError("update contains NaN or Inf; check the client's learning rate")
    return rnd, n, ver, a


def _check_quant_payload(
    a: np.ndarray, shape: tuple[int, ...], uplink: Mapping[str, Any], d: int
) -> None:
    """A quantized payload (`tandem.parties.fl.quantize`): uint8 of the right size, finite
    block scales, every code within ``2L``."""
    if a.dtype != np.uint8 or a.shape != shape:
        raise UpdateError(f"quantized update must be uint8 {shape}, got {a.dtype} {a.shape}")
    bits, block = int(uplink["bits"]), int(uplink["block"])
    scales, codes = split_payload(a, d, bits, block)
    if not np.isfinite(scales).all():
        raise UpdateError("quantized update has NaN or Inf block scales; check the client's lr")
    if codes.size and int(codes.max()) > 2 * levels(bits):
        raise UpdateError(
            f"quantized update has a code above {2 * levels(bits)} (bits = {bits}); "
            "encode with tandem.parties.fl.quantize.quantize"
        )


def check_uplink(uplink: Mapping[str, Any], d: int) -> dict[str, Any]:
    """Validate an uplink setting; returns a plain dict. Raises `tandem.errors.ConfigError`."""
    from tandem.errors import ConfigError

    kind = uplink.get("kind")
    if kind not in UPLINK_KINDS:
        raise ConfigError(f"uplink kind {kind!r} is not one of {UPLINK_KINDS}")
    if kind == "randk" and not (isinstance(uplink.get("k"), int) and 1 <= uplink["k"] <= d):
        raise ConfigError(f"rand-k uplink needs an integer k in [1, {d}], got {uplink.get('k')!r}")
    if kind == "quant":
        check_quant(uplink.get("bits"), uplink.get("block"))
        gap = uplink.get("max_gap", 1)
        if not isinstance(gap, int) or isinstance(gap, bool) or gap < 0:
            raise ConfigError(f"quantized uplink max_gap must be an integer >= 0, got {gap!r}")
    if kind == "sketch" and not all(
        isinstance(uplink.get(f), int) and uplink[f] >= 1 for f in ("rows", "cols")
    ):
        raise ConfigError(f"sketch uplink needs integer rows, cols >= 1, got {dict(uplink)}")
    return dict(uplink)
