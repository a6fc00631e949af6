"""The kv_records kernel against numpy and the crc32c package, at every ISA level the CPU runs: CRC32C
values equal, gathers and scatters bit-exact for random shapes and indices, a row that fails its check
never copied, an index out of range refused before anything is written, and the shm store's headers."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.kv_records import CachePieces, kv_record_kernel

LEVELS = [level for level in cpu_info().supported_levels if level != "amx"]  # amx builds like avx512_bf16
# Around the CRC's rounds (6 x 1024 and 6 x 128 bytes) and its 8-byte words.
LENGTHS = [0, 1, 7, 8, 9, 63, 64, 767, 768, 769, 6143, 6144, 6145, 6144 + 768 + 13, 3 * 6144, 65536, 100_003]


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request):
    k = kv_record_kernel(request.param)
    if k is None:
        pytest.skip("no C compiler: kv_records kernel unavailable")
    return k


def test_hardware_crc_from_the_sse4_2_levels_up():
    for level in LEVELS:
        k = kv_record_kernel(level)
        if k is None:
            pytest.skip("no C compiler: kv_records kernel unavailable")
        # generic is x86-64 without SSE4.2 (or another machine): the portable table
        assert k.hw_crc == (level != "generic")


def test_crc32c_is_the_crc32c_packages(kernel):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 100_100, dtype=np.uint8)
    for n in LENGTHS:
        for offset in (0, 3):  # unaligned too
            chunk = data[offset : offset + n]
            assert kernel.crc32c(chunk) == crc32c.crc32c(chunk.tobytes()), (n, offset)
    # `value` continues a checksum, as the package's does
    head, tail = data[:6145], data[6145:20000]
    assert kernel.crc32c(tail, kernel.crc32c(head)) == crc32c.crc32c(data[:20000].tobytes())
    assert kernel.crc32c(np.zeros(4096, np.uint8)) == crc32c.crc32c(bytes(4096))
    assert kernel.crc32c(np.full(4096, 255, np.uint8)) == crc32c.crc32c(b"\xff" * 4096)


# (pieces per row, piece bytes): tiny and odd, around a CRC round, the default stage (6 KiB) and 8 x 128 heads (32 KiB)
SHAPES = [(1, 1), (3, 30), (4, 64), (2, 6144 - 8), (30, 6144), (6, 6144 + 200), (3, 32768)]


def cache_and_rows(num_pieces: int, piece_nbytes: int, num_blocks: int, num_rows: int, seed: int, row_pad: int):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (num_blocks * piece_nbytes,), dtype=torch.uint8, generator=g) for _ in range(num_pieces)]
    # rows with a stride of their own (a record's header before each), unaligned when row_pad is odd
    rows = np.random.default_rng(seed).integers(0, 256, (num_rows, num_pieces * piece_nbytes + row_pad), dtype=np.uint8)
    return tensors, rows[:, row_pad:]


def numpy_rows(tensors, piece_nbytes: int, block_ids) -> np.ndarray:
    """What a gather writes: `[n, num_pieces * piece_nbytes]`, the numpy way."""
    pieces = [t.numpy().reshape(-1, piece_nbytes)[block_ids] for t in tensors]  # each [n, piece_nbytes]
    return np.stack(pieces, axis=1).reshape(len(block_ids), -1)


@pytest.mark.parametrize("num_pieces,piece_nbytes", SHAPES)
@pytest.mark.parametrize("streaming", [False, True])
def test_gather_is_numpys_and_notes_each_rows_crc32c(kernel, num_pieces, piece_nbytes, streaming):
    rng = np.random.default_rng(num_pieces * 100_000 + piece_nbytes)
    num_blocks, num_rows = 9, 7
    tensors, rows = cache_and_rows(num_pieces, piece_nbytes, num_blocks, num_rows, seed=piece_nbytes, row_pad=128 + piece_nbytes % 2)
    pieces = CachePieces.of(tensors, piece_nbytes)
    block_ids = rng.choice(num_blocks, 5, replace=False)  # unsorted, with gaps
    row_ids = rng.choice(num_rows, 5, replace=False)
    untouched = np.setdiff1d(np.arange(num_rows), row_ids)
    before = rows.copy()
    noted = np.full(num_rows, -1, dtype=np.int64)
    kernel.gather(pieces, block_ids, rows, row_ids, noted, streaming=streaming)
    assert np.array_equal(rows[row_ids], numpy_rows(tensors, piece_nbytes, block_ids))
    assert np.array_equal(rows[untouched], before[untouched])
    assert [int(noted[r]) for r in row_ids] == [crc32c.crc32c(rows[r].tobytes()) for r in row_ids]
    assert (noted[untouched] == -1).all()
    kernel.gather(pieces, block_ids[:0], rows, row_ids[:0])  # nothing to do


@pytest.mark.parametrize("num_pieces,piece_nbytes", SHAPES)
@pytest.mark.parametrize("streaming", [False, True])
def test_scatter_is_numpys_and_never_copies_a_row_that_fails(kernel, num_pieces, piece_nbytes, streaming):
    rng = np.random.default_rng(num_pieces * 100_000 + piece_nbytes + 1)
    num_blocks, num_rows = 9, 7
    tensors, rows = cache_and_rows(num_pieces, piece_nbytes, num_blocks, num_rows, seed=piece_nbytes + 1, row_pad=3)
    pieces = CachePieces.of(tensors, piece_nbytes)
    block_ids = rng.choice(num_blocks, 4, replace=False)
    row_ids = rng.choice(num_rows, 4, replace=False)
    before = [t.clone() for t in tensors]
    kernel.scatter(pieces, block_ids, rows, row_ids, streaming=streaming)
    assert np.array_equal(numpy_rows(tensors, piece_nbytes, block_ids), rows[row_ids])
    others = np.setdiff1d(np.arange(num_blocks), block_ids)
    assert np.array_equal(numpy_rows(tensors, piece_nbytes, others), numpy_rows(before, piece_nbytes, others))

    # with the CRC32Cs the rows must have: row 1's is off by one bit, so its block keeps its bytes
    targets = rng.permutation(num_blocks)[:4]
    expected = np.array([crc32c.crc32c(rows[r].tobytes()) for r in row_ids], dtype=np.uint32)
    expected[1] ^= 1
    kept = numpy_rows(tensors, piece_nbytes, targets[1:2])
    intact = kernel.scatter(pieces, targets, rows, row_ids, expected, streaming=streaming)
    assert intact.tolist() == [True, False, True, True]
    assert np.array_equal(numpy_rows(tensors, piece_nbytes, targets[[0, 2, 3]]), rows[row_ids[[0, 2, 3]]])
    assert np.array_equal(numpy_rows(tensors, piece_nbytes, targets[1:2]), kept)


def test_an_index_out_of_range_is_refused_before_any_write(kernel):
    tensors, rows = cache_and_rows(2, 64, num_blocks=4, num_rows=3, seed=5, row_pad=0)
    pieces = CachePieces.of(tensors, 64)
    before_rows, before_cache = rows.copy(), [t.clone() for t in tensors]
    for block_ids, row_ids in (([0, 4], [0, 1]), ([0, 1], [2, 3]), ([0, -1], [0, 1])):
        with pytest.raises(IndexError):
            kernel.gather(pieces, np.array(block_ids), rows, np.array(row_ids))
        with pytest.raises(IndexError):
            kernel.scatter(pieces, np.array(block_ids), rows, np.array(row_ids))
    assert np.array_equal(rows, before_rows)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before_cache))
    with pytest.raises(ValueError):
        kernel.gather(pieces, np.array([0]), rows[:, :100], np.array([0]))  # not a row of these pieces


def test_shm_records_headers(kernel):
    """begin_write zeroes headers and forgets notes; seal writes template + hash + CRC32C (noted, else
    read); verify says which headers fit and which payloads differ, without reading them if asked."""
    num_slots, header_nbytes, payload_nbytes, hash_at, crc_at = 5, 128, 6144 + 40, 40, 80
    template = bytes(range(header_nbytes))
    records = np.random.default_rng(1).integers(0, 256, (num_slots, header_nbytes + payload_nbytes), dtype=np.uint8)
    noted = np.full(num_slots, -1, dtype=np.int64)
    shm = kernel.shm_records(records, template, hash_at, crc_at, noted)
    hashes = [bytes([i + 1]) * 32 for i in range(num_slots)]
    payload_crc = [crc32c.crc32c(records[s, header_nbytes:].tobytes()) for s in range(num_slots)]

    noted[[1, 3]] = 7
    shm.begin_write(np.array([3, 4]))
    assert not records[[3, 4], :header_nbytes].any()
    assert noted.tolist() == [-1, 7, -1, -1, -1]
    noted[2] = 12345  # as if a gather had noted it: seal takes it as it is
    shm.seal(np.array([0, 2, 4]), hashes[0] + hashes[2] + hashes[4])
    assert (noted == [-1, 7, -1, -1, -1]).all()
    for slot, crc in ((0, payload_crc[0]), (2, 12345), (4, payload_crc[4])):
        header = bytearray(template)
        header[hash_at : hash_at + 32] = hashes[slot]
        header[crc_at : crc_at + 4] = crc.to_bytes(4, "little")
        assert records[slot, :header_nbytes].tobytes() == bytes(header)

    slots = np.array([0, 2, 4, 3, 1])
    status, crcs = shm.verify(slots, b"".join(hashes[s] for s in slots), check_payload=True)
    assert status.tolist() == [0, 2, 0, 1, 1]  # 2: a noted CRC the payload does not have
    assert crcs[[0, 2]].tolist() == [payload_crc[0], payload_crc[4]] and crcs[1] == 12345
    status, _ = shm.verify(slots[:3], b"".join(hashes[s] for s in slots[:3]), check_payload=False)
    assert status.tolist() == [0, 0, 0]
    status, _ = shm.verify(np.array([0]), hashes[1], check_payload=True)  # another block's hash
    assert status.tolist() == [1]
    with pytest.raises(IndexError):
        shm.begin_write(np.array([0, num_slots]))
    assert records[0, :4].tobytes() == template[:4]  # refused before anything was zeroed
    with pytest.raises(ValueError):
        shm.seal(np.array([0]), b"short")
