"""The paged-KV layout utilities and the paged problem builder, on the CPU (no kernels).

* :func:`token_indices` turns a page table back into the token slots of the
  flattened pool; gathered through :func:`flat_pool`, they give the token-pool
  problem's prefix rows bit for bit (page sizes 1, 16, 64; ragged prefixes,
  page-aligned ones and an empty one);
* :func:`flat_pool` is a view of a mergeable pool and a correct copy otherwise;
* :func:`pages_from_block_table` matches a plain loop, has output sizes fixed
  by the shapes, and never reads the device (no data-dependent op);
* :func:`paged_problem` poisons exactly the rows no prefix uses;
* malformed inputs raise ``ValueError``.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from splitkv.paged import flat_pool, pages_from_block_table, token_indices
from splitkv.testing import PagedProblem, make_problem, paged_problem, reference_for

#: Ragged prefixes: odd lengths, an empty one, page-aligned ones (for 16 and 64), one key.
PREFIXES = [54, 97, 0, 64, 1, 128]
PAGE_SIZES = [1, 16, 64]
FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def small_problem(dtype=torch.float16, index_dtype=torch.int64, prefixes=PREFIXES, kv_dtype=None, seed=0):
    return make_problem(prefixes, 3, 4, 2, 16, 8, dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype,
                        seed=seed)


def bits(t):
    """The raw bits of a float tensor, so that comparisons are bitwise (and NaN == NaN)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def page_rows(pages):
    """``[num_pages, page_size]`` bool: rows that are NaN in every element / in some element."""
    nan = pages.to(torch.float32).isnan().flatten(2)
    return nan.all(-1), nan.any(-1)


# --- token_indices ----------------------------------------------------------------

@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_token_indices_give_back_the_prefix_rows(page_size, dtype, index_dtype):
    p = small_problem(dtype, index_dtype, seed=page_size)
    paged = paged_problem(p, page_size, seed=7)
    tok_indptr, tok = token_indices(paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, page_size)

    assert tok.dtype == index_dtype and tok_indptr.dtype == paged.kv_indptr.dtype
    assert tok_indptr.tolist() == p.kv_indptr.tolist()
    kv = p.kv_indptr.tolist()
    for pool, pages in ((p.k_buffer, paged.k_pages), (p.v_buffer, paged.v_pages)):
        flat = flat_pool(pages)
        for b in range(p.batch_size):
            got = flat[tok[kv[b]: kv[b + 1]].long()]
            want = pool[p.kv_indices[kv[b]: kv[b + 1]].long()]
            assert not got.isnan().any(), f"sequence {b}: a slot points at a poisoned row"
            assert torch.equal(bits(got), bits(want)), f"sequence {b}: rows differ"


def test_token_indices_feed_the_oracle_exactly():
    """The float64 oracle on the flattened pool and token slots is the token-pool problem's answer."""
    p = make_problem(PREFIXES, 4, 4, 2, 16, dtype=torch.float32, mask="tree", sinks=True, seed=3)
    paged = paged_problem(p, 16)
    tok_indptr, tok = token_indices(paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, 16)
    flat = p.replace(k_buffer=flat_pool(paged.k_pages), v_buffer=flat_pool(paged.v_pages),
                     kv_indptr=tok_indptr, kv_indices=tok)
    assert torch.equal(reference_for(flat), reference_for(p))


