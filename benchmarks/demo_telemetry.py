"""Precision telemetry on HF GPT-2 (issue 46; docs/telemetry.md shows its output).

HF ``GPT2LMHeadModel`` with the hub's defaults at small sizes (2 layers, width 128, 4 heads,
vocabulary 256, sequence 64: tests/zoo.py's "hf-gpt2"), FP16 params with FP32 masters under
``mpext.optim.AdamW`` and ``mpext.GradScaler``, on the CPU:

1. FP16 with a too-small static loss scale (1, growth disabled) vs 2^12: the telemetry's
   underflow and zero counts, and the same counts from a float64 reference on the run's own
   scaled gradients (captured after backward), which must match exactly;
2. an injected overflow: an inf written into one parameter's gradient at step 2 (a hook): the
   step is skipped and the read names the parameter;
3. the optimizer-step half: BF16 params at a small learning rate (1e-4) under
   ``mpext.optim.AdamW`` with an FP32 master (AMP's storage), without one rounding to nearest,
   without one rounding stochastically, and with a remainder and 8-bit moments: the loss each
   run gains over ``--bf16-steps`` steps on the same batches, beside the step telemetry (every
   step counted): the updates lost to rounding, those carried only in expectation, the bf16
   params left unchanged by their master's move, the 8-bit moments' error.

    python -m benchmarks.demo_telemetry [--steps 4] [--bf16-steps 30] [--out results/demo_telemetry]
"""
import argparse
import json
from pathlib import Path

import torch

import mpext


def gpt2(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).to(torch.float16)


def reference(grads, dtype=torch.float16):
    """[zeros, subnormal] of scaled gradients, in float64 (mpext/telemetry.h's definitions)."""
    tiny = torch.finfo(dtype).tiny
    z = s = n = 0
    for g in grads:
        v = g.double().abs().reshape(-1)
        fin = torch.isfinite(v)
        z += int(((v == 0) & fin).sum())
        s += int(((v > 0) & (v < tiny)).sum())
        n += v.numel()
    return z, s, n


def run(scale, steps, inject_at=None, inject_param="transformer.h.1.mlp.c_fc.weight"):
    model = gpt2()
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = mpext.GradScaler("cpu", init_scale=scale, growth_interval=10 ** 9)  # static
    tel = mpext.telemetry.attach(scaler, model=model, every=steps)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (steps, 2, 64), generator=g)
    ref = [0, 0, 0]
    step = [0]
    target = dict(model.named_parameters())[inject_param]
    hook = target.register_hook(lambda gr: gr.index_fill(0, torch.tensor([3]), float("inf"))
                                if step[0] == inject_at else gr)
    for s in range(steps):
        step[0] = s
        loss = model(ids[s], labels=ids[s]).loss
        scaler.scale(loss.float()).backward()
        z, sub, n = reference([p.grad for p in model.parameters() if p.grad is not None])
        ref = [ref[0] + z, ref[1] + sub, ref[2] + n]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    hook.remove()
    r = tel.poll()
    return r, ref


BF16_RUNS = [
    ("bf16 + fp32 master (AMP's storage)", {}),
    ("bf16, no master, round to nearest", dict(master_weights=False)),
    ("bf16, no master, stochastic rounding", dict(master_weights=False,
                                                  stochastic_rounding=True)),
    ("bf16 + remainder, 8-bit moments", dict(param_remainders=True, exp_avg_dtype=torch.int8,
                                             exp_avg_sq_dtype=torch.uint8)),
]


def run_bf16(kw, steps, lr=1e-4):
    """One BF16 run: (loss gained over the steps on the same batches, the step telemetry)."""
    import warnings
    model = gpt2().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # round to nearest without masters warns: measured here
        opt = mpext.optim.AdamW(model.parameters(), lr=lr, **kw)
    tel = mpext.telemetry.attach(None, model=model, optimizer=opt, every=steps, step_every=1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (4, 4, 64), generator=g)  # 4 batches, cycled

    def loss_of(b):
        with torch.no_grad():
            return sum(float(model(ids[k], labels=ids[k]).loss) for k in range(4)) / 4

    first = loss_of(0)
    for s in range(steps):
        model(ids[s % 4], labels=ids[s % 4]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    r = tel.poll()
    return first - loss_of(0), r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bf16-steps", type=int, default=30)
    p.add_argument("--out", default="results/demo_telemetry")
    args = p.parse_args(argv)
    rows, out = [], {}
    for scale in (1.0, 2.0 ** 12):
        r, ref = run(scale, args.steps)
        assert r["grad/underflow_count"] == ref[1] and r["grad/elements"] == ref[2], (r, ref)
        assert round(r["grad/zeros_frac"] * ref[2]) == ref[0]
        out["scale_%g" % scale] = r
        rows.append("| %g | %.3f%% | %d | %d | %.3f%% | %.3g | %d |"
                    % (scale, 100 * r["grad/underflow_frac"], r["grad/underflow_count"], ref[1],
                       100 * r["grad/zeros_frac"], r["grad/max_abs"], r["scale/skips"]))
    r, _ = run(2.0 ** 12, args.steps, inject_at=2)
    out["injected_overflow"] = r
    lines = ["FP16 GPT-2 (HF, 2 layers, width 128), %d steps, static loss scale:" % args.steps, "",
             "| loss scale | underflow (subnormal) | count | float64 reference | zeros | max abs "
             "grad | skipped |", "|---|---|---|---|---|---|---|"] + rows + [
             "", "Injected inf in transformer.h.1.mlp.c_fc.weight's gradient at step 2 "
             "(scale 4096): scale/skips = %d, overflow/site = `%s`, overflow/params = %d."
             % (r["scale/skips"], r["overflow/site"], r["overflow/params"])]
    gains = []
    lines += ["", "BF16 GPT-2 (same model), AdamW lr 1e-4, %d steps over 4 fixed batches, the step "
              "telemetry counting every step:" % args.bf16_steps, "",
              "| storage | loss gained | vs master | updates lost (RNE) | carried in expectation "
              "only (SR) | bf16 param unchanged under a moving master | 8-bit m / v rel. error "
              "| 8-bit saturated blocks |", "|---|---|---|---|---|---|---|---|"]
    for label, kw in BF16_RUNS:
        gain, r = run_bf16(kw, args.bf16_steps)
        gains.append(gain)
        out["bf16/" + label] = dict(r, loss_gained=gain)

        def pct(key):
            return "%.1f%%" % (100 * r[key]) if key in r else "-"
        q8 = ("%.2f%% / %.2f%%" % (100 * r["state/q8_rel_error"], 100 * r["state/q8_sq_rel_error"])
              if "state/q8_rel_error" in r else "-")
        lines.append("| %s | %.4f | %.1f%% | %s | %s | %s | %s | %s |"
                     % (label, gain, 100 * gain / gains[0], pct("update/lost_frac"),
                        pct("update/sr_expectation_frac"),
                        pct("update/unchanged_under_master_frac"), q8,
                        pct("state/q8_saturated_frac")))
    print("\n".join(lines))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "demo_telemetry.json").write_text(json.dumps(out, indent=1))
    (Path(args.out) / "demo_telemetry.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
