"""Long tensor lists, as the benchmarks time them: 10,000 small tensors (more than one CUDA launch
holds) through unscale_ and cast_, against torch, and a non-finite value hidden in one tensor of
such a list. These were checks inside the benchmarks, which now only guard what they time."""
import random

import pytest
import torch

from mpext import ops

from reference import assert_same_bits_or_both_nan
from test_scale_ops import run_both


def small_list(dtypes, n=10_000, most=300, seed=20240601):
    """``n`` gradient-like tensors of 1..``most`` elements, their dtypes cycling through
    ``dtypes``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rng.randint(1, most), generator=gen) * 1e-3).to(dtypes[i % len(dtypes)])
            for i in range(n)]


def flat(tensors, dtype):
    """The list's tensors of ``dtype`` as one flat CPU tensor: compared in one call."""
    return torch.cat([t.reshape(-1).cpu() for t in tensors if t.dtype == dtype])


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float32, torch.bfloat16]],
                         ids=["fp32", "fp32+bf16"])
def test_unscale_many_tensors(device, dtypes):
    xs = small_list(dtypes)
    ours, fo, theirs, ft = run_both(xs, 1.0 / 3.0, device)
    assert fo == ft == 0.0
    for dt in dtypes:
        assert_same_bits_or_both_nan(flat(ours, dt), flat(theirs, dt), flat(xs, dt))
    ours, fo, _, _ = run_both(xs, 1.0, device)  # check only: nothing written
    assert fo == 0.0
    for dt in dtypes:
        assert torch.equal(flat(ours, dt).view(torch.uint8), flat(xs, dt).view(torch.uint8))
    # one non-finite element in the first, a middle and the last tensor (bf16 in the mixed list)
    for k, bad in ((0, float("-inf")), (len(xs) // 2, float("inf")), (len(xs) - 1, float("nan"))):
        ys = list(xs)
        ys[k] = ys[k].clone()
        ys[k].view(-1)[ys[k].numel() // 2] = bad
        ours, fo, theirs, ft = run_both(ys, 0.5, device)
        assert fo == ft == 1.0, (k, bad)
        assert_same_bits_or_both_nan(ours[k], theirs[k], ys[k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_many_tensors(device, dtype):
    src = [x.to(device) for x in small_list([torch.float32])]
    dst = [torch.empty_like(s, dtype=dtype) for s in src]
    ops.cast_(dst, src)
    whole = torch.cat([s.reshape(-1) for s in src])
    assert torch.equal(flat(dst, dtype).view(torch.int16), whole.cpu().to(dtype).view(torch.int16))
    if dtype == torch.bfloat16:  # one stream over the list: the functional op on the whole
        ops.cast_(dst, src, stochastic=True, seed=3, offset=5)
        want = ops.to_bf16(whole, stochastic=True, seed=3, offset=5)
        assert torch.equal(flat(dst, dtype).view(torch.int16), want.cpu().view(torch.int16))
