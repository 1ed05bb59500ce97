"""Which 8-bit code for Adam's moments? The measurement behind docs/moments_8bit.md.

Candidate codes for the first moment m (signed, 8 bits) and the second moment v (unsigned, 8
bits), each relative to one scale per block of B elements:

- ``e4m3`` / ``e3m4`` / ``e5m2`` (m) and ``e5m3`` / ``e4m4`` / ``e6m2`` (v): arithmetic 8-bit
  floats (sign bit for m) whose top binade is the binade of the block's absmax (mpext's kind:
  no table, a power-of-two reference, so a decode is exact);
- ``sqrt-e4m4`` (v): the same code on sqrt(v), squared back;
- ``dynamic``: bitsandbytes' dynamic tree map (signed for m, unsigned for v), scaled by the
  absmax, as bitsandbytes and torchao store 8-bit Adam states;
- ``quantile``: a table of the 256 (or 128 per sign) quantiles of the normalized moments of the
  FP32 run itself -- a map fitted to this very data, the best a fixed table can do here;
- ``linear``: absmax / 127 (m) or / 255 (v) steps.

Each code is applied with stochastic rounding (``sr``) and to nearest (``rn``). Two
measurements on benchmarks/gpt.py's character model:

1. static: the FP32 AdamW run's moments at a few steps quantized and dequantized blockwise;
   the relative RMS error of m, of v and of the Adam update m / (sqrt(v) + eps), and the
   share of elements whose v decodes to 0 while m does not;
2. dynamic: AdamW whose state is stored in the code after every step (the same batches, the
   same initial weights), its final validation loss against FP32's.

    python -m benchmarks.measure_q8_codes [--steps 300] [--block 256] [--preset q8] [--no-dynamic]

Pure torch (fp32 arithmetic, float64 tables); it does not use mpext's kernels.

``--convergence`` trains instead with the real optimizers, same weights, batches and schedule,
over ``--seeds`` seeds: torch.optim.AdamW on FP32 params (the reference and its seed-to-seed
band), mpext.optim.AdamW on BF16 params with an FP32 master and FP32 moments, with a remainder
and 8-bit moments, without a master (stochastic rounding) and 8-bit moments, and torchao's
AdamW8bit on FP32 params when torchao is importable (run this script with a Python that has it).
"""
import argparse
import json
import math
import time
from pathlib import Path


import torch

from .gpt import GPT, GPTConfig, get_batch, load_corpus, split_corpus

MIN_NUMEL = 4096  # smaller tensors keep fp32 moments (as mpext, torchao and bitsandbytes)


# ---- code tables: sorted normalized values ----

def float_table(ebits: int, mbits: int, signed: bool) -> torch.Tensor:
    """Every value of an 8-bit float code whose top binade is [1, 2): subnormals k 2^(1-T-M),
    normals 2^(e-T) (1 + f / 2^M), T = 2^ebits - 1; with a sign bit when signed."""
    t = (1 << ebits) - 1
    vals = [k * 2.0 ** (1 - t - mbits) for k in range(1 << mbits)]
    vals += [2.0 ** (e - t) * (1 + f / 2 ** mbits) for e in range(1, t + 1)
             for f in range(1 << mbits)]
    mag = torch.tensor(sorted(set(vals)), dtype=torch.float64)
    return torch.cat([-mag.flip(0)[:-1], mag]) if signed else mag


