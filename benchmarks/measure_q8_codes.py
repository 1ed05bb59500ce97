"""Which 8-bit code for Adam's moments (docs/moments_8bit.md; commands: benchmarks/README.md)."""
import argparse
import math
import time

import torch

from .common import write_json
from .gpt import GPTConfig, load_corpus, split_corpus

MIN_NUMEL = 4096  # smaller tensors keep fp32 moments (as mpext, torchao and bitsandbytes)
B1, B2, EPS, WD = 0.9, 0.99, 1e-8, 0.01


# ---- code tables: sorted normalized values

def float_table(ebits: int, mbits: int, signed: bool) -> torch.Tensor:
    """Every value of an 8-bit float code whose top binade is [1, 2), signed or not."""
    t = (1 << ebits) - 1
    vals = [k * 2.0 ** (1 - t - mbits) for k in range(1 << mbits)]
    vals += [2.0 ** (e - t) * (1 + f / 2 ** mbits) for e in range(1, t + 1)
             for f in range(1 << mbits)]
    mag = torch.tensor(sorted(set(vals)), dtype=torch.float64)
    return torch.cat([-mag.flip(0)[:-1], mag]) if signed else mag


def dynamic_table(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic tree map (8 bits, 7 exponent bits), values in [-1, 1]."""
    data = [0.0, 1.0]
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** (i + (0 if signed else 1)) + 1, dtype=torch.float64)
        means = ((b[:-1] + b[1:]) / 2).tolist()
        data += [s * 10 ** (i - 6) * x for x in means for s in ((1, -1) if signed else (1,))]
    return torch.tensor(sorted(set(data)), dtype=torch.float64)


def linear_table(signed: bool) -> torch.Tensor:
    return torch.arange(-127 if signed else 0, 128 if signed else 256,
                        dtype=torch.float64) / (127 if signed else 255)


class Code:
    """A blockwise code: a ``table`` of normalized values, a block reference from its absmax."""

    def __init__(self, table, ref, sqrt_domain=False, mbits=0):
        self.table, self.ref, self.sqrt, self.mbits = table, ref, sqrt_domain, mbits

    def reference(self, amax: torch.Tensor) -> torch.Tensor:
        if self.ref == "absmax":
            return torch.where(amax > 0, amax, torch.ones_like(amax))
        a = torch.where(amax > 0, amax, torch.full_like(amax, 2.0 ** -100))
        e = torch.floor(torch.log2(a))
        return torch.exp2(torch.where(a / torch.exp2(e) > 2.0 - 2.0 ** -self.mbits, e + 1, e))

    def roundtrip(self, x: torch.Tensor, block: int, stochastic: bool,
                  gen: torch.Generator) -> torch.Tensor:
        """x quantized blockwise and decoded again (fp64 arithmetic, returned as x's dtype)."""
        flat = x.detach().double().reshape(-1)
        if self.sqrt:
            flat = flat.clamp_min(0).sqrt()
        n = flat.numel()
        blocks = torch.nn.functional.pad(flat, (0, (-n) % block)).view(-1, block)
        ref = self.reference(blocks.abs().amax(1, keepdim=True))
        y = (blocks / ref).clamp(self.table[0], self.table[-1])
        hi_i = torch.searchsorted(self.table, y).clamp(1, len(self.table) - 1)
        lo, hi = self.table[hi_i - 1], self.table[hi_i]
        frac = ((y - lo) / (hi - lo)).clamp(0, 1)
        up = (torch.rand(frac.shape, generator=gen, dtype=torch.float64) < frac) if stochastic \
            else frac > 0.5
        q = (torch.where(up, hi, lo) * ref).reshape(-1)[:n]
        return (q * q if self.sqrt else q).view(x.shape).to(x.dtype)


def quantile_table(samples: torch.Tensor, signed: bool) -> torch.Tensor:
    """256 levels at the quantiles of the normalized ``samples``, 0 and 1 included."""
    mag = samples.abs() if signed else samples
    qs = torch.quantile(mag[torch.randperm(mag.numel())[:1 << 20]].double(),
                        torch.linspace(0, 1, 128 if signed else 256, dtype=torch.float64))
    qs[0], qs[-1] = 0.0, 1.0
    qs = torch.unique(qs)
    return torch.cat([-qs.flip(0)[:-1], qs]) if signed else qs


def codes_for(samples, signed):
    """The candidate codes of m (``signed``) or v, the quantile table fitted to ``samples``."""
    floats = ("e4m3", "e3m4", "e5m2") if signed else ("e5m3", "e4m4", "e6m2", "sqrt-e4m4")
    out = {name: Code(float_table(int(name[-3]), int(name[-1]), signed), "pow2",
                      sqrt_domain=name.startswith("sqrt"), mbits=int(name[-1]))
           for name in floats}
    return dict(out, dynamic=Code(dynamic_table(signed), "absmax"),
                quantile=Code(quantile_table(samples, signed), "absmax"),
                linear=Code(linear_table(signed), "absmax"))


def normalized(xs, block, signed):
    """Every full block of the tensors ``xs`` divided by its absmax, flattened."""
    out = []
    for x in xs:
        b = x.reshape(-1)[: (x.numel() // block) * block].view(-1, block)
        out.append((b / (b.abs() if signed else b).amax(1, keepdim=True).clamp_min(1e-30))
                   .reshape(-1))
    return torch.cat(out)


# ---- training

def guard_factor(b1: float, b2: float) -> float:
    """1/K, K the Cauchy-Schwarz bound of m^2 / v (0: none when b1^2 >= b2)."""
    r = b1 * b1 / b2
    return 0.0 if r >= 1 else (1 - b2) * (1 - r) / (1 - b1) ** 2


def train(args, data, on_step):
    """bench_convergence.train of torch's AdamW(0.9, 0.99) on FP32 params, batch 16, cosine."""
    from .bench_convergence import Setting, train as train_mode, val_batches

    st = Setting(preset=args.preset, batch_size=16, steps=args.steps, lr=args.lr, warmup=20,
                 betas=(B1, B2), weight_decay=WD, eval_interval=10, final_k=4, seed=args.seed)
    cfg = GPTConfig.preset(args.preset, data["vocab"]) if args.preset in ("tiny", "small") else \
        GPTConfig(vocab_size=data["vocab"], block_size=64, n_layer=3, n_head=4, n_embd=128)
    cpu = torch.device("cpu")
    return train_mode("fp32", st, cfg, data["train"], val_batches(data["val"], st, cfg, cpu), cpu,
                      fp32_gemm=True, seed=0, on_step=on_step).final_loss(st.final_k)


# ---- the static measurement

def _rel_rms(pairs):
    num = den = 0.0
    for q, x in pairs:
        num += float(((q.double() - x.double()) ** 2).sum())
        den += float((x.double() ** 2).sum())
    return math.sqrt(num / den)


def static_errors(moments, mcodes, vcodes, block):
    """Relative RMS errors of m and v per code and rounding; the share of v decoded to 0."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for rounding in ("sr", "rn"):
        sr = rounding == "sr"
        for name, code in mcodes.items():
            out[("m", name, rounding)] = _rel_rms(
                [(code.roundtrip(m, block, sr, gen), m) for m, _ in moments])
        for name, code in vcodes.items():
            qs = [code.roundtrip(v, block, sr, gen) for _, v in moments]
            out[("v", name, rounding)] = _rel_rms([(q, v) for q, (_, v) in zip(qs, moments)])
            zeros = sum(int(((q == 0) & (m != 0)).sum()) for q, (m, _) in zip(qs, moments))
            out[("v0", name, rounding)] = zeros / sum(m.numel() for m, _ in moments)
    return out


def update_error(moments, mcode, vcode, block, guard):
    """Relative RMS error of the update m / (sqrt(v) + eps), with or without a v floor."""
    gen = torch.Generator().manual_seed(6)
    inv_k = guard_factor(B1, B2) if guard else 0.0
    pairs = []
    for m, v in moments:
        mq = mcode.roundtrip(m, block, True, gen).double()
        vq = vcode.roundtrip(v, block, True, gen).double()
        if inv_k > 0:
            vq = torch.maximum(vq, mq * mq * inv_k)
        pairs.append((mq / (vq.sqrt() + EPS), m.double() / (v.double().sqrt() + EPS)))
    return _rel_rms(pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--steps", type=int, default=300)
    a("--block", type=int, default=256)
    a("--preset", default="q8", help="tiny, small, or q8 (3 layers, 128 wide)")
    a("--lr", type=float, default=2e-3)
    a("--seed", type=int, default=1234)
    a("--out", default="results/measure_q8_codes.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    corpus, vocab = load_corpus()
    train_d, val_d = split_corpus(corpus.long())
    data = {"train": train_d, "val": val_d, "vocab": len(vocab)}
    t0, moments = time.time(), []
    snapshot_steps = {args.steps // 8, args.steps // 2, args.steps}

    def snapshot(step, tr):  # the moments of the large params
        if step + 1 in snapshot_steps:
            moments.extend((tr.opt.state[p]["exp_avg"].clone(),
                            tr.opt.state[p]["exp_avg_sq"].clone())
                           for p in tr.params if p.numel() >= MIN_NUMEL)

    fp32 = [train(args, data, snapshot)]
    print("fp32 final val loss per seed: %s (%.0f s)" % (fp32, time.time() - t0), flush=True)
    mcodes = codes_for(normalized([m for m, _ in moments], args.block, True), True)
    vcodes = codes_for(normalized([v for _, v in moments], args.block, False), False)
    static = static_errors(moments, mcodes, vcodes, args.block)
    print("\nstatic round trip, block %d, relative RMS error (sr / rn):" % args.block)
    for name in mcodes:
        print("  m %-10s %.4f / %.4f" % (name, static[("m", name, "sr")],
                                         static[("m", name, "rn")]))
    for name in vcodes:
        print("  v %-10s %.4f / %.4f   v->0 with m!=0: %.2e / %.2e"
              % (name, static[("v", name, "sr")], static[("v", name, "rn")],
                 static[("v0", name, "sr")], static[("v0", name, "rn")]))
    pairs = [("e4m3", "e5m3"), ("e3m4", "e5m3"), ("e4m3", "e4m4"), ("e3m4", "e4m4"),
             ("e5m2", "e6m2"), ("e4m3", "sqrt-e4m4"), ("dynamic", "dynamic"),
             ("quantile", "quantile"), ("linear", "linear")]
    print("\nupdate error (relative RMS of m/(sqrt(v)+eps)), sr, with / without the v guard:")
    upd = {}
    for mc, vc in pairs:
        for guard in (True, False):
            upd[(mc, vc, guard)] = update_error(moments, mcodes[mc], vcodes[vc], args.block, guard)
        print("  %-9s + %-10s %.4f / %.4f" % (mc, vc, upd[(mc, vc, True)], upd[(mc, vc, False)]),
              flush=True)
    print("\nblock size (e3m4 + e4m4, sr): update error, and the scales' bytes per element")
    by_block = {}
    for block in (32, 64, 128, 256, 512, 1024, 2048):
        by_block[block] = update_error(moments, mcodes["e3m4"], vcodes["e4m4"], block, True)
        print("  %5d  %.4f  %.4f B" % (block, by_block[block], 8.0 / block), flush=True)
    print("\nwritten:", write_json(args.out, {
        "args": dict(vars(args), snapshot_steps=sorted(snapshot_steps)), "fp32": fp32,
        "static": {"|".join(k): v for k, v in static.items()},
        "update_error": {"%s|%s|guard=%d" % k: v for k, v in upd.items()},
        "update_error_by_block": by_block}))


if __name__ == "__main__":
    main()
