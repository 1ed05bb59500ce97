"""The measurements of benchmarks/bench_convergence.py: the BF16 half-ulp used to count lost
updates, the underflow fractions, the learning-rate schedule, and a short training run of
every mode from the same start."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_convergence as bc  # noqa: E402
import gpt  # noqa: E402


def test_half_ulp_bf16_is_the_rounding_threshold():
    """An update strictly below the half ulp leaves the BF16 value unchanged; one of 1.5 half
    ulps changes it (checked by rounding, away from binade edges)."""
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(20000, generator=g) * torch.exp2(torch.randint(-20, 5, (20000,),
                                                                   generator=g).float()))
    p = p.to(torch.bfloat16).float()  # representable, so p itself rounds to p
    mant = p.abs() / torch.exp2(torch.floor(torch.log2(p.abs())))
    p = p[(mant > 1.05) & (mant < 1.95)]
    h = bc._half_ulp_bf16(p)
    assert torch.equal((p + 0.99 * h).to(torch.bfloat16).float(), p)
    assert torch.equal((p - 0.99 * h).to(torch.bfloat16).float(), p)
    assert not torch.any((p + 1.5 * h).to(torch.bfloat16).float() == p)
    # against the definition: ulp of x in [2^e, 2^(e+1)) is 2^(e-7)
    for x in (1.0, 1.5, 0.75, 3e-3, -40.0):
        e = math.floor(math.log2(abs(x)))
        assert float(bc._half_ulp_bf16(torch.tensor([x]))) == 2.0 ** (e - 8)


def test_underflow_stats_against_thresholds():
    g = torch.tensor([2.0 ** -30, -(2.0 ** -26), 2.0 ** -20, 2.0 ** -10, 1.0, 0.0, 2.0 ** -140,
                      3.0 * 2.0 ** -26])
    st, flat = bc.underflow_stats([g[:4], g[4:]], scale=2.0 ** 12)
    assert flat.numel() == 7 and st["elements"] == 7  # the exact zero is left out
    # FP16: values <= 2^-25 round to 0 (2^-25 itself ties to even 0); 3 * 2^-26 rounds up
    assert st["fp16_zero"] == pytest.approx(3 / 7)   # 2^-30, 2^-26, 2^-140
    assert st["fp16_subnormal"] == pytest.approx(2 / 7)  # 2^-20, 3*2^-26 -> 2^-24
    # x 2^12: 2^-18, 2^-14, 2^-8, 2^2, 2^12, 2^-128, 3*2^-14 -> only 2^-128 is 0
    assert st["fp16_scaled_zero"] == pytest.approx(1 / 7)
    assert st["fp16_scaled_subnormal"] == pytest.approx(1 / 7)  # 2^-18
    assert st["fp16_scaled_overflow"] == 0.0
    assert st["bf16_zero"] == pytest.approx(1 / 7)  # 2^-140 is below BF16's 2^-133
    st, _ = bc.underflow_stats([torch.tensor([1.0, 2.0 ** 10])], scale=2.0 ** 6)
    assert st["fp16_scaled_overflow"] == pytest.approx(1 / 2)


def test_lr_schedule():
    st = bc.Setting(preset="tiny", batch_size=2, steps=101, lr=1.0, warmup=10)
    assert st.lr_at(0) == pytest.approx(0.1) and st.lr_at(9) == pytest.approx(1.0)
    assert st.lr_at(10) == pytest.approx(1.0)
    assert st.lr_at(100) == pytest.approx(st.min_lr_frac)
    assert st.lr_at(55) == pytest.approx(st.min_lr_frac + (1 - st.min_lr_frac) * 0.5)
    assert st.lr_at(55, lr=0.5) == pytest.approx(0.5 * st.lr_at(55))


def test_every_mode_trains_from_the_same_start(threads):
    """Six short runs of the tiny model: same first-batch loss up to the mode's precision, the
    loss falls, the loss-scaled modes report their scale, mode 6 counts unchanged weights."""
    torch.set_num_threads(1)  # as the benchmark does on a CPU (conftest restores it)
    data, vocab = gpt.load_corpus(60_000)
    tr, va = gpt.split_corpus(data)
    st = bc.Setting(preset="tiny", batch_size=8, steps=30, lr=3e-3, warmup=3, eval_interval=10,
                    eval_batches=2, growth_interval=10)
    cfg = gpt.GPTConfig.preset("tiny", len(vocab))
    vg = torch.Generator().manual_seed(0)
    vb = [gpt.get_batch(va, 8, cfg.block_size, vg) for _ in range(2)]
    runs = {m: bc.train(m, st, cfg, tr, vb, torch.device("cpu"), fp32_gemm=True,
                        track_updates=m in ("fp32", "bf16_naive"), keep_grads=m == "fp32")
            for m in bc.MODE_KEYS}
    first = runs["fp32"].train_loss[0]
    for m, r in runs.items():
        assert len(r.train_loss) == 30 and r.eval_steps == [10, 20, 30]
        assert r.train_loss[0] == pytest.approx(first, rel=2e-2), m
        assert r.eval_loss[-1] < r.eval_loss[0] - 0.1, m
    for m in ("amp_fp16", "mpext_fp16"):
        assert len(runs[m].scale) == 30 and runs[m].scale[0] == st.init_scale
        assert all(runs[m].scale[i + 1] < runs[m].scale[i] for i in runs[m].skipped
                   if i + 1 < 30)
    assert len(runs["bf16_naive"].unchanged) == 30
    assert all(0.0 <= f <= 1.0 for f in runs["bf16_naive"].unchanged)
    assert runs["fp32"].final_grads is not None
    assert [g.shape for g in runs["fp32"].final_grads] == [p.shape for p in
                                                          gpt.GPT(cfg).parameters()]
