"""Codec: hypothesis round-trips; malformed input raises FrameError and nothing else."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hypothesis_profiles import examples
from tandem.errors import FrameError, PayloadTooLargeError
from tandem.transports import codec
from tandem.transports.base import Frame

DTYPES = st.sampled_from(
    [
        "bool",
        "int8",
        "uint16",
        "<i4",
        ">i4",
        "int64",
        "float16",
        "float32",
        ">f8",
        "complex64",
        "complex128",
    ]
)
arrays = DTYPES.flatmap(
    lambda dt: hnp.arrays(
        np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    )
)
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False)
)
meta = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        json_leaf,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8,
    ),
    max_size=4,
)
frames = st.builds(
    Frame,
    sender=st.text(max_size=8),
    channel=st.text(max_size=8),
    msg_id=st.integers(0, 2**62),
    spec_hash=st.text(max_size=16),
    meta=meta,
    arrays=st.lists(arrays, max_size=4).map(tuple),
)


@settings(max_examples=examples(60), deadline=None)
@given(frames)
def test_roundtrip(frame):
    data = codec.encode(frame)
    assert len(data) == codec.encoded_size(frame)
    assert b"".join(bytes(p) for p in codec.encode_parts(frame)) == data
    got = codec.decode(data)
    assert (got.sender, got.channel, got.msg_id, got.spec_hash) == (
        frame.sender,
        frame.channel,
        frame.msg_id,
        frame.spec_hash,
    )
    assert got.meta == frame.meta
    assert len(got.arrays) == len(frame.arrays)
    for x, y in zip(frame.arrays, got.arrays, strict=True):
        assert y.shape == x.shape and y.dtype.byteorder in "<|="
        assert y.dtype == x.dtype.newbyteorder("<") or y.dtype == x.dtype
        np.testing.assert_array_equal(x, y)


@settings(max_examples=examples(60), deadline=None)
@given(meta=meta, sender=st.text(max_size=20))
def test_first_array_starts_aligned_and_unpadded_frames_still_decode(meta, sender):
    """The header is padded so that the first array starts at a multiple of ALIGN: decoded
    into an aligned buffer, its view is aligned (numpy reduces it without a buffered copy).
    Frames from an encoder that did not pad decode the same."""
    x = np.arange(10, dtype=np.float64)
    frame = Frame(sender=sender, meta=meta, arrays=(x,))
    data = codec.encode(frame)
    header_len = codec.parse_prefix(data[: codec.PREFIX_SIZE])
    assert (codec.PREFIX_SIZE + header_len) % codec.ALIGN == 0
    buf = np.empty(len(data) + codec.ALIGN, np.uint8)
    start = -buf.ctypes.data % codec.ALIGN
    buf[start : start + len(data)] = np.frombuffer(data, np.uint8)
    got = codec.decode(memoryview(buf)[start : start + len(data)])
    assert got.arrays[0].flags.aligned and got.arrays[0].ctypes.data % codec.ALIGN == 0
    np.testing.assert_array_equal(got.arrays[0], x)
    header = orjson.dumps(codec.header_of(frame))  # as an encoder without padding wrote it
    unpadded = (
        codec._PREFIX.pack(codec.MAGIC, len(header)) + header + memoryview(x).cast("B").tobytes()
    )
    old = codec.decode(unpadded)
    assert old.meta == got.meta and old.sender == got.sender
    np.testing.assert_array_equal(old.arrays[0], x)


@settings(max_examples=examples(120), deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_frame_error(data):
    try:
        codec.decode(data)
    except FrameError:
        pass


@settings(max_examples=examples(120), deadline=None)
@given(frames, st.data())
def test_mutated_frames_raise_frame_error_or_decode(frame, data):
    raw = bytearray(codec.encode(frame))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=8))
    try:
        codec.decode(bytes(raw))
    except FrameError:
        pass


@settings(max_examples=examples(120), deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["sender", "channel", "id", "spec", "meta", "arrays", "x"]),
        st.none()
        | st.integers(-(2**63), 2**63 - 1)
        | st.text(max_size=4)
        | st.booleans()
        | st.lists(
            st.dictionaries(
                st.sampled_from(["dtype", "shape", "nbytes"]),
                st.integers(-3, 9)
                | st.floats(-3, 16)
                | st.booleans()
                | st.text(max_size=4)
                | st.lists(st.integers(-2, 4), max_size=3),
            ),
            max_size=2,
        ),
        max_size=7,
    )
)
def test_malformed_headers_raise_frame_error(header):
    body = orjson.dumps(header)
    raw = codec._PREFIX.pack(codec.MAGIC, len(body)) + body
    try:
        codec.decode(raw)
    except FrameError:
        pass


def test_a_size_that_is_no_integer_is_refused_by_name():
    """``nbytes`` of 16.0 equals 16 but is a float: refused as malformed (400), not an
    internal error where the body is sliced."""
    header = codec.header_of(Frame(arrays=(np.arange(4, dtype=np.int32),)))
    header["arrays"][0]["nbytes"] = 16.0
    body = codec._pad(orjson.dumps(header))
    raw = codec._PREFIX.pack(codec.MAGIC, len(body)) + body + np.arange(4, dtype=np.int32).tobytes()
    with pytest.raises(FrameError, match="array 0: nbytes 16.0"):
        codec.decode(raw)


def test_specific_errors_name_the_problem():
    good = codec.encode(Frame(arrays=(np.arange(4, dtype=np.int32),)))
    with pytest.raises(FrameError, match="magic"):
        codec.decode(b"XXXX" + good[4:])
    with pytest.raises(FrameError, match="describes"):
        codec.decode(good[:-1])
    with pytest.raises(PayloadTooLargeError, match="max_frame_bytes"):
        codec.decode(good, max_bytes=10)
    with pytest.raises(FrameError, match="dtype"):
        codec.encode(Frame(arrays=(np.array(["a"]),)))
    with pytest.raises(FrameError, match="JSON"):
        codec.encode(Frame(meta={"x": object()}))


def test_encoded_size_reads_no_array_data():
    """The size of a frame whose array is not contiguous is known from its header: nothing is
    copied to learn it (a shaped memory link asks it of every frame)."""
    import tracemalloc

    arr = np.zeros((1024, 2048), np.float32)[:, ::2]  # 4 MiB of float32, strided
    frame = Frame(arrays=(arr,))
    tracemalloc.start()
    try:
        size = codec.encoded_size(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size == len(codec.encode(frame))
    assert peak < arr.nbytes // 8
