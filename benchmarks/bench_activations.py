"""Saved activations per precision mode, FP8 off and on (benchmarks/README.md)."""
import collections
import contextlib
import functools
import statistics

import torch

import mpext
from mpext import activations as act
from mpext.memory.estimator import activation_bytes
from mpext.memory.meter import HeapMeter

from . import common, gpt
from .training import Trainer

NAME, TITLE = "activations", "Saved activations per precision mode, FP8 off and on"
MODES = ("fp32", "amp-bf16", "amp-fp16", "bf16")
# the convergence runs: uncompressed, the default policy, and the most lossy options there are
VARIANTS = {"off": None, "on": {}, "aggressive": dict(
    policy="size", min_bytes=1, min_numel=1, fp8_dtype=torch.float8_e5m2, pow2_scale=True,
    stochastic=True)}


class Saved:
    """A measuring pack hook: the bytes autograd holds for the backward, per dtype and producer
    (all but the parameters and the batch: dropout masks and norm statistics count)."""

    def __init__(self, model, ctx=None, batch=()):
        self.params, self.batch = ({t.untyped_storage().data_ptr() for t in ts}
                                   for ts in (model.parameters(), batch))
        self.ctx, self.seen = ctx, set()
        self.bytes, self.fp32_by = 0, collections.Counter()

    def pack(self, t):
        stored = self.ctx.pack(t) if self.ctx is not None else t
        if t.untyped_storage().data_ptr() in self.batch or act._is_param_like(t, self.params):
            return stored  # alive anyway: a parameter, its view or cast, the batch
        plain = isinstance(stored, torch.Tensor)
        key = stored.untyped_storage().data_ptr() if plain else id(stored)
        if key in self.seen:
            return stored
        n = stored.untyped_storage().nbytes() if plain else stored.nbytes
        if plain and stored.dtype == torch.float32:
            self.fp32_by[stored.grad_fn.name() if stored.grad_fn else "no grad_fn"] += n
        self.seen.add(key)
        self.bytes += n
        return stored

    unpack = staticmethod(act.fp8_saved_tensors.unpack)


def estimate(cfg, b, mode, fp8=False, device="cpu", **kw):
    """mpext.memory's saved bytes for a GPT of cfg's sizes in ``mode``, FP8 or not."""
    return activation_bytes(b, cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head, 4 if
                            mode == "fp32" else 2, norm_bytes=4 if "amp" in mode else None,
                            device=device, compress=fp8, **kw)


def models(quick):
    """name -> (build(), batch(), loss(model, batch), layers, tokens, estimate(mode, fp8))."""
    ids, vocab = gpt.load_corpus()
    cfg = gpt.GPTConfig(vocab_size=len(vocab), block_size=64 if quick else 128,
                        n_layer=2 if quick else 4, n_head=4, n_embd=128 if quick else 256)
    b, tokens = 4 if quick else 8, (4 if quick else 8) * cfg.block_size
    out = {"gpt": (lambda: gpt.GPT(cfg), lambda: gpt.get_batch(
        ids, b, cfg.block_size, torch.Generator().manual_seed(0)), lambda m, xy: m(*xy)[1],
        cfg.n_layer, tokens, functools.partial(estimate, cfg, b, vocab=len(vocab), dropout=False))}
    out["hf-gpt2"] = (lambda: gpt.hf_gpt2(cfg, vocab_size=512), lambda: (torch.randint(
        0, 512, (b, cfg.block_size), generator=torch.Generator().manual_seed(0)),),
        lambda m, x: m(x[0], labels=x[0]).loss, cfg.n_layer, tokens,
        functools.partial(estimate, cfg, b, vocab=512, dropout=True))  # GPT-2's dropout 0.1
    w, n = (256, 64) if quick else (1024, 256)
    out["mlp"] = (lambda: common.mlp([w] * 5, last_act=True), lambda: (torch.randn(
        n, w, generator=torch.Generator().manual_seed(0)),),
        lambda m, x: m(x[0]).float().square().mean(), 4, n, lambda *_, **__: None)
    return out


def step(model, batch, loss_fn, mode, ctx, meter=None):
    amp, none = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(mode), \
        contextlib.nullcontext()
    with torch.autocast(batch[0].device.type, dtype=amp, enabled=amp is not None), ctx or none, \
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter else none:
        loss = loss_fn(model, batch)  # the meter's hooks innermost: they see what ctx packs
    loss.float().backward()
    return loss


