"""Muon step: mpext.optim.Muon (each format) vs torch.optim.Muon, same run (benchmarks/README.md).

The hidden 2-D weights of GPT-2 small's layers (c_attn 768x2304, c_proj 768x768, c_fc
768x3072, mlp c_proj 3072x768; 2 layers with --quick, 4 otherwise). Rows: the whole step of
torch.optim.Muon (FP32 params) and of mpext.optim.Muon in each format; then the phases timed
apart: the elementwise phases (mpext's muon_momentum_step_ and muon_update_step_ against the ops
torch.optim.Muon runs for them: lerp_, lerp, bfloat16(); mul_, add_), and Newton-Schulz per
matrix (torch's function, the path mpext takes by default) against batched over same-shaped
matrices (ns_batched=True). The bytes bound of each format: the bytes one step of its
elementwise phases moves per param (reads and writes of params, gradients, state, the
update), from which the roofline (the in-place streaming bandwidth measured in the same run)
bounds its elementwise time."""
import torch

import mpext  # loads the extension: registers torch.ops.mpext
from mpext import ops
from mpext.optim import Muon
from mpext.optim.muon import newton_schulz
from .common import Bench, fmt_count, fmt_ms, markdown_table, require_kernel, run_standalone

NAME = "bench_muon"
TITLE = "Muon step: mpext.optim.Muon's formats vs torch.optim.Muon"
F32, BF16 = torch.float32, torch.bfloat16
HIDDEN = 768
COEFFS, NS_STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7

# format -> (label, param dtype, kwargs, elementwise bytes per param: phase 1 reads the
# gradient (4), reads and writes the buffer, writes the BF16 update (2); phase 3 reads the
# update (4: widened to fp32 for an fp32/fp16 param; 2 for bf16) and reads and writes the
# param's storage), state bytes per param
FORMATS = {
    "fp32": ("FP32 params, FP32 buffer", F32, dict(), 4 + 8 + 2 + 4 + 8, 4),
    "master-bf16": ("BF16 params + FP32 master, BF16 buffer", BF16, dict(momentum_dtype=BF16),
                    4 + 4 + 2 + 2 + 12, 6),
    "remainder-q8": ("BF16 params + remainder, 8-bit buffer", BF16,
                     dict(param_remainders=True, momentum_dtype=torch.int8), 4 + 2 + 2 + 2 + 8,
                     3 + 4 / 256),
    "sr-q8": ("BF16 params, SR, 8-bit buffer", BF16,
              dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8),
              4 + 2 + 2 + 2 + 4, 1 + 4 / 256),
}


def _shapes(layers):
    per = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)]
    return per * layers


def _params(shapes, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.02).to(dev, dtype))
            for s in shapes]


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in params:
        p.grad_dtype = None  # an fp32 gradient for a bf16 param (mpext takes it)
        out.append((torch.randn(*p.shape, generator=g) * 1e-3).to(p.device))
    return out


def _stepper(opt, params, grads):
    def step():
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return step