def test_token_indices_against_a_plain_loop():
    """Random page tables (repeated pages, unused entries after the last range, empty sequences)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        page_size = [1, 3, 16, 64][trial % 4]
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        n_pages = torch.randint(0, 5, (bs,), generator=gen).tolist()
        indptr = [0]
        for n in n_pages:
            indptr.append(indptr[-1] + n)
        indices = torch.randint(0, 50, (indptr[-1] + 3,), generator=gen, dtype=torch.int32)
        last = [int(torch.randint(1, page_size + 1, (1,), generator=gen)) if n else 0 for n in n_pages]

        tok_indptr, tok = token_indices(torch.tensor(indptr, dtype=torch.int32), indices,
                                        torch.tensor(last, dtype=torch.int32), page_size)

        want, want_indptr = [], [0]
        for b in range(bs):
            length = (n_pages[b] - 1) * page_size + last[b] if n_pages[b] else 0
            for n in range(length):
                want.append(int(indices[indptr[b] + n // page_size]) * page_size + n % page_size)
            want_indptr.append(len(want))
        assert tok.tolist() == want and tok_indptr.tolist() == want_indptr, f"trial {trial}"
        assert tok.dtype == torch.int32 and tok_indptr.dtype == torch.int32


def test_token_indices_promote_to_int64_past_int32():
    page_size = 16
    big_page = 2**31 // page_size + 5  # its slots do not fit in int32
    tok_indptr, tok = token_indices(torch.tensor([0, 1, 2], dtype=torch.int32),
                                    torch.tensor([3, big_page], dtype=torch.int32),
                                    torch.tensor([2, 1], dtype=torch.int32), page_size)
    assert tok.dtype == torch.int64
    assert tok.tolist() == [3 * page_size, 3 * page_size + 1, big_page * page_size]
    assert tok_indptr.dtype == torch.int32 and tok_indptr.tolist() == [0, 2, 3]


# --- flat_pool --------------------------------------------------------------------

def test_flat_pool_is_a_view_of_a_contiguous_pool():
    pages = torch.randn(5, 4, 2, 8)
    flat = flat_pool(pages)
    assert flat.shape == (20, 2, 8) and flat.data_ptr() == pages.data_ptr()
    flat[6] = 0.0  # page 1, row 2
    assert (pages[1, 2] == 0).all()


def test_flat_pool_copies_a_pool_it_cannot_merge():
    big = torch.randn(5, 8, 2, 4)
    pages = big[:, :3]  # stride(0) = 8 rows, not 3
    assert pages.stride(0) != 3 * pages.stride(1)
    flat = flat_pool(pages)
    assert flat.shape == (15, 2, 4) and flat.is_contiguous()
    assert flat.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    for page in range(5):
        for row in range(3):
            assert torch.equal(flat[page * 3 + row], big[page, row])


# --- pages_from_block_table -------------------------------------------------------

def block_table_loop(block_table, seq_lens, page_size):
    """The packing, written the plain way: ``(kv_indptr, used kv_indices, kv_last_page_len)``."""
    indptr, indices, last = [0], [], []
    for row, n in zip(block_table.tolist(), seq_lens.tolist()):
        n_pages = -(-n // page_size)
        indices += row[:n_pages]
        indptr.append(len(indices))
        last.append(n - (n_pages - 1) * page_size if n_pages else 0)
    return indptr, indices, last


@pytest.mark.parametrize("seq_dtype", [torch.int32, torch.int64])
def test_pages_from_block_table_against_a_loop(seq_dtype):
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        page_size = [1, 16, 64, 5][trial % 4]
        bs = int(torch.randint(1, 7, (1,), generator=gen))
        max_blocks = int(torch.randint(1, 6, (1,), generator=gen))
        block_table = torch.randint(0, 1000, (bs, max_blocks), generator=gen, dtype=torch.int32)
        seq_lens = torch.randint(0, max_blocks * page_size + 1, (bs,), generator=gen, dtype=seq_dtype)
        seq_lens[0] = max_blocks * page_size if trial % 3 == 0 else seq_lens[0]  # a full row
        seq_lens[-1] = 0 if trial % 5 == 0 else seq_lens[-1]  # an empty sequence

        kv_indptr, kv_indices, last = pages_from_block_table(block_table, seq_lens, page_size)

        want_indptr, want_indices, want_last = block_table_loop(block_table, seq_lens, page_size)
        assert all(t.dtype == torch.int32 for t in (kv_indptr, kv_indices, last))
        assert kv_indptr.tolist() == want_indptr, f"trial {trial}"
        assert kv_indices[: want_indptr[-1]].tolist() == want_indices, f"trial {trial}"
        assert (kv_indices[want_indptr[-1]:] == 0).all(), f"trial {trial}: unused tail not zero"
        assert last.tolist() == want_last, f"trial {trial}"

        # The result is a valid page table: token_indices reads it back to the block-table slots.
        _, tok = token_indices(kv_indptr, kv_indices, last, page_size)
        want_tok = [int(block_table[b, n // page_size]) * page_size + n % page_size
                    for b in range(bs) for n in range(int(seq_lens[b]))]
        assert tok.tolist() == want_tok


def test_pages_from_block_table_sizes_depend_on_shapes_only():
    bs, max_blocks, page_size = 4, 6, 16
    block_table = torch.arange(bs * max_blocks, dtype=torch.int32).view(bs, max_blocks)
    for lens in ([0, 0, 0, 0], [1, 17, 96, 50], [96, 96, 96, 96], [5, 0, 33, 80]):
        out = pages_from_block_table(block_table, torch.tensor(lens, dtype=torch.int32), page_size)
        assert [tuple(t.shape) for t in out] == [(bs + 1,), (bs * max_blocks,), (bs,)]


class _OpLog(TorchDispatchMode):
    """Records every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