def groups(model):
    out = collections.defaultdict(list)
    for name, p in model.named_parameters():
        parts = [s for s in name.split(".") if not s.isdigit()]
        out[next((g for g in ("attn", "mlp", "ln", "wte", "wpe", "head", "lm_head")
                      if any(s.startswith(g) for s in parts)), parts[0])].append(p)
    return out


def measure(quick, dev):
    rows, errors = [], {}
    for name, (build, batch, loss_fn, layers, tokens, est) in models(quick).items():
        grads = {}
        for mode in MODES:
            fns = {}
            for compress in (False, True):
                torch.manual_seed(0)
                dt = torch.bfloat16 if mode == "bf16" else torch.float32
                model = build().to(dev, dt)
                ctx = act.fp8_saved_tensors(params=model) if compress else None
                xb = tuple(t.to(dev, dt) if t.is_floating_point() else t.to(dev) for t in batch())
                meter = Saved(model, ctx, xb)
                step(model, xb, loss_fn, mode, ctx, meter)
                grads[mode, compress] = {g: [p.grad.float() for p in ps]
                                         for g, ps in groups(model).items()}
                model.zero_grad(set_to_none=True)
                fns[compress] = functools.partial(step, model, xb, loss_fn, mode, ctx)
                e = est(mode, compress, device=dev.type)
                rows.append(dict(model=name, mode=mode, fp8=compress, saved=meter.bytes,
                                 per_token_layer=meter.bytes / tokens / layers, estimate=e and
                                 e / tokens / layers, peak=common.peak_memory_many(
                                     {0: fns[compress]}, dev)[0],
                                 fp32_top=meter.fp32_by.most_common(3)))
            # the step with and without compression, interleaved (the machine's load moves)
            t = common.time_fns(fns, device=dev, repeats=5, warmup=1, max_inner=1,
                                show_progress=False)
            for r in rows[-2:]:
                r["step"] = t[r["fp8"]].to_json()
            errors[name, mode] = {
                g: max((a - b).norm().item() / max(a.norm().item(), 1e-30)
                       for a, b in zip(grads[mode, False][g], grads[mode, True][g]))
                for g in grads[mode, False]}
    return rows, errors


def converge(steps, model_name, seeds=(0, 1, 2)):
    """The validation loss per (VARIANTS key, seed) of BF16 ``model_name`` ("gpt": the "small"
    preset; "hf-gpt2" of its sizes) stepped by mpext.optim.AdamW (FP32 masters)."""
    ids, vocab = gpt.load_corpus()
    (train, val), cfg = gpt.split_corpus(ids), gpt.GPTConfig.preset("small", len(vocab))
    if model_name == "gpt":
        build, loss_of = (lambda: gpt.GPT(cfg, fp32_gemm=True)), (lambda m, x, y: m(x, y)[1])
    else:  # HF shifts the labels itself
        build, loss_of = (lambda: gpt.hf_gpt2(cfg)), (lambda m, x, y: m(x, labels=x).loss)
    out = {}
    for variant, kw in VARIANTS.items():
        for seed in seeds:
            torch.manual_seed(seed)
            tr = Trainer.for_mode("mpext_optim_bf16", build(), lr=3e-3)
            ctx = contextlib.nullcontext() if kw is None else act.fp8_saved_tensors(
                params=tr.model, **dict(kw, seed=seed))
            gen = torch.Generator().manual_seed(seed)
            for _ in range(steps):
                with ctx:  # the forward only: the hooks pack what it saves
                    loss = loss_of(tr.model, *gpt.get_batch(train, 32, cfg.block_size, gen))
                loss.backward()
                tr.opt.step()
                tr.opt.zero_grad()
            with torch.no_grad():
                vgen = torch.Generator().manual_seed(123)
                out[variant, seed] = statistics.mean(loss_of(tr.model, *gpt.get_batch(
                    val, 64, cfg.block_size, vgen)).item() for _ in range(4))
    return out


