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


# ---------------------------------------------------------------------------------------------
# The lean study


def test_lean_verdicts_against_the_definition():
    """The band is the reference's mean +- its seed range; a mode's mean is inside when within
    it; cautionary modes must lie above it, exact modes equal seed for seed."""
    finals = {"master": [2.0, 2.1, 2.3], "remainder": [2.0, 2.1, 2.3],
              "sr": [2.3, 2.4, 2.5],                          # mean +0.267: inside
              "sr_bf16m": [2.44, 2.45, 2.46],                 # +0.317: outside
              "remainder_bf16m": [1.9, 1.9, 1.9],             # -0.233: inside
              "rtn": [2.6, 2.6, 2.6],                         # +0.4: above the band
              "bf16m_rtn": [2.1, 2.2, 2.3]}                   # inside: not shown worse
    v = bc.lean_verdicts(finals)
    assert v["center"] == pytest.approx(6.4 / 3) and v["half_width"] == pytest.approx(0.3)
    m = v["modes"]
    assert m["remainder"]["met"] and m["remainder"]["delta"] == 0.0
    assert m["sr"]["inside"] and m["sr"]["met"]
    assert not m["sr_bf16m"]["inside"] and not m["sr_bf16m"]["met"]
    assert m["remainder_bf16m"]["met"]
    assert m["rtn"]["met"] and not m["rtn"]["inside"]
    assert m["bf16m_rtn"]["inside"] and not m["bf16m_rtn"]["met"]
    # an "exact" mode that differs in one seed by one float32 ulp is not exact
    finals["remainder"] = [2.0, math.nextafter(2.1, 3.0), 2.3]
    assert not bc.lean_verdicts(finals)["modes"]["remainder"]["met"]


def test_bitwise_comparison_of_runs():
    """bits_differ counts elements whose bits differ (a one-ulp change, a NaN payload, -0.0 vs
    0.0), and check_same_training refuses a run that differs in any loss or final bit."""
    a = torch.tensor([1.0, -0.0, float("nan"), 3.0], dtype=torch.bfloat16)
    b = a.clone()
    assert bc.bits_differ([a], [b]) == 0
    b.view(torch.int16)[0] += 1          # one bf16 ulp
    b[1] = 0.0                           # -0.0 -> +0.0: equal as numbers, not as bits
    assert bc.bits_differ([a], [b]) == 2
    c = torch.tensor([float("nan")]).view(torch.int32) | 1  # another NaN payload
    assert bc.bits_differ([torch.tensor([float("nan")])], [c.view(torch.float32)]) == 1
    assert bc.bits_differ([a], [a.float()]) == 4  # dtype mismatch: every element

    def run(params, masters, losses):
        r = bc.Run("remainder", 1e-4, seed=0)
        r.train_loss, r.eval_loss = list(losses), list(losses)
        r.final_params, r.final_fp32 = params, masters
        return r

    m32 = [torch.randn(5)]
    ref = run([a], m32, [3.0, 2.5])
    bc.check_same_training(ref, run([a.clone()], [m32[0].clone()], [3.0, 2.5]))
    bumped = m32[0].clone()
    bumped.view(torch.int32)[2] += 1     # one fp32 ulp in one master
    for other in (run([b], m32, [3.0, 2.5]), run([a], [bumped], [3.0, 2.5]),
                  run([a], m32, [3.0, math.nextafter(2.5, 0.0)])):
        with pytest.raises(AssertionError):
            bc.check_same_training(ref, other)


def test_moment_decay_demo():
    """Gradient noise shrinking 10x: FP32 and stochastically rounded BF16 second moments track
    the float64 expectation of the EMA; rounded to nearest, v never decreases after the drop
    and ends several times too large."""
    d = bc.moment_decay_demo(torch.device("cpu"), steps=800, n=4096, drop_at=50, every=10)
    exp, fp32 = d["expected"], d["mean_v"]["fp32"]
    sr, rn = d["mean_v"]["bf16_sr"], d["mean_v"]["bf16_nearest"]
    # mean of 4096 EMAs of chi-square(1) draws: relative spread well under 2%
    for i in range(len(exp)):
        assert fp32[i] == pytest.approx(exp[i], rel=0.03), i
        assert sr[i] == pytest.approx(fp32[i], rel=0.03), i
    after = [v for s, v in zip(d["steps"], rn) if s > 60]
    assert all(b >= a for a, b in zip(after, after[1:]))
    assert rn[-1] > 1.5 * fp32[-1] and fp32[-1] < 0.8 * fp32[5]


