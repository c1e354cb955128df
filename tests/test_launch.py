"""The direct launcher's cache key: everything the JIT specialises on, nothing else."""

import torch

from splitkv.launch import _specialization, alignment_bits


def test_key_follows_dtype_alignment_and_integer_specialisation():
    a = torch.zeros(64, dtype=torch.float16)
    base = _specialization((a, 32, 7, 1.5))
    assert _specialization((torch.zeros(64, dtype=torch.float16), 48, 9, 2.5)) == base  # same classes
    assert _specialization((a.to(torch.float32), 32, 7, 1.5)) != base  # dtype
    assert _specialization((a[1:], 32, 7, 1.5)) != base  # a 2-byte offset breaks 16-byte alignment
    assert _specialization((a, 33, 7, 1.5)) != base  # no longer a multiple of 16
    assert _specialization((a, 32, 1, 1.5)) != base  # 1 is specialised
    assert _specialization((a, 32, 2**31, 1.5)) != base  # past 32 bits: an i64 argument


def test_alignment_bits():
    a = torch.zeros(64, dtype=torch.float16)
    assert alignment_bits([a.data_ptr(), a[8:].data_ptr()]) == -1  # all on 16-byte boundaries
    assert alignment_bits([a.data_ptr(), a[1:].data_ptr(), a[8:].data_ptr()]) == 0b101  # which ones are
    assert alignment_bits([a[1:].data_ptr(), a[3:].data_ptr()]) == 0