def kernels(quick, dev):
    """The FP8 ops against torch's cast, a copy and the in-place roofline (docs/activations.md)."""
    roof = common.measure_roofline(dev, quick=quick, show_progress=False)
    big = torch.zeros(roof["numel"], device=dev)
    x = torch.randn(1024 if quick else 4096, 4096, dtype=torch.bfloat16, device=dev)
    q, sc = mpext.ops.fp8_quantize(x)
    cases = {  # label -> (fn, bytes moved per element of x)
        "fp8_quantize": (lambda: mpext.ops.fp8_quantize(x), 3 + 4 / 128),
        "fp8_quantize, stochastic": (lambda: mpext.ops.fp8_quantize(x, stochastic=True),
                                     3 + 4 / 128),
        "fp8_dequantize to bf16": (
            lambda: mpext.ops.fp8_dequantize(q, sc, dtype=torch.bfloat16), 3 + 4 / 128),
        "torch: x.to(float8_e4m3fn)": (lambda: x.to(torch.float8_e4m3fn), 3),
        "torch: x.clone() (allocating copy)": (lambda: x.clone(), 4),
        "in-place roofline x.add_(0.5), fp32": (lambda: big.add_(0.5), 8 * big.numel() / x.numel()),
    }
    t = common.time_fns({k: f for k, (f, _) in cases.items()}, device=dev,
                        repeats=7 if quick else 15, show_progress=False)
    gbps = {k: b * x.numel() / t[k].median / common.GB for k, (_, b) in cases.items()}
    return roof, [[k, "%.3f" % (t[k].median / (big if "roofline" in k else x).numel() * 1e9),
                   "%.1f" % gbps[k], "%.0f%%" % (100 * gbps[k] / gbps[list(cases)[-1]])]
                  for k in cases]


def table(rows, errors, conv):
    MiB = common.MiB
    lines = []
    for r in rows:
        ref = next(x["saved"] for x in rows if x["model"] == r["model"] and x["mode"] == "bf16"
                   and not x["fp8"])
        st, off = r["step"], next(x["step"] for x in rows if x["model"] == r["model"] and
                                  x["mode"] == r["mode"] and not x["fp8"])["median_s"]
        lines.append([r["model"], r["mode"], "on" if r["fp8"] else "off", "%.2f" % (
            r["saved"] / MiB), "%.0f" % r["per_token_layer"], "%.0f" % r["estimate"] if
            r["estimate"] else "-", "%+.0f%%" % (100 * (r["saved"] / ref - 1)), "-" if r[
            "peak"] is None else "%.1f" % (r["peak"] / MiB), "%.0f (%.0f-%.0f)%s" % (
            1e3 * st["median_s"], 1e3 * st["q1_s"], 1e3 * st["q3_s"], " %+.0f%%" % (
                100 * (st["median_s"] / off - 1)) if r["fp8"] else ""), ", ".join(
            "%s %.2f" % (k, v / MiB) for k, v in r["fp32_top"]) or "-"])
    names = sorted({g for e in errors.values() for g in e})
    out = [common.markdown_table(["model", "mode", "FP8", "saved MiB", "B / token / layer",
                                  "mpext.memory's estimate", "vs bf16", "peak MiB",
                                  "step ms, median (IQR), vs off",
                                  "largest FP32 producers (MiB)"], lines), "",
           "Relative gradient error, FP8 on vs off (largest per parameter group):", "",
           common.markdown_table(["model", "mode"] + names, [[m, mode] + [
               "%.4f" % e[g] if g in e else "-" for g in names] for (m, mode), e in
               errors.items()])]
    for name, c in conv.items():
        out += ["", "Convergence, %s (validation loss): " % name + ", ".join(
            "seed %d: " % s + " / ".join("%s %.4f" % (v, c[v, s]) for v in VARIANTS)
            for s in sorted({s for _, s in c}))]
    return "\n".join(out)


# ---- the zoo: stock architectures from the real packages' classes, small configs, BF16 params,
# train mode. Bytes held for the backward from glibc's heap (independent of mpext's counters).

class ResBlock(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.c2 = (torch.nn.Conv2d(c, c, 3, padding=1, bias=False) for _ in (1, 2))
        self.b1, self.b2 = torch.nn.BatchNorm2d(c), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


class ViT(torch.nn.Module):
    """A pre-norm ViT encoder from plain torch.nn (LayerNorm, GELU, nn.MultiheadAttention)."""

    def __init__(self, width=256, layers=4, heads=4, patch=8, image=64, classes=10):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, width, patch, stride=patch)
        self.pos = torch.nn.Parameter(torch.zeros(1, (image // patch) ** 2, width))
        self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.1, activation="gelu", batch_first=True,
            norm_first=True) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x).mean(1))


