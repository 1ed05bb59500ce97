"""The format objects of mpext.optim.formats, checked through their interface only, for every row
of the formats table (``MOMENT_FORMATS``, ``PARAM_FORMATS``): a new format gets these checks by
being a row. Each codec against an independent reference: torch's round to nearest even
(``Tensor.to``) for value formats, exhaustive enumeration of the codes for a block code (every
code of the block, decoded, and the nearest taken in float64, ties to the even code).
"""
import math

import pytest
import torch

from mpext.optim import formats as F

SIGNED = F.Quantity("m", "m_dtype", True)
UNSIGNED = F.Quantity("v", "v_dtype", False)
QUANTITIES = (SIGNED, UNSIGNED)
MOMENTS = sorted(F.MOMENT_FORMATS)
BLOCK = 32  # the smallest block size: many blocks in few elements


def _values(n: int, seed: int, device) -> torch.Tensor:
    """float32 values of many magnitudes (zeros, -0.0, subnormals, exact bf16 ties included)
    on ``device``, drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen)
                                                   .float())
    x[::17] = 0.0
    x[5::23] = -0.0
    x[7::29] = 1e-40  # subnormal
    x[11::31] = 1.0 + 2.0 ** -8  # halfway between two bf16 values
    x[13::37] = -(1.0 + 3 * 2.0 ** -8)
    return x.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _nearest_codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   block: int) -> torch.Tensor:
    """The code of each element by enumeration: every magnitude code of its block decoded (with
    the block's scale), the nearest to |x| in float64, ties to the even code; the sign bit of a
    signed code set for a negative x (-0.0 included)."""
    signed = dtype is torch.int8
    mags = torch.arange(128 if signed else 256, dtype=torch.int64)
    n = x.numel()
    out = torch.empty(n, dtype=torch.int64)
    for b in range(scale.numel()):
        lo, hi = b * block, min((b + 1) * block, n)
        codes = mags.to(torch.uint8).view(dtype)
        grid = F.q8_decode(codes, scale[b:b + 1].expand(1).clone()).double()
        xs = x[lo:hi].double().abs()
        dist = (xs[:, None] - grid[None, :]).abs()
        best = dist.min(dim=1, keepdim=True).values
        ties = dist == best
        # among the nearest, the even code (at most two nearest: adjacent codes)
        even = ties & (mags[None, :] % 2 == 0)
        pick = torch.where(even.any(1), even.float().argmax(1), ties.float().argmax(1))
        code = mags[pick]
        if signed:
            neg = x[lo:hi].view(torch.int32) < 0
            code = code | (neg.long() << 7)
        out[lo:hi] = code
    return out


def _ties(fmt, q, block: torch.Tensor) -> torch.Tensor:
    """A block of a block code's values whose elements after the first (its absmax, so the
    block's scale stays) lie exactly halfway between two adjacent codes of the block, with
    either sign: each a tie, which goes to the even code."""
    first = int(block.abs().argmax())
    out = block.clone()
    out[0], out[first] = block[first], block[0]
    scale = fmt.encode(out, q, block.numel())[fmt.keys(q.name)[1]]
    n = 128 if fmt.storage_dtype(q) is torch.int8 else 256
    codes = torch.arange(n).to(torch.uint8).view(fmt.storage_dtype(q)).to(block.device)
    grid = fmt.decode(codes, scale.expand(1).clone()).double()
    mids = ((grid[1:] + grid[:-1]) / 2)[grid[1:] < out[0].abs().double()]
    mids = mids[torch.linspace(0, mids.numel() - 1, block.numel() - 1).round().long()]
    assert torch.equal(mids.float().double(), mids)  # exact in float32
    signs = torch.ones_like(mids)
    if q.signed:
        signs[1::2] = -1
    out[1:] = (mids * signs).float()
    return out


@pytest.mark.parametrize("name", MOMENTS)
@pytest.mark.parametrize("q", QUANTITIES, ids=lambda q: "signed" if q.signed else "unsigned")
def test_encode_is_the_nearest_value_and_decode_is_exact(name, q, device):
    """encode rounds each value to its format's nearest (ties to even), decode gives back
    exactly the stored value: against Tensor.to for values, against every code of the block
    for a block code (its scale the block's absmax, bit for bit; a block of exact ties)."""
    fmt = F.MOMENT_FORMATS[name]
    x = _values(5 * BLOCK + 7, seed=len(name) + q.signed, device=device)
    if not q.signed:
        x = x.abs()
    if fmt.code is not None:
        x[:BLOCK] = _ties(fmt, q, x[:BLOCK])
    entries = fmt.encode(x, q, BLOCK)
    keys = fmt.keys(q.name)
    assert set(entries) == set(keys), (sorted(entries), keys)
    stored = entries[keys[0]]
    assert stored.dtype is fmt.storage_dtype(q) and stored.shape == x.shape
    assert stored.element_size() == fmt.bytes_per_element
    meta = entries[keys[1]] if len(keys) > 1 else None
    got = fmt.decode(stored, meta)
    assert got.dtype is torch.float32 and got.device == x.device
    if fmt.code is None:
        want = x.to(fmt.dtype)
        assert torch.equal(_bits(stored), _bits(want))
        assert torch.equal(_bits(got), _bits(want.float()))
        return
    nb = math.ceil(x.numel() / BLOCK)
    assert meta.dtype is torch.float32 and meta.numel() == nb
    assert meta.element_size() * len(fmt.meta) == fmt.meta_bytes_per_block
    xc = x.cpu()
    pad = torch.zeros(nb * BLOCK)
    pad[:x.numel()] = xc.abs()
    assert torch.equal(_bits(meta.cpu()), _bits(pad.view(nb, BLOCK).amax(1))), "scales"
    want = _nearest_codes(xc, meta.cpu(), stored.dtype, BLOCK)
    codes = stored.cpu().view(torch.uint8).long()
    bad = (codes != want).nonzero()
    assert bad.numel() == 0, "%d codes are not the nearest; first at %d: %r -> code %d, " \
        "nearest %d" % (bad.numel(), int(bad[0]), float(xc[bad[0]]), int(codes[bad[0]]),
                        int(want[bad[0]]))
    # decode is exact: each element is its code's value on the enumerated grid
    again = fmt.encode(got, q, BLOCK)
    assert torch.equal(_bits(again[keys[0]]), _bits(stored)), "decode -> encode moved a code"


@pytest.mark.parametrize("name", MOMENTS)
@pytest.mark.parametrize("q", QUANTITIES, ids=lambda q: "signed" if q.signed else "unsigned")
def test_new_state_decodes_to_zero_under_the_formats_keys(name, q, device):
    """``new`` gives a first step's state: the format's keys only, in the param's layout,
    decoding to zeros; ``holds`` / ``held`` find it, ``conforms`` takes it, and ``op_args``
    passes its stored tensor (and, for a block code, its scales under ``<quantity>_scales``)."""
    fmt = F.MOMENT_FORMATS[name]
    param = torch.randn(2, 3, 40, 50, device=device).to(memory_format=torch.channels_last)
    state = fmt.new(param, q, BLOCK)
    keys = fmt.keys(q.name)
    assert sorted(state) == sorted(keys)
    stored = state[keys[0]]
    assert stored.dtype is fmt.storage_dtype(q) and stored.stride() == param.stride()
    meta = state[keys[1]] if len(keys) > 1 else None
    assert bool((fmt.decode(stored, meta) == 0).all())
    assert fmt.holds(state, q.name) and F.held(state, q.name) is fmt
    assert fmt.conforms(param, state, q, BLOCK, "")
    t, extra = fmt.op_args(state, q.name)
    assert t is stored
    assert extra == ({} if meta is None else {q.name + "_scales": meta})
    for other in F.MOMENT_FORMATS.values():
        if other is not fmt:
            assert not other.holds(state, q.name), other.name


@pytest.mark.parametrize("name", MOMENTS)
@pytest.mark.parametrize("q", QUANTITIES, ids=lambda q: "signed" if q.signed else "unsigned")
def test_parse_takes_every_spelling_once(name, q):
    """Every spelling of a format -- the object, its name, its storage dtype and that dtype's
    name -- is that format; the group keeps the torch dtype."""
    fmt = F.MOMENT_FORMATS[name]
    dt = fmt.storage_dtype(q)
    for value in (fmt, fmt.name, dt, F.DTYPE_NAMES[dt]):
        group = {q.setting: value}
        assert F.parse(group, (q,), "opt", "") == (fmt,), value
        assert group[q.setting] is dt, value


@pytest.mark.parametrize("value", [torch.float16, "bf16", "fp8", torch.float64])
@pytest.mark.parametrize("q", QUANTITIES, ids=lambda q: "signed" if q.signed else "unsigned")
def test_parse_refuses_other_values_naming_the_setting(value, q):
    group = {q.setting: value}
    code = "torch.int8" if q.signed else "torch.uint8"
    with pytest.raises(ValueError, match=r"^opt: %s must be torch.float32, torch.bfloat16 or %s, "
                                         r"got %s \(x\)$" % (q.setting, code,
                                                            repr(value).replace("(", r"\(")
                                                            .replace(")", r"\)"))):
        F.parse(group, (q,), "opt", " (x)")
    assert group == {q.setting: value}  # nothing changed


@pytest.mark.parametrize("name", sorted(F.PARAM_FORMATS))
def test_param_formats_keep_the_fp32_value(name, device):
    """Each param format's entry for a bf16 param (``new``: the param's own value) decodes to the
    param widened, exactly; ``source`` and ``reset`` agree; a format that keeps nothing has no
    keys and no op argument."""
    fmt = F.PARAM_FORMATS[name]
    param = torch.randn(33, 17, device=device).to(torch.bfloat16)
    entry = fmt.new(param)
    if fmt.key is None:
        assert entry is None and fmt.keys() == () and fmt.op_arg is None
        return
    assert fmt.keys() == (fmt.key,) and entry.dtype is fmt.dtype
    assert entry.element_size() == fmt.bytes_per_element
    state = {fmt.key: entry}
    assert F.stored_param_format(state) is fmt and F.stored_value(state) is entry
    want = param.float()
    assert torch.equal(_bits(fmt.decode(param, state)), _bits(want))
    assert torch.equal(_bits(F.fp32_value(param, state)), _bits(want))
    # an FP32 value the param is the round of survives encode -> decode exactly
    value = want + torch.randn_like(want) * 2.0 ** -12 * want.abs()
    param2 = value.to(torch.bfloat16)
    state = {fmt.key: fmt.encode(param2, value, "x")}
    back = fmt.decode(param2, state)
    assert torch.equal(_bits(back.to(torch.bfloat16)), _bits(param2))
    if not fmt.reads_param:  # a copy, not the param's low half: the value itself
        assert torch.equal(_bits(back), _bits(value))
    fmt.reset(param2, state)
    assert torch.equal(_bits(fmt.decode(param2, state)), _bits(param2.float()))