def dynamic_table(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic tree map (8 bits, 7 exponent bits), values in [-1, 1]."""
    data, non_sign_bits, max_e = [], 7, 7
    for i in range(max_e):
        items = 2 ** (i + non_sign_bits - max_e) + 1 if signed else \
            2 ** (i + non_sign_bits - max_e + 1) + 1
        b = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = ((b[:-1] + b[1:]) / 2).tolist()
        data += [10 ** (-(max_e - 1) + i) * x for x in means]
        if signed:
            data += [-(10 ** (-(max_e - 1) + i)) * x for x in means]
    data += [0.0, 1.0]
    return torch.tensor(sorted(set(data)), dtype=torch.float64)


def linear_table(signed: bool) -> torch.Tensor:
    return torch.arange(-127 if signed else 0, 128 if signed else 256,
                        dtype=torch.float64) / (127 if signed else 255)


class Code:
    """A blockwise code: ``table`` of normalized values, and how a block's reference comes from
    its absmax: ``pow2`` (the binade of the absmax rounded up to the code's precision, so that
    no value exceeds the top code) or ``absmax`` (the table spans [-1, 1])."""

    def __init__(self, name, table, ref, sqrt_domain=False, mbits=0):
        self.name, self.table, self.ref = name, table, ref
        self.sqrt, self.mbits = sqrt_domain, mbits

    def reference(self, amax: torch.Tensor) -> torch.Tensor:
        if self.ref == "absmax":
            return torch.where(amax > 0, amax, torch.ones_like(amax))
        a = torch.where(amax > 0, amax, torch.full_like(amax, 2.0 ** -100))
        e = torch.floor(torch.log2(a))
        top = 2.0 - 2.0 ** -self.mbits
        return torch.exp2(torch.where(a / torch.exp2(e) > top, e + 1, e))

    def roundtrip(self, x: torch.Tensor, block: int, stochastic: bool,
                  gen: torch.Generator) -> torch.Tensor:
        """x quantized blockwise and decoded again (fp64 arithmetic, returned as x's dtype)."""
        flat = x.detach().double().reshape(-1)
        if self.sqrt:
            flat = flat.clamp_min(0).sqrt()
        n = flat.numel()
        pad = (-n) % block
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
        ref = self.reference(blocks.abs().amax(1, keepdim=True))
        y = (blocks / ref).clamp(self.table[0], self.table[-1])
        hi_i = torch.searchsorted(self.table, y).clamp(1, len(self.table) - 1)
        lo, hi = self.table[hi_i - 1], self.table[hi_i]
        frac = ((y - lo) / (hi - lo)).clamp(0, 1)
        if stochastic:
            up = torch.rand(frac.shape, generator=gen, dtype=torch.float64) < frac
        else:
            up = frac > 0.5
        q = torch.where(up, hi, lo) * ref
        q = q.reshape(-1)[:n]
        if self.sqrt:
            q = q * q
        return q.view(x.shape).to(x.dtype)


def quantile_table(samples: torch.Tensor, signed: bool) -> torch.Tensor:
    """The quantiles of normalized values (|x| / block absmax, signs kept when signed): 256
    levels in all, 0 and the extremes included."""
    levels = 128 if signed else 256
    mag = samples.abs() if signed else samples
    qs = torch.quantile(mag[torch.randperm(mag.numel())[:1 << 20]].double(),
                        torch.linspace(0, 1, levels, dtype=torch.float64))
    qs[0], qs[-1] = 0.0, 1.0
    qs = torch.unique(qs)
    return torch.cat([-qs.flip(0)[:-1], qs]) if signed else qs


def codes_for(m_samples, v_samples):
    m = {
        "e4m3": Code("e4m3", float_table(4, 3, True), "pow2", mbits=3),
        "e3m4": Code("e3m4", float_table(3, 4, True), "pow2", mbits=4),
        "e5m2": Code("e5m2", float_table(5, 2, True), "pow2", mbits=2),
        "dynamic": Code("dynamic", dynamic_table(True), "absmax"),
        "quantile": Code("quantile", quantile_table(m_samples, True), "absmax"),
        "linear": Code("linear", linear_table(True), "absmax"),
    }
    v = {
        "e5m3": Code("e5m3", float_table(5, 3, False), "pow2", mbits=3),
        "e4m4": Code("e4m4", float_table(4, 4, False), "pow2", mbits=4),
        "e6m2": Code("e6m2", float_table(6, 2, False), "pow2", mbits=2),
        "sqrt-e4m4": Code("sqrt-e4m4", float_table(4, 4, False), "pow2", sqrt_domain=True,
                          mbits=4),
        "dynamic": Code("dynamic", dynamic_table(False), "absmax"),
        "quantile": Code("quantile", quantile_table(v_samples, False), "absmax"),
        "linear": Code("linear", linear_table(False), "absmax"),
    }
    return m, v


# ---- training ----

def guard_factor(b1: float, b2: float) -> float:
    """1/K with K the bound of m^2 / v for exponential averages of the same gradients
    (Cauchy-Schwarz): K = (1-b1)^2 / ((1-b2) (1 - b1^2/b2)); 0 (no bound) when b1^2 >= b2."""
    r = b1 * b1 / b2
    return 0.0 if r >= 1 else (1 - b2) * (1 - r) / (1 - b1) ** 2


def adamw_step(params, states, t, lr, b1, b2, eps, wd, mcode, vcode, block, stochastic, gen,
               guard):
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    inv_k = guard_factor(b1, b2) if guard else 0.0
    for p, st in zip(params, states):
        g = p.grad
        quant = mcode is not None and p.numel() >= MIN_NUMEL
        m, v = st["m"], st["v"]
        if quant and inv_k > 0:
            v = torch.maximum(v, m * m * inv_k)
        p.mul_(1 - lr * wd)
        m = m.lerp(g, 1 - b1)
        v = v * b2 + (1 - b2) * g * g
        p.add_(-(lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps))
        if quant:
            m = mcode.roundtrip(m, block, stochastic, gen)
            v = vcode.roundtrip(v, block, stochastic, gen)
        st["m"], st["v"] = m, v


def train(args, data, mcode=None, vcode=None, stochastic=True, guard=True, snapshots=None,
          seed=0):
    torch.manual_seed(args.seed + seed)
    cfg = GPTConfig.preset(args.preset, data["vocab"]) if args.preset in ("tiny", "small") \
        else GPTConfig(vocab_size=data["vocab"], block_size=64, n_layer=3, n_head=4, n_embd=128)
    model = GPT(cfg)
    params = [p for p in model.parameters()]
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in params]
    gen = torch.Generator().manual_seed(99 + seed)
    bgen = torch.Generator().manual_seed(4321 + seed)
    b1, b2, eps, wd = 0.9, 0.99, 1e-8, 0.01
    evals = []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * step / args.steps)))
        x, y = get_batch(data["train"], 16, cfg.block_size, bgen)
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            adamw_step(params, states, step + 1, lr, b1, b2, eps, wd, mcode, vcode, args.block,
                       stochastic, gen, guard)
        if snapshots is not None and step + 1 in args.snapshot_steps:
            snapshots.append([(st["m"].clone(), st["v"].clone()) for p, st in zip(params, states)
                              if p.numel() >= MIN_NUMEL])
        if step + 1 >= args.steps - 40 and (step + 1) % 10 == 0:
            evals.append(evaluate(model, data, cfg))
    return sum(evals) / len(evals)