def run(ctx) -> dict:
    dev = ctx.device
    require_kernel(dev, "muon_update_step_")
    b = Bench(ctx, NAME, TITLE)
    roof = b.start_roofline()
    shapes = _shapes(2 if ctx.quick else 4)
    n = sum(a * c for a, c in shapes)
    fns = {}
    ref_params = _params(shapes, F32, dev)
    fns["torch"] = _stepper(torch.optim.Muon(ref_params, lr=0.02), ref_params,
                            _grads(ref_params))
    for key, (_, dt, kw, _, _) in FORMATS.items():
        ps = _params(shapes, dt, dev)
        fns[key] = _stepper(Muon(ps, lr=0.02, **kw), ps, _grads(ps))
    b.phase("setup")
    whole = ctx.time_fns(fns, desc="whole steps")
    b.phase("whole steps")

    # The phases apart, on FP32 params and buffers.
    ps = [p.detach().clone() for p in ref_params]
    gs = _grads(ref_params, seed=2)
    bufs = [torch.zeros_like(p) for p in ps]
    ups = [torch.empty_like(p, dtype=BF16) for p in ps]
    steps = [torch.zeros((), device=dev) for _ in ps]
    lr = torch.tensor(0.02, device=dev)
    ortho = [newton_schulz(u.normal_(), COEFFS, NS_STEPS, EPS).float().contiguous() for u in ups]

    def torch_phase1():
        for g, buf in zip(gs, bufs):
            buf.lerp_(g, 1 - 0.95)
            g.lerp(buf, 0.95).bfloat16()

    def torch_phase3():
        for p, o in zip(ps, ortho):
            p.mul_(1 - 0.02 * 0.1)
            p.add_(o, alpha=-0.02)

    by_shape = {}
    for u in ups:
        by_shape.setdefault(tuple(u.shape), []).append(u)
    phases = ctx.time_fns({
        "torch_phase1": torch_phase1,
        "mpext_phase1": lambda: ops.muon_momentum_step_(ups, gs, bufs, steps, 0.95, True),
        "torch_phase3": torch_phase3,
        "mpext_phase3": lambda: ops.muon_update_step_(ps, ortho, [], steps, lr, 1.0, 0.1),
        "ns_per_matrix": lambda: [newton_schulz(u, COEFFS, NS_STEPS, EPS) for u in ups],
        "ns_batched": lambda: [newton_schulz(torch.stack(us), COEFFS, NS_STEPS, EPS)
                               for us in by_shape.values()],
    }, desc="phases")
    b.phase("phases")
    roof = b.end_roofline()
    inplace = roof["inplace_gbps"]

    rows = [["torch.optim.Muon, FP32 params", "8", "-", fmt_ms(whole["torch"]), "1.00x", "-"]]
    modes = {}
    for key, (label, dt, _, step_bytes, state) in FORMATS.items():
        t = whole[key]
        modes[key] = {"label": label, "state_bytes_per_param": state,
                      "elementwise_bytes_per_param": step_bytes, "timing": t.to_json(),
                      "speedup_vs_torch": whole["torch"].median / t.median,
                      "elementwise_bound_s": step_bytes * n / (inplace * 1e9)}
        rows.append(["mpext.optim.Muon, " + label, "%.3f" % (state + (2 if dt == BF16 else 4)),
                     str(step_bytes), fmt_ms(t), "%.2fx" % modes[key]["speedup_vs_torch"],
                     "%.3g" % (modes[key]["elementwise_bound_s"] * 1e3)])
    prow = []
    pairs = (("phase 1 (momentum, update to BF16)", "torch_phase1", "mpext_phase1", 4 + 8 + 2),
             ("phase 3 (decay, update)", "torch_phase3", "mpext_phase3", 4 + 8))
    for label, tk, mk, nbytes in pairs:
        prow.append([label, fmt_ms(phases[tk]), fmt_ms(phases[mk]),
                     "%.2fx" % (phases[tk].median / phases[mk].median),
                     "%.0f%%" % (100 * phases[mk].gbps(nbytes * n) / inplace)])
    prow.append(["Newton-Schulz (%d matrices)" % len(ups), fmt_ms(phases["ns_per_matrix"]),
                 fmt_ms(phases["ns_batched"]) + " (batched)",
                 "%.2fx" % (phases["ns_per_matrix"].median / phases["ns_batched"].median), "-"])
    md = ["%s params in %d hidden matrices of GPT-2 small's layers (lr 0.02, momentum 0.95, "
          "Nesterov), %s." % (fmt_count(n), len(shapes), dev), "",
          markdown_table(["step", "param+state B/param", "elementwise B/param moved",
                          "median ms", "vs torch", "elementwise bound ms"], rows), "",
          markdown_table(["phase (FP32 params and buffer)", "torch ops ms", "mpext ms",
                          "torch / mpext", "mpext of in-place roofline"], prow), "",
          "The whole step is dominated by Newton-Schulz, which both run through torch's BF16 "
          "GEMMs: the elementwise phases are where the formats differ."]
    payload = {"params": n, "shapes": shapes, "modes": modes,
               "phases": {k: v.to_json() for k, v in phases.items()},
               "whole": {k: v.to_json() for k, v in whole.items()}}
    return b.finish(md, payload)


if __name__ == "__main__":
    run_standalone(run, __doc__)