#: Ops whose result (a Python scalar, or a size) depends on tensor values: a
#: device-to-host read on a GPU, an error under CUDA-graph capture.
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "item", "unique", "_unique2"}


def test_pages_from_block_table_reads_nothing_back():
    """No op whose output depends on values (``.item()``, ``.tolist()``, boolean indexing).

    The op log is checked on a control first: :func:`token_indices`, which
    does read the device, must show up in it.
    """
    block_table = torch.randint(0, 100, (3, 4), dtype=torch.int32)
    seq_lens = torch.tensor([5, 0, 64], dtype=torch.int32)
    with _OpLog() as log:
        kv_indptr, kv_indices, last = pages_from_block_table(block_table, seq_lens, 16)
    assert log.ops and not log.ops & HOST_READS, sorted(log.ops & HOST_READS)
    with _OpLog() as control:
        token_indices(kv_indptr, kv_indices, last, 16)
    assert control.ops & HOST_READS


def test_pages_from_block_table_clamps_lengths_past_the_table():
    block_table = torch.tensor([[4, 9], [7, 1]], dtype=torch.int32)
    kv_indptr, kv_indices, last = pages_from_block_table(block_table, torch.tensor([100, -3]), 16)
    assert kv_indptr.tolist() == [0, 2, 2] and kv_indices.tolist() == [4, 9, 0, 0]
    assert last.tolist() == [16, 0]


# --- paged_problem ----------------------------------------------------------------