CONVERGENCE = [
    ("torch-fp32", "torch.optim.AdamW, FP32 params (reference)"),
    ("mpext-master", "mpext AdamW, BF16 params, FP32 master + FP32 moments"),
    ("mpext-remainder-8bit", "mpext AdamW, BF16 params, remainder + 8-bit moments"),
    ("mpext-sr-8bit", "mpext AdamW, BF16 params, no master (SR) + 8-bit moments"),
    ("torchao-8bit", "torchao.optim.AdamW8bit, FP32 params"),
]


def train_real(args, data, mode, seed):
    """Final validation loss of one mode (CONVERGENCE) and seed; None if it cannot run here."""
    import mpext

    torch.manual_seed(args.seed + seed)
    cfg = GPTConfig.preset(args.preset, data["vocab"]) if args.preset in ("tiny", "small") \
        else GPTConfig(vocab_size=data["vocab"], block_size=64, n_layer=3, n_head=4, n_embd=128)
    low = mode.startswith("mpext")
    model = GPT(cfg, fp32_gemm=low)
    if low:
        model = model.to(torch.bfloat16)
    kw = dict(lr=args.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    q8 = dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8, seed=seed)
    if mode == "torch-fp32":
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif mode == "mpext-master":
        opt = mpext.optim.AdamW(model.parameters(), **kw)
    elif mode == "mpext-remainder-8bit":
        opt = mpext.optim.AdamW(model.parameters(), param_remainders=True, **q8, **kw)
    elif mode == "mpext-sr-8bit":
        opt = mpext.optim.AdamW(model.parameters(), master_weights=False,
                                stochastic_rounding=True, **q8, **kw)
    else:
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            return None
        opt = AdamW8bit(model.parameters(), block_size=256, **kw)
    bgen = torch.Generator().manual_seed(4321 + seed)
    evals = []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        x, y = get_batch(data["train"], 16, cfg.block_size, bgen)
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step + 1 >= args.steps - 40 and (step + 1) % 10 == 0:
            evals.append(evaluate(model, data, cfg))
    return sum(evals) / len(evals)


