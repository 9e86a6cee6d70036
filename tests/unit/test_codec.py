import pytest
import torch

from persistent_delta.log import codec
from persistent_delta.errors import CorruptRecordError, InvalidInputError


@pytest.mark.parametrize(
    "ids_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.uint32, torch.uint64]
)
@pytest.mark.parametrize(
    "states",
    [
        None,
        torch.arange(12, dtype=torch.float32).reshape(6, 2),
        torch.randn(6, 3, 2).to(torch.bfloat16),
        torch.arange(6, dtype=torch.float64),
        torch.tensor([True, False, True, True, False, False]),
        torch.randn(6, 4).to(torch.float16),
    ],
)
def test_roundtrip_keeps_dtype_and_shape(ids_dtype, states):
    ids = torch.tensor([5, 1, 0, 9, 3, 7]).to(ids_dtype)
    buf = codec.encode_record(ids, states)
    rec = codec.decode_record(buf)
    assert rec.kind == codec.KIND_LOOKUP
    assert rec.ids.dtype == ids_dtype and torch.equal(rec.ids, ids)
    if states is None:
        assert rec.states is None
    else:
        assert rec.states.dtype == states.dtype and rec.states.shape == states.shape
        assert torch.equal(rec.states, states)
    # the read path's numpy form: the same ids, the states as byte rows that type back alike
    got = codec.decode_record_rows(buf)
    assert torch.equal(codec.from_view(got.ids), ids)
    if states is None:
        assert got.rows is None
    else:
        assert got.rows.shape == (6, states[:1].nbytes)
        back = codec.rows_as_states(codec.from_view(got.rows), got.states_dtype, got.states_tail)
        assert back.dtype == states.dtype and back.shape == states.shape and torch.equal(back, states)


def test_empty_and_noncontiguous():
    ids = torch.arange(20)[::2]
    states = torch.randn(4, 10).t()  # non-contiguous, shape (10, 4)
    rec = codec.decode_record(codec.encode_record(ids, states))
    assert torch.equal(rec.ids, ids) and torch.equal(rec.states, states)
    empty = codec.decode_record(codec.encode_record(torch.empty(0, dtype=torch.int64), torch.empty(0, 8)))
    assert empty.ids.numel() == 0 and empty.states.shape == (0, 8)
    # the read path's form keeps the row width of a record of no ids (it joins others' rows)
    assert codec.decode_record_rows(codec.encode_record(torch.empty(0, dtype=torch.int64), torch.empty(0, 8))).rows.shape == (0, 32)


def test_payload_is_aligned_and_zero_copy():
    buf = bytearray(codec.encode_record(torch.arange(3, dtype=torch.int64), torch.ones(3, 5, dtype=torch.float64)))
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    rec = codec.decode_record(buf)
    # Views into the buffer (no copy), each starting 8-byte aligned relative to the value start.
    assert (rec.ids.data_ptr() - base) % 8 == 0 and 0 < rec.ids.data_ptr() - base < len(buf)
    assert (rec.states.data_ptr() - base) % 8 == 0 and 0 < rec.states.data_ptr() - base < len(buf)
    assert rec.ids.tolist() == [0, 1, 2]


DECODERS = [codec.decode_record, codec.decode_record_rows]


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("pos", [0, 9, 20, -1, -5])
def test_flipped_byte_is_detected(pos, decode):
    buf = bytearray(codec.encode_record(torch.arange(10), torch.randn(10, 4)))
    buf[pos] ^= 0x40
    with pytest.raises(CorruptRecordError):
        decode(bytes(buf))


@pytest.mark.parametrize("decode", DECODERS)
def test_truncated_value_is_detected(decode):
    buf = codec.encode_record(torch.arange(10), torch.randn(10, 4))
    with pytest.raises(CorruptRecordError):
        decode(buf[:-8])
    with pytest.raises(CorruptRecordError):
        decode(buf[:5])


def test_the_read_paths_decoder_refuses_what_it_cannot_hold_as_rows():
    """Checksummed but foreign: float ids, or states without one row per id."""
    with pytest.raises(CorruptRecordError, match="ids of dtype float32"):
        codec.decode_record_rows(codec.encode_record(torch.arange(4.0), torch.ones(4, 2)))
    with pytest.raises(CorruptRecordError, match=r"states of shape \[3, 2\] for 4 ids"):
        codec.decode_record_rows(codec.encode_record(torch.arange(4), torch.ones(3, 2)))
    with pytest.raises(CorruptRecordError, match="states of shape"):
        codec.decode_record_rows(codec.encode_record(torch.arange(1), torch.tensor(2.0)))


def test_unknown_kind_raises():
    buf = codec.encode_record(torch.arange(3), None, kind=7)
    with pytest.raises(CorruptRecordError, match="unknown record kind"):
        codec.decode_record(buf)


def test_unsupported_dtype_is_invalid_input():
    with pytest.raises(InvalidInputError):
        codec.dtype_name(torch.quint8)


def test_keys_sort_numerically():
    keys = [(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 256, 0), (0, 2**40, 3), (1, 0, 0), (2**31, 5, 2**32 - 1)]
    encoded = [codec.record_key(*k) for k in keys]
    assert sorted(encoded) == encoded
    assert [codec.decode_record_key(k) for k in encoded] == keys
    assert all(len(k) == codec.KEY_SIZE for k in encoded)
    assert codec.record_key(3, 9, 1).startswith(codec.table_prefix(3))


@pytest.mark.parametrize("n_ids", [5, 6, 7])  # odd counts put padding between the parts
def test_encoding_into_a_reused_buffer_gives_the_bytes_of_a_fresh_one(n_ids):
    source = torch.randn(20, 3)
    ids = torch.arange(n_ids, dtype=torch.int32) * 2
    fresh = codec.encode_gathered(ids, source, ids, publish_time=12.5)
    assert isinstance(fresh, bytearray)
    size = codec.encoded_size(ids, source.dtype, (n_ids, 3), codec.KIND_SNAPSHOT, 12.5)
    assert size == len(fresh)
    used = bytearray(b"\xa5" * (size + 64))  # what an earlier, larger record left behind
    got = codec.encode_gathered(ids, source, ids, publish_time=12.5, into=used)
    assert isinstance(got, memoryview) and got.obj is used and bytes(got) == bytes(fresh)
    rec = codec.decode_record(got)
    assert torch.equal(rec.states, source[ids.long()]) and rec.publish_time == 12.5
    # a buffer too small is left alone: the record gets its own
    small = bytearray(size - 1)
    own = codec.encode_gathered(ids, source, ids, publish_time=12.5, into=small)
    assert isinstance(own, bytearray) and bytes(own) == bytes(fresh) and small == bytearray(size - 1)
