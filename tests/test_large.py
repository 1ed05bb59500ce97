"""One tensor of more than 2^31 elements through unscale_ and the casts on the CPU: proves that
element counts and offsets are 64-bit all the way from the binding to the kernels.

The tensor holds 2^31 + 3 bfloat16 values (4.3 GB) with a pattern of period P = 1021 (a prime,
so an index that wrapped at 2^31 or 2^32 would land on a different value): element i has the
bits BASE + i % P. After unscale_ (inv_scale 0.5: every value's exponent drops by one, exactly)
every element is checked, including one NaN planted beyond 2^31 that must set found_inf; then
the bf16 -> fp32 cast (8.6 GB, byte offsets past 2^33) and the fp32 -> bf16 cast back are
checked element by element too. Peak memory is about 13 GB (the fp32 tensor and one bf16
tensor), so the test skips, with the reason, when /proc/meminfo's MemAvailable is smaller than
that plus a margin. Marked slow: deselect with ``-m "not slow"``; and exclusive: under
pytest-xdist no other test runs meanwhile (tests/conftest.py), so the memory it found free at
its start stays free.
"""
import resource
import time

import pytest
import torch

from mpext import ops

N = 2 ** 31 + 3
P = 1021
BASE = 0x3C00  # bf16 bits: 0x3C00 + r for r < P are distinct finite normal values in [2^-7, 2)
NAN_AT = 2 ** 31 + 1
NEEDED_BYTES = int(N * (2 + 4) * 1.1) + (1 << 30)  # bf16 + fp32, plus 10% and 1 GiB of slack


def mem_available():
    """MemAvailable from /proc/meminfo in bytes, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _skip_reason():
    avail = mem_available()
    if avail is None:
        return "no /proc/meminfo to check that ~%.1f GB are free" % (NEEDED_BYTES / 1e9)
    if avail < NEEDED_BYTES:
        return ("needs ~%.1f GB of available memory for a %d-element bf16 tensor and its fp32 "
                "copy; MemAvailable is %.1f GB" % (NEEDED_BYTES / 1e9, N, avail / 1e9))
    return None


def check_periodic(t, block, what, exclude=None):
    """Asserts t (a 1-D integer view) equals block[i % P] at every index i, in chunks so the
    comparison needs little extra memory. `exclude` is an index not checked here."""
    n = t.numel()
    full = n // P * P
    rows = t[:full].view(-1, P)
    step = 1 << 15  # rows per chunk: 33 M elements
    for r in range(0, rows.shape[0], step):
        eq = rows[r:r + step] == block
        if exclude is not None and r * P <= exclude < (r + step) * P and exclude < full:
            eq.view(-1)[exclude - r * P] = True
        if not bool(eq.all()):
            k = int((~eq).view(-1).nonzero()[0, 0]) + r * P
            raise AssertionError("%s: element %d has bits 0x%x, expected 0x%x" % (
                what, k, int(t[k]) & 0xFFFFFFFF, int(block[k % P]) & 0xFFFFFFFF))
    eq = t[full:] == block[:n - full]
    if exclude is not None and exclude >= full:
        eq[exclude - full] = True
    assert bool(eq.all()), "%s: the last %d elements" % (what, n - full)


def check_points(t, block, what):
    """Elements next to the 32-bit boundaries of element indices and byte offsets, exactly."""
    esize = t.element_size()
    points = set()
    for boundary in (2 ** 31 // esize, 2 ** 32 // esize, 2 ** 33 // esize, 2 ** 31, 2 ** 32):
        points.update(range(boundary - 2, boundary + 2))
    points.update(range(N - 3, N))
    for i in sorted(p for p in points if 0 <= p < N and p != NAN_AT):
        assert int(t[i]) == int(block[i % P]), "%s: element %d" % (what, i)


@pytest.mark.slow
@pytest.mark.exclusive
def test_unscale_and_casts_beyond_2_31_elements():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    start = time.perf_counter()
    block16 = (torch.arange(P, dtype=torch.int32) + BASE).to(torch.int16)

    x = torch.empty(N, dtype=torch.bfloat16)
    xi = x.view(torch.int16)
    full = N // P * P
    xi[:full].view(-1, P).copy_(block16)
    xi[full:] = block16[:N - full]
    xi[NAN_AT] = 0x7FC1  # a NaN (with a payload) beyond 2^31: must set found_inf

    found = torch.zeros(())
    ops.unscale_([x], found, torch.full((), 0.5))
    assert found.item() == 1.0, "the NaN at element 2^31 + 1 was not seen"
    assert torch.isnan(x[NAN_AT]).item()
    halved = block16 - 0x80  # v * 0.5 on these normals: the exponent field minus one
    check_points(xi, halved, "unscale_")
    check_periodic(xi, halved, "unscale_", exclude=NAN_AT)
    xi[NAN_AT] = int(halved[NAN_AT % P])  # checked: now the plain pattern, for the casts

    y = ops.to_fp32(x)  # bf16 -> fp32: exact, bits << 16
    assert y.shape == (N,) and y.dtype == torch.float32
    block32 = halved.to(torch.int32) << 16
    yi = y.view(torch.int32)
    check_points(yi, block32, "to_fp32")
    check_periodic(yi, block32, "to_fp32")
    del x, xi

    z = ops.to_bf16(y)  # fp32 -> bf16: these values round-trip exactly
    del y, yi
    zi = z.view(torch.int16)
    check_points(zi, halved, "to_bf16")
    check_periodic(zi, halved, "to_bf16")
    del z, zi

    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("\n%d elements: unscale_, to_fp32, to_bf16 and full checks in %.1f s, peak RSS "
          "%.1f GB, %d threads" % (N, elapsed, peak / 1e9, torch.get_num_threads()))