def convergence(args, data):
    out = {}
    for mode, label in CONVERGENCE:
        t0 = time.time()
        losses = [train_real(args, data, mode, s) for s in range(args.seeds)]
        if losses[0] is None:
            print("  %-22s not run: torchao is not importable here" % mode, flush=True)
            continue
        out[mode] = losses
        ref = out["torch-fp32"]
        print("  %-22s %s  mean %.4f (FP32 %.4f, band %.4f..%.4f; %.0f s)"
              % (mode, ["%.4f" % x for x in losses], sum(losses) / len(losses),
                 sum(ref) / len(ref), min(ref), max(ref), time.time() - t0), flush=True)
    return out


@torch.no_grad()
def evaluate(model, data, cfg):
    g = torch.Generator().manual_seed(7)
    losses = [model(*get_batch(data["val"], 32, cfg.block_size, g))[1].item() for _ in range(8)]
    return sum(losses) / len(losses)


def static_errors(snapshots, mcodes, vcodes, block, b1, b2, eps=1e-8):
    """Relative RMS errors of m, v and of the update, over every snapshot, per code."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for rounding in ("sr", "rn"):
        for name, code in mcodes.items():
            num = den = 0.0
            for snap in snapshots:
                for m, _ in snap:
                    q = code.roundtrip(m, block, rounding == "sr", gen)
                    num += float(((q.double() - m.double()) ** 2).sum())
                    den += float((m.double() ** 2).sum())
            out[("m", name, rounding)] = math.sqrt(num / den)
        for name, code in vcodes.items():
            num = den = 0.0
            zeros = total = 0
            for snap in snapshots:
                for m, v in snap:
                    q = code.roundtrip(v, block, rounding == "sr", gen)
                    num += float(((q.double() - v.double()) ** 2).sum())
                    den += float((v.double() ** 2).sum())
                    zeros += int(((q == 0) & (m != 0)).sum())
                    total += m.numel()
            out[("v", name, rounding)] = math.sqrt(num / den)
            out[("v0", name, rounding)] = zeros / total
    return out


def update_error(snapshots, mcode, vcode, block, stochastic, guard, b1, b2, eps=1e-8):
    gen = torch.Generator().manual_seed(6)
    inv_k = guard_factor(b1, b2) if guard else 0.0
    num = den = 0.0
    for snap in snapshots:
        for m, v in snap:
            u = m.double() / (v.double().sqrt() + eps)
            mq = mcode.roundtrip(m, block, stochastic, gen).double()
            vq = vcode.roundtrip(v, block, stochastic, gen).double()
            if inv_k > 0:
                vq = torch.maximum(vq, mq * mq * inv_k)
            uq = mq / (vq.sqrt() + eps)
            num += float(((uq - u) ** 2).sum())
            den += float((u ** 2).sum())
    return math.sqrt(num / den)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--preset", default="q8", help="tiny, small, or q8 (3 layers, 128 wide)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per dynamic run")
    ap.add_argument("--no-dynamic", action="store_true",
                    help="only the static measurement (the dynamic runs take ~10 min each)")
    ap.add_argument("--convergence", action="store_true",
                    help="train with the real optimizers instead (see the docstring)")
    ap.add_argument("--out", default="results/measure_q8_codes.json")
    args = ap.parse_args()
    args.snapshot_steps = {args.steps // 8, args.steps // 2, args.steps}
    torch.set_num_threads(1)
    corpus, vocab = load_corpus()
    train_d, val_d = split_corpus(corpus.long())
    data = {"train": train_d, "val": val_d, "vocab": len(vocab)}
    if args.convergence:
        print("convergence: final validation loss (mean of the last 4 evaluations), %d seeds, "
              "%d steps, preset %s" % (args.seeds, args.steps, args.preset), flush=True)
        res = convergence(args, data)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: (sorted(v) if isinstance(v, set) else v)
                                            for k, v in vars(args).items()},
                                   "convergence": res}, indent=1))
        print("written:", out)
        return
    t0 = time.time()
    snaps = []
    fp32 = [train(args, data, snapshots=snaps if s == 0 else None, seed=s)
            for s in range(1 if args.no_dynamic else args.seeds)]
    print("fp32 final val loss per seed: %s (%.0f s)" % (fp32, time.time() - t0), flush=True)
    msamp = torch.cat([(m.reshape(-1)[: (m.numel() // args.block) * args.block]
                        .view(-1, args.block) / m.reshape(-1)[: (m.numel() // args.block)
                                                              * args.block]
                        .view(-1, args.block).abs().amax(1, keepdim=True).clamp_min(1e-30))
                       .reshape(-1) for snap in snaps for m, _ in snap])
    vsamp = torch.cat([(v.reshape(-1)[: (v.numel() // args.block) * args.block]
                        .view(-1, args.block) / v.reshape(-1)[: (v.numel() // args.block)
                                                              * args.block]
                        .view(-1, args.block).amax(1, keepdim=True).clamp_min(1e-30))
                       .reshape(-1) for snap in snaps for _, v in snap])
    mcodes, vcodes = codes_for(msamp, vsamp)
    b1, b2 = 0.9, 0.99
    static = static_errors(snaps, mcodes, vcodes, args.block, b1, b2)
    print("\nstatic round trip, block %d, relative RMS error (sr / rn):" % args.block)
    for name in mcodes:
        print("  m %-10s %.4f / %.4f"
              % (name, static[("m", name, "sr")], static[("m", name, "rn")]))
    for name in vcodes:
        print("  v %-10s %.4f / %.4f   v->0 with m!=0: %.2e / %.2e"
              % (name, static[("v", name, "sr")], static[("v", name, "rn")],
                 static[("v0", name, "sr")], static[("v0", name, "rn")]))
    pairs = [("e4m3", "e5m3"), ("e3m4", "e5m3"), ("e4m3", "e4m4"), ("e3m4", "e4m4"),
             ("e5m2", "e6m2"),
             ("e4m3", "sqrt-e4m4"), ("dynamic", "dynamic"), ("quantile", "quantile"),
             ("linear", "linear")]
    print("\nupdate error (relative RMS of m/(sqrt(v)+eps)), sr, with / without the v guard:")
    upd = {}
    for mc, vc in pairs:
        for guard in (True, False):
            upd[(mc, vc, guard)] = update_error(snaps, mcodes[mc], vcodes[vc], args.block, True,
                                                guard, b1, b2)
        print("  %-9s + %-10s %.4f / %.4f" % (mc, vc, upd[(mc, vc, True)], upd[(mc, vc, False)]),
              flush=True)
    print("\nblock size (e3m4 + e4m4, sr): update error, and the scales' bytes per element")
    by_block = {}
    for block in (32, 64, 128, 256, 512, 1024, 2048):
        by_block[block] = update_error(snaps, mcodes["e3m4"], vcodes["e4m4"], block, True, True,
                                       b1, b2)
        print("  %5d  %.4f  %.4f B" % (block, by_block[block], 8.0 / block), flush=True)
    print("\ndynamic: final validation loss, %d seeds (fp32 %s)" % (args.seeds, fp32))
    dyn = {}
    runs = [(mc, vc, "sr", True) for mc, vc in
            [("e4m3", "e5m3"), ("e3m4", "e5m3"), ("e3m4", "e4m4"), ("dynamic", "dynamic"),
             ("linear", "linear")]] + \
        [("e3m4", "e4m4", "rn", True), ("e3m4", "e4m4", "sr", False),
         ("dynamic", "dynamic", "rn", False), ("linear", "linear", "sr", False)]
    for mc, vc, rounding, guard in [] if args.no_dynamic else runs:
        t1 = time.time()
        losses = [train(args, data, mcodes[mc], vcodes[vc], rounding == "sr", guard, seed=s)
                  for s in range(args.seeds)]
        dyn[(mc, vc, rounding, guard)] = losses
        print("  %-9s + %-10s %s guard=%d: %s  (mean - fp32 mean %+.4f; %.0f s)"
              % (mc, vc, rounding, guard, ["%.4f" % x for x in losses],
                 sum(losses) / len(losses) - sum(fp32) / len(fp32), time.time() - t1),
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "fp32": fp32,
        "static": {"|".join(k): v for k, v in static.items()},
        "update_error": {"%s|%s|guard=%d" % k: v for k, v in upd.items()},
        "update_error_by_block": by_block,
        "dynamic": {"%s|%s|%s|guard=%d" % k: v for k, v in dyn.items()},
    }, indent=1))
    print("\nwritten:", out)


if __name__ == "__main__":
    main()