def zoo_models(small=False):
    """name -> (build(), batch(dtype), loss(model, batch)); ``small``: half the widths and
    sequences (the tests' sizes)."""
    import transformers
    g = torch.Generator().manual_seed(0)
    seq, b, vocab, w = (64, 2, 256, 128) if small else (128, 4, 512, 256)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    lm = (lambda dt: (ids,)), (lambda m, x: m(x[0], labels=x[0]).loss)
    out = {}
    for attn in ("eager", "sdpa"):  # the hub's defaults (gelu_new, dropout 0.1), small sizes
        out["hf-gpt2-" + attn] = (lambda attn=attn: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_embd=w, n_head=4, vocab_size=vocab,
                                    n_positions=seq, attn_implementation=attn)),) + lm
    out["hf-llama"] = (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=w, intermediate_size=w * 43 // 16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=seq,
        attn_implementation="sdpa")),) + lm
    img = torch.randn(8, 3, w // 4, w // 4, generator=g)
    cls = torch.randint(0, 10, (8,), generator=g)
    ce = lambda m, x: torch.nn.functional.cross_entropy(m(x[0]).float(), x[1])  # noqa: E731
    out["vit"] = (lambda: ViT(width=w, image=w // 4), lambda dt: (img.to(dt), cls), ce)
    out["cnn"] = (lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        *(ResBlock(32) for _ in range(3)), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(32, 10)),
        lambda dt: (torch.randn(8, 3, w // 8, w // 8, generator=g).to(dt), cls), ce)
    ids2, vocab2 = gpt.load_corpus()
    cfg = gpt.GPTConfig(vocab_size=len(vocab2), block_size=seq, n_layer=2, n_head=4, n_embd=w)
    xy = gpt.get_batch(ids2, b, seq, torch.Generator().manual_seed(0))
    out["gpt"] = (lambda: gpt.GPT(cfg), lambda dt: xy, lambda m, x: m(*x)[1])
    return out


def zoo(policies=("all", "layers"), dev="cpu", names=None, small=False):
    """Per model: the heap bytes one forward leaves alive (BF16, uncompressed and per policy),
    and the per-parameter gradient error of each policy (relative L2 against the uncompressed
    BF16 run, first step) next to the same gradient's BF16-vs-FP32 error. A policy may be a
    (label, fp8_saved_tensors keywords) pair: ("all, e4m3", dict(fp8_dtype=...))."""
    policies = [p if isinstance(p, tuple) else (p, dict(policy=p)) for p in policies]
    heap, rows = HeapMeter(dev), []
    for name, (build, batch, loss_fn) in zoo_models(small).items():
        if names and name not in names:
            continue
        grads, held = {}, {}
        for dt, policy in [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, None)] \
                + [(torch.bfloat16, p) for p, _ in policies]:
            torch.manual_seed(0)
            model = build().to(dev, dt).train()
            xb = tuple(t.to(dev) for t in batch(dt))
            ctx = act.fp8_saved_tensors(params=model, warn_unmatched=False, **dict(
                policies)[policy]) if policy else contextlib.nullcontext()
            torch.manual_seed(1)  # the same dropout masks in every run
            before = heap()
            with ctx:
                loss = loss_fn(model, xb)
            after = heap()
            loss.float().backward()
            del loss
            grads[dt, policy] = {n: p.grad.float().clone() for n, p in model.named_parameters()
                                 if p.grad is not None}
            if dt == torch.bfloat16:
                held[policy] = after - before  # the second uncompressed run overwrites the first
        rel = lambda a, b: ((a - b).norm() / a.norm().clamp_min(1e-30)).item()  # noqa: E731
        ref = {n: rel(grads[torch.float32, None][n], g) for n, g in
               grads[torch.bfloat16, None].items()}
        for policy, _ in policies:
            err = {n: rel(grads[torch.bfloat16, None][n], g) for n, g in
                   grads[torch.bfloat16, policy].items()}
            worst = max(err, key=lambda n: err[n] / max(ref[n], 1e-12))
            # as the test: gradients BF16 itself gets wrong by half (a bias before BatchNorm)
            # have no direction to keep
            over = [n for n in err if err[n] > 2 * ref[n] and 0 < ref[n] < 0.5]
            rows.append(dict(model=name, policy=policy, bf16=held[None], held=held[policy],
                             saved=1 - held[policy] / held[None], over=len(over), params=len(err),
                             worst=worst, worst_err=err[worst], worst_ref=ref[worst],
                             median_err=statistics.median(err.values()),
                             median_ref=statistics.median(ref.values()),
                             errors=err, ref=ref))
    return rows


def _why_raw(t, ctx):
    """Why ``ctx`` left a saved tensor as it is (the module's rules, in their order)."""
    if not t.is_floating_point():
        return "%s: exact use" % str(t.dtype).replace("torch.", "") + (
            ", under min_numel" if t.dtype == torch.bool else "")
    if t.numel() < ctx.min_numel:
        return "under min_numel (%d)" % ctx.min_numel
    if t.grad_fn is None:
        return "no grad_fn: a statistic, the log-sum-exp, a leaf"
    return "the policy, or a storage a saver holds raw"


def zoo_where(name, policy="all", dev="cpu", top=12, **kwargs):
    """Where one zoo model's saved bytes go under ``policy``: per (stored as, producer, dtype,
    shape, why raw), the bytes the backward holds (each storage or stored object once,
    parameters and the batch left out) and how many tensors, largest first. Stored as: "fp8"
    (an 8-bit copy), "bits" (a mask), "recomputed" (0 bytes: rerun from stored tensors in the
    backward), "raw"."""
    build, batch, loss_fn = zoo_models()[name]
    torch.manual_seed(0)
    model = build().to(dev, torch.bfloat16).train()
    xb = tuple(t.to(dev) for t in batch(torch.bfloat16))
    ctx = act.fp8_saved_tensors(policy, params=model, warn_unmatched=False, **kwargs)
    meter, by, n = Saved(model, ctx, xb), collections.Counter(), collections.Counter()
    kinds = {"_Packed": "fp8", "Bits": "bits", "Recomputed": "recomputed",
             "_Reshaped": "fp8 (a view of another)"}

    def pack(t):
        before, seen = meter.bytes, len(meter.seen)
        stored = meter.pack(t)
        if len(meter.seen) > seen:  # counted: not a param, the batch or a repeat
            raw = isinstance(stored, torch.Tensor)
            key = ("raw" if raw else kinds.get(type(stored).__name__, type(stored).__name__),
                   t.grad_fn.name() if t.grad_fn else "no grad_fn",
                   str(t.dtype).replace("torch.", ""), "x".join(map(str, t.shape)),
                   _why_raw(t, ctx) if raw else "")
            by[key] += meter.bytes - before
            n[key] += 1
        return stored
    torch.manual_seed(1)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, meter.unpack):
        loss_fn(model, xb)
    rows = sorted(by, key=lambda k: (-by[k], k))
    return [(k, by[k], n[k]) for k in rows[:top]], meter.bytes


def zoo_where_table(name, **kwargs):
    rows, total = zoo_where(name, **kwargs)
    return "Where %s's %.2f MiB go (the default policy; each storage or stored object once):" \
        "\n\n%s" % (name, total / common.MiB, common.markdown_table(
            ["stored as", "saved by", "dtype", "shape", "why raw", "tensors", "KiB"],
            [list(k) + [c, "%.0f" % (v / 1024)] for k, v, c in rows]))


def zoo_table(rows):
    MiB = common.MiB
    return common.markdown_table(
        ["model", "policy", "BF16 MiB", "compressed MiB", "saved", "median grad err (BF16 vs FP32)",
         "params > 2x BF16 err", "worst param: err (BF16 vs FP32)"],
        [[r["model"], r["policy"], "%.2f" % (r["bf16"] / MiB), "%.2f" % (r["held"] / MiB),
          "%.0f%%" % (100 * r["saved"]), "%.4f (%.4f)" % (r["median_err"], r["median_ref"]),
          "%d / %d" % (r["over"], r["params"]),
          "%s: %.4f (%.4f)" % (r["worst"], r["worst_err"], r["worst_ref"])] for r in rows])


# ---- convergence on stock HF models: a learnable synthetic corpus, BF16 vs the default policy

def markov_corpus(vocab=64, n=1 << 16, branch=4, seed=0):
    """A token stream from a fixed random Markov chain: each token is followed by one of
    ``branch`` successors with probabilities in ratios 8:4:2:1: learnable, synthetic, the same on
    every run. Returns the tokens and the chain's entropy (the lowest loss there is, nats)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:branch] for _ in range(vocab)])
    p = torch.tensor([0.5 ** (i + 1) for i in range(branch)])
    p = p / p.sum()
    pick = torch.multinomial(p, n, replacement=True, generator=g)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    for i in range(1, n):  # a Python loop, once: 65k steps
        out[i] = succ[out[i - 1], pick[i]]
    floor = -(p * p.log()).sum().item()  # the chain's entropy per token, nats
    return out, floor


def hf_tiny(name, vocab, seq):
    """HF GPT-2 (GPT2Config's hub defaults: gelu_new, dropout 0.1) or HF Llama, 2 layers."""
    import transformers
    if name == "hf-gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=vocab, n_positions=seq,
            bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=seq,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))


# off: BF16 uncompressed; on: the default; e4m3: the previous default's code
CONV_VARIANTS = {"off": None, "on": {}, "e4m3": dict(fp8_dtype=torch.float8_e4m3fn)}


def convergence(names=("hf-gpt2", "hf-llama"), steps=200, seeds=(0, 1, 2), batch=16, seq=64,
                variants=CONV_VARIANTS, progress=None):
    """Validation loss after ``steps`` steps of BF16 params + mpext.optim.AdamW (FP32 masters)
    per (model, variant, seed): the seed fixes the initial weights, the batch order and the
    dropout; each variant sees the same ones."""
    ids, floor = markov_corpus()
    train, val = ids[: len(ids) * 7 // 8], ids[len(ids) * 7 // 8:]

    def batch_of(src, gen, b):
        i = torch.randint(0, len(src) - seq - 1, (b,), generator=gen)
        return torch.stack([src[j:j + seq] for j in i.tolist()])

    vgen = torch.Generator().manual_seed(123)
    vbatches = [batch_of(val, vgen, 32) for _ in range(4)]
    out = {}
    for name in names:
        for variant, kw in variants.items():
            for seed in seeds:
                torch.manual_seed(seed)
                tr = Trainer.for_mode("mpext_optim_bf16", hf_tiny(name, 64, seq), lr=3e-3)
                tr.model.train()
                ctx = contextlib.nullcontext() if kw is None else act.fp8_saved_tensors(
                    params=tr.model, **kw)
                gen = torch.Generator().manual_seed(seed)
                for _ in range(steps):
                    x = batch_of(train, gen, batch)
                    with ctx:
                        loss = tr.model(x, labels=x).loss
                    loss.backward()
                    tr.opt.step()
                    tr.opt.zero_grad()
                tr.model.eval()
                with torch.no_grad():
                    out[name, variant, seed] = statistics.mean(
                        tr.model(x, labels=x).loss.item() for x in vbatches)
                if progress:
                    progress("%s %s seed %d: %.4f" % (name, variant, seed, out[name, variant,
                                                                              seed]))
    return out, floor


def convergence_table(res, floor):
    names = list(dict.fromkeys(k[0] for k in res))
    variants = list(dict.fromkeys(k[1] for k in res))
    seeds = sorted({k[2] for k in res})
    rows = []
    for n in names:
        base = [res[n, "off", s] for s in seeds]
        lo, hi = min(base), max(base)
        for v in variants:
            ys = [res[n, v, s] for s in seeds]
            m = statistics.mean(ys)
            rows.append([n, v] + ["%.4f" % y for y in ys] + [
                "%.4f" % m, "%.4f-%.4f" % (lo, hi), "-" if v == "off" else
                ("yes" if lo <= m <= hi else "no (%+.4f)" % (m - (hi if m > hi else lo)))])
    return common.markdown_table(["model", "saved tensors"] + ["seed %d" % s for s in seeds] + [
        "mean", "BF16 band (min-max)", "mean inside"], rows) + (
        "\n\nThe chain's entropy (the best loss there is): %.4f nats/token." % floor)


# ---- step time and bytes held, eager and compiled, per zoo model (the default vs BF16)

def _cpu_times(fns, repeats):
    """Interleaved paired rounds timed by this process's CPU time (one thread): on a machine
    shared by many, wall time also counts the waits for a core; CPU time counts the step's
    own work (cache contention still shows)."""
    import time
    out = {k: [] for k in fns}
    for k, f in fns.items():
        f()  # warm-up
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.process_time()
            f()
            out[k].append(time.process_time() - t0)
    return {k: common.Timing(v, 1) for k, v in out.items()}


def steptime(names=None, dev="cpu", compiled=(False, True), repeats=9, small=False,
             progress=None, cpu_time=False):
    """Per zoo model x {eager, compiled (inductor)}: the bytes one BF16 forward leaves alive
    (HeapMeter) uncompressed and under the default policy, and the training step (forward
    under the context, backward) of each, interleaved round by round: per round the ratio of
    the compressed step to the BF16 step, their median and quartiles."""
    dev = torch.device(dev)
    heap, rows = HeapMeter(dev), []
    for name, (build, batch, loss_fn) in zoo_models(small).items():
        if names and name not in names:
            continue
        for comp in compiled:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build().to(dev, torch.bfloat16).train()
            xb = tuple(t.to(dev) for t in batch(torch.bfloat16))
            fwd = torch.compile(model) if comp else model
            ctxs = {"bf16": None, "compressed": act.fp8_saved_tensors(
                params=model, warn_unmatched=False)}

            def step(ctx, held=None):
                # the meter only in the untimed steps: its gc.collect() takes ~0.6 s with
                # transformers loaded, which timed with the step hid the overhead (it read
                # 1.06-1.24 where the steps alone differ by 1.4-2.6x)
                before = heap() if held is not None else 0
                with ctx or contextlib.nullcontext():
                    loss = loss_fn(fwd, xb)
                if held is not None:
                    held.append(heap() - before)
                loss.float().backward()
                del loss
                model.zero_grad(set_to_none=True)
            held = {k: [] for k in ctxs}
            for _ in range(2):  # compiles, warms the allocator; then the figure
                for k, c in ctxs.items():
                    step(c, held[k])
            fns = {k: functools.partial(step, c) for k, c in ctxs.items()}
            t = _cpu_times(fns, repeats) if cpu_time and dev.type == "cpu" else common.time_fns(
                fns, device=dev, repeats=repeats, warmup=1, max_inner=1, show_progress=False)
            ratios = sorted(c / b for b, c in zip(t["bf16"].samples, t["compressed"].samples))
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
            rows.append(dict(model=name, compiled=comp, bf16=held["bf16"][-1],
                             held=held["compressed"][-1],
                             saved=1 - held["compressed"][-1] / held["bf16"][-1],
                             step_bf16=t["bf16"].to_json(), step=t["compressed"].to_json(),
                             ratio=statistics.median(ratios), ratio_q1=q1, ratio_q3=q3))
            if progress:
                r = rows[-1]
                progress("%s %s: %.0f%% saved, step x%.3f (%.3f-%.3f)" % (
                    name, "compiled" if comp else "eager", 100 * r["saved"], r["ratio"], q1, q3))
    return rows


def steptime_table(rows):
    MiB = common.MiB
    return common.markdown_table(
        ["model", "mode", "BF16 MiB", "compressed MiB", "saved", "BF16 step ms (IQR)",
         "compressed step ms (IQR)", "step ratio, median (IQR) of paired rounds"],
        [[r["model"], "compiled" if r["compiled"] else "eager", "%.2f" % (r["bf16"] / MiB),
          "%.2f" % (r["held"] / MiB), "%.0f%%" % (100 * r["saved"])] + [
            "%.1f (%.1f-%.1f)" % (1e3 * s["median_s"], 1e3 * s["q1_s"], 1e3 * s["q3_s"])
            for s in (r["step_bf16"], r["step"])] + [
            "%.3f (%.3f-%.3f)" % (r["ratio"], r["ratio_q1"], r["ratio_q3"])] for r in rows])


def add_args(p):
    p.add_argument("--converge-steps", type=int, default=0, help="0: no convergence run")
    p.add_argument("--converge-models", default="gpt,hf-gpt2")
    p.add_argument("--zoo", action="store_true", help="the stock-architecture zoo (zoo_table)")
    p.add_argument("--convergence", action="store_true", help="only: HF GPT-2 and Llama on a "
                   "Markov corpus, BF16 vs compressed, 3 seeds (convergence_table)")
    p.add_argument("--convergence-steps", type=int, default=200)
    p.add_argument("--convergence-models", default="hf-gpt2,hf-llama")
    p.add_argument("--convergence-variants", default=",".join(CONV_VARIANTS))
    p.add_argument("--steptime", action="store_true", help="only: the zoo's bytes held and "
                   "step time, eager and compiled, BF16 vs compressed (steptime_table)")
    p.add_argument("--models", default="", help="--steptime: these zoo models (comma list)")
    p.add_argument("--eager-only", action="store_true", help="--steptime: no torch.compile")
    p.add_argument("--compiled-only", action="store_true", help="--steptime: compiled only")
    p.add_argument("--cpu-time", action="store_true", help="--steptime: time the steps by the "
                   "process's CPU time, not wall time (a machine shared by many)")
    # one thread: two spin on a busy machine; --device cuda: the allocator's peaks
    p.set_defaults(threads=1, device="cpu")
    return p


def run(ctx) -> dict:
    b, a = common.Bench(ctx, NAME, TITLE), ctx.args
    if a.steptime:
        modes = (False,) if a.eager_only else (True,) if a.compiled_only else (False, True)
        rows = steptime([m for m in a.models.split(",") if m], ctx.device, modes,
                        repeats=a.repeats or 9, small=ctx.quick, cpu_time=a.cpu_time,
                        progress=functools.partial(print, flush=True))
        return b.finish(["One thread, %s%s." % (" and ".join(
            "compiled (inductor)" if c else "eager" for c in modes),
            ", the process's CPU time per step" if a.cpu_time else ""), "", steptime_table(rows)],
                        {"steptime": rows}, None)
    if a.convergence:
        res, floor = convergence(a.convergence_models.split(","), a.convergence_steps,
                                 variants={v: CONV_VARIANTS[v] for v in
                                           a.convergence_variants.split(",")},
                                 progress=functools.partial(print, flush=True))
        return b.finish([convergence_table(res, floor) if any(k[1] == "off" for k in res) else
                         "(no BF16 baseline run: results in the JSON only)"], {"convergence": {
            "%s/%s/%d" % k: v for k, v in res.items()}, "floor": floor}, None)
    rows, errors = measure(ctx.quick, ctx.device)
    b.phase("saved")
    conv = {m: converge(a.converge_steps, m) for m in a.converge_models.split(",")} \
        if a.converge_steps else {}
    b.phase("converge")
    b.roof, ops = kernels(ctx.quick, ctx.device)
    zoo_rows = zoo(dev=ctx.device) if a.zoo else []
    where = []
    for r in zoo_rows:  # tensor by tensor, for every model
        if r["policy"] == "all":
            where += ["", zoo_where_table(r["model"], dev=ctx.device)]
    md = ([zoo_table(zoo_rows)] + where + [""] if zoo_rows else []) + [
        table(rows, errors, conv), "", "The FP8 ops, %d thread(s), median of interleaved "
        "samples:" % torch.get_num_threads(), "",
        common.markdown_table(["op", "ns / element", "GB/s", "of in-place"], ops)]
    payload = dict(rows=rows, ops=ops, zoo=[{k: v for k, v in r.items() if k not in (
                       "errors", "ref")} for r in zoo_rows],
                   errors={"%s/%s" % k: v for k, v in errors.items()},
                   convergence={"%s/%s/%d" % (m, v, s): x for m, r in conv.items()
                                for (v, s), x in r.items()})
    series = (("FP8 off", "per_token_layer", False), ("FP8 on (default policy)",
              "per_token_layer", True), ("mpext.memory's estimate (off)", "estimate", False),
              ("mpext.memory's estimate (on)", "estimate", True))
    return b.finish(md, payload, lambda: common.plot_lines(ctx.out_dir / "activations.png", [{
        "title": n, "ylabel": "saved bytes / token / layer", "series": {
            k: (list(MODES), ys) for k, f, on in series if None not in (ys := [
                r[f] for r in rows if r["model"] == n and r["fp8"] == on])}}
        for n in dict.fromkeys(r["model"] for r in rows)], title=common.figure_title(ctx, TITLE)))


if __name__ == "__main__":
    common.run_standalone(run, __doc__, add_args)