@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32, *FLOAT8], ids=str)
def test_paged_problem_poisons_exactly_the_unused_rows(page_size, kv_dtype):
    p = small_problem(torch.float16, kv_dtype=kv_dtype, seed=1)
    spare = 3
    paged = paged_problem(p, page_size, spare_pages=spare)
    needed = sum(-(-n // page_size) for n in p.prefix_lens)

    assert isinstance(paged, PagedProblem) and paged.page_size == page_size
    assert paged.k_pages.shape == (needed + spare, page_size, 2, 16)
    assert paged.v_pages.shape == (needed + spare, page_size, 2, 8)
    assert paged.k_pages.dtype == paged.v_pages.dtype == kv_dtype
    for pages in (paged.k_pages, paged.v_pages):
        all_nan, any_nan = page_rows(pages)
        assert torch.equal(all_nan, any_nan), "a row is partly poisoned"
        assert int(all_nan.sum()) == (needed + spare) * page_size - sum(p.prefix_lens)
    # The page table: distinct pages, the right counts and last-page lengths.
    ids = paged.kv_indices.tolist()
    assert len(set(ids)) == len(ids) == needed and paged.kv_indices.dtype == p.kv_indices.dtype
    assert paged.kv_indptr.dtype == p.kv_indptr.dtype and paged.kv_last_page_len.dtype == torch.int32
    lens = [(m - 1) * page_size + int(last) if m else 0 for m, last in
            zip(paged.kv_indptr.diff().tolist(), paged.kv_last_page_len)]
    assert lens == p.prefix_lens
    # And the used rows hold the prefix, in order.
    _, tok = token_indices(paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, page_size)
    assert torch.equal(bits(flat_pool(paged.k_pages)[tok.long()]), bits(p.k_buffer[p.kv_indices.long()]))
    assert torch.equal(bits(flat_pool(paged.v_pages)[tok.long()]), bits(p.v_buffer[p.kv_indices.long()]))


def test_paged_problem_is_seeded():
    p = small_problem()
    a, b, c = paged_problem(p, 16, seed=5), paged_problem(p, 16, seed=5), paged_problem(p, 16, seed=6)
    assert torch.equal(a.kv_indices, b.kv_indices) and torch.equal(bits(a.k_pages), bits(b.k_pages))
    assert not torch.equal(a.kv_indices, c.kv_indices)


def test_paged_problem_args_and_kwargs():
    p = make_problem([54, 0, 97], 3, 4, 2, 16, dtype=torch.float32, mask="tree", sinks=True, seed=2)
    paged = paged_problem(p, 16)
    o = p.new_output()
    got, base = paged.args(o), p.args(o)
    replaced = {4: paged.k_pages, 5: paged.v_pages, 7: paged.kv_indptr, 8: paged.kv_indices}
    assert len(got) == len(base)
    for i, (x, y) in enumerate(zip(got, base)):
        assert x is replaced.get(i, y), f"argument {i}"
    assert paged.kwargs() == {**p.kwargs(), "kv_last_page_len": paged.kv_last_page_len}


def test_paged_problem_all_empty():
    p = small_problem(prefixes=[0, 0])
    paged = paged_problem(p, 16, spare_pages=2)
    assert paged.kv_indices.numel() == 0 and paged.kv_indptr.tolist() == [0, 0, 0]
    assert paged.kv_last_page_len.tolist() == [0, 0] and paged.k_pages.isnan().all()


# --- malformed inputs -------------------------------------------------------------

def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("args, match", [
    ((_i32([[0, 1]]), _i32([3]), _i32([2]), 16), "kv_indptr must be a 1-D"),
    ((_i32([0, 1]), torch.tensor([3.0]), _i32([2]), 16), "kv_indices must be a 1-D"),
    ((_i32([0, 1]), _i32([3]), torch.tensor([2], dtype=torch.int16), 16), "kv_last_page_len must be a 1-D"),
    ((_i32([0, 1]), _i32([3]), _i32([2, 2]), 16), "one per sequence"),
    ((_i32([]), _i32([3]), _i32([]), 16), "one per sequence"),
    ((_i32([0, 1]), _i32([3]), _i32([2]), 0), "page_size"),
    ((_i32([0, 1]), _i32([3]), _i32([0]), 16), r"kv_last_page_len\[0\] = 0"),
    ((_i32([0, 1]), _i32([3]), _i32([17]), 16), r"kv_last_page_len\[0\] = 17"),
    ((_i32([0, 1, 1]), _i32([3]), _i32([4, 1]), 16), r"kv_last_page_len\[1\] = 1 with 0 pages"),
    ((_i32([0, 2]), _i32([3]), _i32([4]), 16), "non-decreasing"),
    ((_i32([0, 1, 0]), _i32([3]), _i32([4, 0]), 16), "non-decreasing"),
    ((_i32([0, 1]), _i32([-3]), _i32([4]), 16), "negative page id"),
])
def test_token_indices_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        token_indices(*args)


def test_flat_pool_rejects_other_ranks():
    for bad in (torch.zeros(4, 2, 8), torch.zeros(2, 4, 2, 8, 1)):
        with pytest.raises(ValueError, match="4-D"):
            flat_pool(bad)


@pytest.mark.parametrize("args, match", [
    ((_i32([1, 2]), _i32([3]), 16), "block_table must be a 2-D"),
    ((torch.zeros(2, 3), _i32([3, 4]), 16), "block_table must be a 2-D"),
    ((_i32([[1, 2]]), _i32([[3]]), 16), "seq_lens must be a 1-D"),
    ((_i32([[1, 2]]), _i32([3, 4]), 16), "seq_lens has 2 entries"),
    ((_i32([[1, 2]]), _i32([3]), 0), "page_size"),
])
def test_pages_from_block_table_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        pages_from_block_table(*args)


def test_paged_problem_rejects():
    p = small_problem()
    with pytest.raises(ValueError, match="page_size"):
        paged_problem(p, 0)
    with pytest.raises(ValueError, match="spare_pages"):
        paged_problem(p, 16, spare_pages=-1)
