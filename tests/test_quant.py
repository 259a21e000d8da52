import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leankit.quant import NonFiniteKVError, dequantize, error_bound, pack, quantize, unpack

BITS = [8, 4, 2, 1]


@pytest.mark.parametrize("bits", BITS)
def test_pack_exact(bits):
    # Little-endian within a byte: element e sits in byte e // P at bit (e % P) * bits.
    p = 8 // bits
    codes = torch.randint(0, 1 << bits, (5, 3, 8 * p))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 8)
    expect = torch.zeros(5, 3, 8, dtype=torch.int64)
    for e in range(8 * p):
        expect[..., e // p] |= codes[..., e].long() << ((e % p) * bits)
    assert torch.equal(packed.long(), expect)
    assert torch.equal(unpack(packed, bits), codes.int())


def test_pack_known_bytes():
    assert pack(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]
    assert pack(torch.tensor([[3, 0, 1, 2]]), 2).tolist() == [[0b10010011]]
    assert pack(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]]), 1).tolist() == [[0b10000001]]


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    rows=st.integers(1, 7),
    groups=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_roundtrip_error_bound(bits, rows, groups, data):
    f = 8 * groups * (8 // bits if bits < 8 else 1)
    arr = data.draw(hnp.arrays(np.float32, (rows, f), elements=st.floats(-300, 300, width=32)))
    x = torch.from_numpy(arr)
    gs = f // groups
    packed, scale, mn = quantize(x, bits, gs)
    assert packed.shape == (rows, f * bits // 8)
    assert scale.dtype == mn.dtype == torch.float16 and scale.shape == (rows, groups)
    xh = dequantize(packed, scale, mn, bits)
    assert torch.isfinite(xh).all()
    err = (xh - x).abs().reshape(rows, groups, gs).amax(-1)
    assert (err <= error_bound(x, bits, gs)).all()


@pytest.mark.parametrize("magnitude", [1e-4, 1e-5, 1e-6, 3e-7, 1e-7])
def test_small_groups_keep_their_precision_and_more_bits_err_less(magnitude):
    """Groups whose quantization step is an fp16 subnormal (below 2^-14): rounded to nearest, the
    stored scale could fall under the step, clamping the top codes, or to 0, leaving every element
    at its group's minimum; 8-bit codes then erred more than 4-bit ones. It rounds up there."""
    gen = torch.Generator().manual_seed(int(-np.log10(magnitude) * 10))
    x = torch.randn(257, 64, generator=gen) * magnitude
    errs = {}
    for bits in BITS:
        packed, scale, mn = quantize(x, bits)
        xh = dequantize(packed, scale, mn, bits)
        assert (scale.float() > 0).all()  # no group of distinct values collapses to its minimum
        step = (x.amax(-1, keepdim=True) - mn.float()) / ((1 << bits) - 1)
        subnormal = scale.float() < 2.0 ** -14
        assert (scale.float()[subnormal] >= step[subnormal]).all()  # the top code never clamps
        err = (xh - x).abs().amax(-1, keepdim=True)
        assert (err <= error_bound(x, bits)).all()
        errs[bits] = ((xh - x).norm() / x.norm()).item()
    assert errs[8] <= errs[4] <= errs[2] <= errs[1], errs


@pytest.mark.parametrize("bits", BITS)
def test_random_normal_error_is_half_step(bits):
    x = torch.randn(123, 64) * 3
    packed, scale, mn = quantize(x, bits)
    err = (dequantize(packed, scale, mn, bits) - x).abs().amax(-1)
    step = (x.amax(-1) - x.amin(-1)) / ((1 << bits) - 1)
    # half a step plus fp16 rounding of scale/min (relative 2^-11 of the range)
    assert (err <= step / 2 + 2 ** -10 * x.abs().amax(-1)).all()


@pytest.mark.parametrize("bits", BITS)
def test_constant_vector_no_nan(bits):
    x = torch.full((3, 16), 1.25)
    packed, scale, mn = quantize(x, bits)
    assert (scale == 0).all()
    xh = dequantize(packed, scale, mn, bits)
    assert torch.isfinite(xh).all() and torch.equal(xh, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(bad):
    x = torch.randn(2, 16)
    x[1, 3] = bad
    with pytest.raises(NonFiniteKVError, match="NaN or Inf"):
        quantize(x, 4)


def test_out_of_fp16_range_rejected():
    x = torch.randn(2, 16)
    x[0, 0] = -1e6  # the stored fp16 minimum would overflow
    with pytest.raises(NonFiniteKVError, match="fp16"):
        quantize(x, 8)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(2, 16), 4, group_size=5)