def test_study_selection():
    """--study and --modes choose the studies and their modes; the references always run."""
    import argparse
    from types import SimpleNamespace

    parser = bc.add_args(argparse.ArgumentParser())

    def studies(*argv):
        return bc._studies(SimpleNamespace(args=parser.parse_args(list(argv))))

    assert studies() == (bc.MODE_KEYS, bc.LEAN_KEYS)
    assert studies("--study", "lean") == (None, bc.LEAN_KEYS)
    assert studies("--modes", "sr", "rtn") == (None, ["master", "sr", "rtn"])
    assert studies("--modes", "mpext_bf16") == (["fp32", "mpext_bf16"], None)
    assert studies("--study", "amp", "--modes", "sr") == (["fp32"], None)


def test_lean_study_quick(threads):
    """The benchmark's quick lean study, with its own checks and, independently here: the
    remainder runs equal the FP32-master runs bit for bit (params, masters, every loss); the
    stochastic-rounding modes' mean final loss lies inside the FP32-master runs' seed-to-seed
    band; master-free round to nearest lies above it and leaves more weights unchanged; BF16
    moments rounded to nearest never lower the second moment; every mode of a seed starts from
    the same evaluation of the checkpoint; the seed changes the stochastic rounding."""
    torch.set_num_threads(1)
    ls = bc.LEAN_SETTINGS["quick"]
    data, vocab = gpt.load_corpus()
    tr, va = gpt.split_corpus(data)
    cfg = gpt.GPTConfig.preset(ls.finetune.preset, len(vocab))
    vg = torch.Generator().manual_seed(1)
    vb = [gpt.get_batch(va, ls.finetune.batch_size, cfg.block_size, vg)
          for _ in range(ls.finetune.eval_batches)]
    res = bc.lean_study(ls, cfg, tr, vb, torch.device("cpu"), bc.LEAN_KEYS, fp32_gemm=True)
    runs = res["runs"]
    assert set(runs) == set(bc.LEAN_KEYS) and all(len(rs) == ls.seeds for rs in runs.values())
    assert res["deterministic"] and res["remainder_checked"]

    for ref, rem in zip(runs["master"], runs["remainder"]):
        assert rem.train_loss == ref.train_loss and rem.eval_loss == ref.eval_loss
        for a, b in zip(ref.final_params, rem.final_params):
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(ref.final_fp32, rem.final_fp32):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))

    k = ls.finetune.final_k
    ref = [sum(r.eval_loss[-k:]) / k for r in runs["master"]]
    center, half = sum(ref) / len(ref), max(ref) - min(ref)
    assert half > 0

    def mean_final(key):
        xs = [sum(r.eval_loss[-k:]) / k for r in runs[key]]
        return sum(xs) / len(xs)

    for key in ("remainder_bf16m", "sr_bf16m", "sr"):
        assert abs(mean_final(key) - center) <= half, key
        assert res["verdict"]["modes"][key]["met"], key
    assert mean_final("rtn") > center + half
    assert res["verdict"]["modes"]["rtn"]["met"]

    def tail(r, attr):
        xs = getattr(r, attr)[len(getattr(r, attr)) // 2:]
        return sum(xs) / len(xs)

    for m, n in zip(runs["master"], runs["rtn"]):
        assert tail(n, "unchanged") > tail(m, "unchanged")
    assert all(f == 0.0 for r in runs["bf16m_rtn"] for f in r.v_decreased)
    assert all(max(r.v_decreased) > 0 for r in runs["remainder_bf16m"] + runs["master"])

    for s in range(ls.seeds):
        starts = {runs[key][s].eval_loss[0] for key in bc.LEAN_KEYS}
        assert len(starts) == 1 and runs["master"][s].eval_steps[0] == 0
    assert runs["sr"][0].train_loss != runs["sr"][1].train_loss
