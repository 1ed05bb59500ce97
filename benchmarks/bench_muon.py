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
bounds its elementwise time.

``--convergence``: HF GPT-2 (hub defaults) and HF Llama, tiny, on bench_activations' fixed
Markov corpus, 3 seeds: torch.optim.Muon + torch.optim.AdamW (FP32) vs mpext.optim.Muon in FP32
and in the lean formats vs AdamW alone; the final validation loss of each lean format against
the FP32 Muon runs' seed band (docs/muon.md, "Convergence")."""
import functools
import statistics

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


# --convergence modes: key -> (label, param dtype, mpext.optim.Muon kwargs or None (torch's
# optimizers), state bytes per Muon param (param + buffer))
CONV_MODES = {
    "torch": ("torch.optim.Muon + torch.optim.AdamW, FP32", F32, None, 8),
    "fp32": ("mpext Muon, FP32 params and state", F32, dict(), 8),
    "sr-q8": ("mpext Muon, BF16 params SR + 8-bit momentum (AdamW: 8-bit m, v)", BF16,
              dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8,
                   exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8), 2 + 1 + 4 / 256),
    "remainder-q8": ("mpext Muon, BF16 params + remainder + 8-bit momentum (AdamW: 8-bit m, v)",
                     BF16, dict(param_remainders=True, momentum_dtype=torch.int8,
                                exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8),
                     2 + 2 + 1 + 4 / 256),
    "adamw": ("torch.optim.AdamW alone, FP32", F32, None, 12),
}
# Keller Jordan's recipe (Muon lr 0.02 on hidden matrices, AdamW on the rest); AdamW alone at
# the AdamW part's lr (bench_activations' convergence lr)
MUON_LR, ADAMW_LR, WD = 0.02, 3e-3, 0.01


def _conv_optimizer(mode, model):
    from mpext.optim import muon_param_groups
    _, _, kw, _ = CONV_MODES[mode]
    if mode == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=WD)]
    groups = muon_param_groups(model, lr=MUON_LR, weight_decay=WD)
    groups[1].update(lr=ADAMW_LR, weight_decay=WD)
    if kw is None:
        return [torch.optim.Muon(groups[0]["params"], lr=MUON_LR, weight_decay=WD),
                torch.optim.AdamW(groups[1]["params"], lr=ADAMW_LR, weight_decay=WD)]
    return [Muon(groups, seed=0, **kw)]


def convergence(names=("hf-gpt2", "hf-llama"), modes=tuple(CONV_MODES), steps=300,
                seeds=(0, 1, 2), batch=16, seq=64, progress=None):
    """Validation loss after ``steps`` steps per (model, mode, seed), evaluated on an FP32
    copy of the model (the params' own values: a BF16 param as it is). The seed fixes the
    initial weights, the batch order and the dropout; every mode sees the same ones."""
    from .bench_activations import hf_tiny, markov_corpus
    ids, floor = markov_corpus()
    train, val = ids[: len(ids) * 7 // 8], ids[len(ids) * 7 // 8:]

    def batch_of(src, gen, b):
        i = torch.randint(0, len(src) - seq - 1, (b,), generator=gen)
        return torch.stack([src[j:j + seq] for j in i.tolist()])

    vgen = torch.Generator().manual_seed(123)
    vbatches = [batch_of(val, vgen, 32) for _ in range(4)]
    out = {}
    for name in names:
        for mode in modes:
            for seed in seeds:
                torch.manual_seed(seed)
                model = hf_tiny(name, 64, seq).to(CONV_MODES[mode][1]).train()
                opts = _conv_optimizer(mode, model)
                gen = torch.Generator().manual_seed(seed)
                for _ in range(steps):
                    x = batch_of(train, gen, batch)
                    model(x, labels=x).loss.backward()
                    for o in opts:
                        o.step()
                        o.zero_grad()
                evalm = hf_tiny(name, 64, seq)
                evalm.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
                evalm.eval()
                with torch.no_grad():
                    out[name, mode, seed] = statistics.mean(
                        evalm(x, labels=x).loss.item() for x in vbatches)
                if progress:
                    progress("%s %s seed %d: %.4f" % (name, mode, seed, out[name, mode, seed]))
    return out, floor


def convergence_table(res, floor):
    names = list(dict.fromkeys(k[0] for k in res))
    modes = list(dict.fromkeys(k[1] for k in res))
    seeds = sorted({k[2] for k in res})
    rows = []
    for n in names:
        base = [res[n, "fp32", s] for s in seeds] if (n, "fp32", seeds[0]) in res else None
        lo, hi = (min(base), max(base)) if base else (None, None)
        for m in modes:
            ys = [res[n, m, s] for s in seeds]
            mean = statistics.mean(ys)
            inside = "-" if base is None or m == "fp32" else (
                "yes" if lo <= mean <= hi else "no (%+.5f)" % (mean - (hi if mean > hi else lo)))
            rows.append([n, CONV_MODES[m][0], "%.3f" % CONV_MODES[m][3]] +
                        ["%.4f" % y for y in ys] + ["%.4f" % mean, inside])
    band = ", ".join("%s %.4f-%.4f" % (n, min(res[n, "fp32", s] for s in seeds),
                                       max(res[n, "fp32", s] for s in seeds))
                     for n in names if (n, "fp32", seeds[0]) in res)
    return markdown_table(["model", "optimizer", "B/param (Muon params)"] +
                          ["seed %d" % s for s in seeds] + ["mean", "mean inside FP32 Muon band"],
                          rows) + ("\n\nFP32 Muon band (min-max over seeds): %s. The chain's "
                                   "entropy (the best loss there is): %.4f nats/token."
                                   % (band, floor))


def add_args(p):
    p.add_argument("--convergence", action="store_true", help="only: HF GPT-2 and Llama on a "
                   "Markov corpus, Muon FP32 vs lean formats vs AdamW, 3 seeds")
    p.add_argument("--convergence-steps", type=int, default=300)
    p.add_argument("--convergence-models", default="hf-gpt2,hf-llama")
    p.add_argument("--convergence-modes", default=",".join(CONV_MODES))
    p.add_argument("--convergence-seeds", type=int, default=3)
    return p


def run(ctx) -> dict:
    dev = ctx.device
    a = ctx.args
    if getattr(a, "convergence", False):
        b = Bench(ctx, NAME + "_convergence", "Convergence: Muon FP32 vs lean formats vs AdamW")
        res, floor = convergence(a.convergence_models.split(","),
                                 a.convergence_modes.split(","), a.convergence_steps,
                                 tuple(range(a.convergence_seeds)),
                                 progress=functools.partial(print, flush=True))
        return b.finish(["%d steps, batch 16 x 64 tokens, %d thread(s), CPU." % (
            a.convergence_steps, torch.get_num_threads()), "", convergence_table(res, floor)],
            {"convergence": {"%s/%s/%d" % k: v for k, v in res.items()}, "floor": floor})
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
    run_standalone(run, __doc__, add_args)
