"""Saved activations, measured from autograd's saved-tensor hooks, per precision mode, with and
without mpext.activations' FP8 compression; the gradient error it costs; a short convergence run.
What is counted: docs/activations.md, "Measurements" (step times only mean something on a quiet
machine).

    python -m benchmarks.bench_activations [--quick] [--converge-steps 300] [--out results]
"""
import argparse
import collections
import contextlib
import statistics
from pathlib import Path

import torch

import mpext
from mpext import activations as act
from mpext.memory_estimate import activation_bytes

from . import common, gpt
from .training import Trainer

MODES = ("fp32", "amp-bf16", "amp-fp16", "bf16")


class Saved:
    """A measuring pack hook: the bytes autograd holds for the backward, per dtype and producer."""

    def __init__(self, model, ctx=None):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.ctx, self.seen = ctx, set()
        self.bytes, self.fp32_by = 0, collections.Counter()

    def pack(self, t):
        stored = self.ctx.pack(t) if self.ctx is not None else t
        if t.grad_fn is None or act._is_param_like(t, self.params):
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


def models(quick):
    """name -> (build(), batch(), loss(model, batch), layers, tokens per batch)."""
    ids, vocab = gpt.load_corpus()
    cfg = gpt.GPTConfig(vocab_size=len(vocab), block_size=64 if quick else 128,
                        n_layer=2 if quick else 4, n_head=4, n_embd=128 if quick else 256)
    b, tokens = 4 if quick else 8, (4 if quick else 8) * cfg.block_size
    out = {"gpt": (lambda: gpt.GPT(cfg), lambda: gpt.get_batch(
        ids, b, cfg.block_size, torch.Generator().manual_seed(0)), lambda m, xy: m(*xy)[1],
        cfg.n_layer, tokens)}
    from transformers import GPT2Config, GPT2LMHeadModel  # the test dependencies have it
    hcfg = GPT2Config(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=4, vocab_size=512,
                      n_positions=cfg.block_size, attn_implementation="sdpa",
                      activation_function="gelu_pytorch_tanh")
    out["hf-gpt2"] = (lambda: GPT2LMHeadModel(hcfg), lambda: (torch.randint(
        0, 512, (b, cfg.block_size), generator=torch.Generator().manual_seed(0)),),
        lambda m, x: m(x[0], labels=x[0]).loss, cfg.n_layer, tokens)
    w, n = (256, 64) if quick else (1024, 256)
    out["mlp"] = (lambda: common.mlp([w] * 5, last_act=True), lambda: (torch.randn(
        n, w, generator=torch.Generator().manual_seed(0)),),
        lambda m, x: m(x[0]).float().square().mean(), 4, n)
    return out


def step(model, batch, loss_fn, mode, ctx, meter=None):
    amp = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(mode)
    with contextlib.ExitStack() as stack:
        for c in (torch.autocast("cpu", dtype=amp) if amp else None, ctx, meter and
                  torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)):
            if c is not None:
                stack.enter_context(c)
        loss = loss_fn(model, batch)
    loss.float().backward()
    return loss


def groups(model):
    out = collections.defaultdict(list)
    for name, p in model.named_parameters():
        parts = [s for s in name.split(".") if not s.isdigit()]
        out[next((g for g in ("attn", "mlp", "ln", "wte", "wpe", "head", "lm_head")
                      if any(s.startswith(g) for s in parts)), parts[0])].append(p)
    return out


def measure(quick):
    rows, errors, cpu = [], {}, torch.device("cpu")
    for name, (build, batch, loss_fn, layers, tokens) in models(quick).items():
        grads = {}
        for mode in MODES:
            for compress in (False, True):
                torch.manual_seed(0)
                dt = torch.bfloat16 if mode == "bf16" else torch.float32
                model = build().to(dt)
                ctx = act.fp8_saved_tensors(params=model) if compress else None
                meter = Saved(model, ctx)
                xb = tuple(t.to(dt) if t.is_floating_point() else t for t in batch())
                step(model, xb, loss_fn, mode, ctx, meter)
                grads[mode, compress] = {g: [p.grad.float() for p in ps]
                                         for g, ps in groups(model).items()}
                model.zero_grad(set_to_none=True)
                fn = lambda: step(model, xb, loss_fn, mode, ctx)  # noqa: E731
                peak = common.peak_memory_many({0: fn}, cpu)[0]
                t = common.time_fns({0: fn}, device=cpu, repeats=3, warmup=1, max_inner=1,
                                    show_progress=False)[0]
                rows.append(dict(model=name, mode=mode, fp8=compress, saved=meter.bytes,
                                 per_token_layer=meter.bytes / tokens / layers, peak=peak,
                                 step_s=t.median, fp32_top=meter.fp32_by.most_common(3)))
            errors[name, mode] = {
                g: max((a - b).norm().item() / max(a.norm().item(), 1e-30)
                       for a, b in zip(grads[mode, False][g], grads[mode, True][g]))
                for g in grads[mode, False]}
    return rows, errors


def converge(steps, model_name, seeds=(0, 1, 2)):
    """The benchmark GPT ("small") or an HF GPT-2 of its sizes on the same corpus, bf16 params
    stepped by mpext.optim.AdamW (FP32 masters): the validation loss per (compressed, seed)."""
    ids, vocab = gpt.load_corpus()
    (train, val), cfg = gpt.split_corpus(ids), gpt.GPTConfig.preset("small", len(vocab))
    if model_name == "gpt":
        build, loss_of = (lambda: gpt.GPT(cfg, fp32_gemm=True)), (lambda m, x, y: m(x, y)[1])
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        hcfg = GPT2Config(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                          vocab_size=len(vocab), n_positions=cfg.block_size, bos_token_id=0,
                          eos_token_id=0, attn_implementation="sdpa",
                          activation_function="gelu_pytorch_tanh")
        build = lambda: GPT2LMHeadModel(hcfg)  # noqa: E731
        loss_of = lambda m, x, y: m(x, labels=x).loss  # noqa: E731  (HF shifts the labels)
    out = {}
    for compress in (False, True):
        for seed in seeds:
            torch.manual_seed(seed)
            tr = Trainer.for_mode("mpext_optim_bf16", build(), lr=3e-3)
            ctx = act.fp8_saved_tensors(params=tr.model) if compress else contextlib.nullcontext()
            gen = torch.Generator().manual_seed(seed)
            for _ in range(steps):
                with ctx:  # the forward only: the hooks pack what it saves
                    loss = loss_of(tr.model, *gpt.get_batch(train, 32, cfg.block_size, gen))
                loss.backward()
                tr.opt.step()
                tr.opt.zero_grad()
            with torch.no_grad():
                vgen = torch.Generator().manual_seed(123)
                out[compress, seed] = statistics.mean(loss_of(tr.model, *gpt.get_batch(
                    val, 64, cfg.block_size, vgen)).item() for _ in range(4))
    return out


def kernels(quick):
    """ns per element and GB/s of the FP8 ops on one BF16 activation (block 128), against
    torch's own cast to float8_e4m3fn and an allocating copy (``clone``), interleaved: every op
    writes a new tensor, so all of them pay for its fresh pages."""
    x = torch.randn(1024 if quick else 4096, 4096, dtype=torch.bfloat16)
    q, sc = mpext.ops.fp8_quantize(x)
    cases = {  # label -> (fn, bytes moved per element)
        "fp8_quantize": (lambda: mpext.ops.fp8_quantize(x), 3 + 4 / 128),
        "fp8_quantize, stochastic": (lambda: mpext.ops.fp8_quantize(x, stochastic=True),
                                     3 + 4 / 128),
        "fp8_dequantize to bf16": (
            lambda: mpext.ops.fp8_dequantize(q, sc, dtype=torch.bfloat16), 3 + 4 / 128),
        "torch: x.to(float8_e4m3fn)": (lambda: x.to(torch.float8_e4m3fn), 3),
        "torch: x.clone() (roofline)": (lambda: x.clone(), 4),
    }
    t = common.time_fns({k: f for k, (f, _) in cases.items()}, device=torch.device("cpu"),
                        repeats=7 if quick else 15, show_progress=False)
    return [[k, "%.3f" % (t[k].median / x.numel() * 1e9),
             "%.1f" % (b * x.numel() / t[k].median / common.GB)] for k, (_, b) in cases.items()]


def table(rows, errors, conv):
    MiB = common.MiB
    lines = []
    for r in rows:
        ref = next(x["saved"] for x in rows if x["model"] == r["model"] and x["mode"] == "bf16"
                   and not x["fp8"])
        lines.append([r["model"], r["mode"], "on" if r["fp8"] else "off", "%.2f" % (
            r["saved"] / MiB), "%.0f" % r["per_token_layer"], "%+.0f%%" % (
            100 * (r["saved"] / ref - 1)), "-" if r["peak"] is None else "%.1f" % (
            r["peak"] / MiB), "%.3f" % r["step_s"], ", ".join(
            "%s %.2f" % (k, v / MiB) for k, v in r["fp32_top"]) or "-"])
    names = sorted({g for e in errors.values() for g in e})
    out = [common.markdown_table(["model", "mode", "FP8", "saved MiB", "B / token / layer",
                                  "vs bf16", "peak MiB", "step s",
                                  "largest FP32 producers (MiB)"], lines), "",
           "Relative gradient error, FP8 on vs off (largest per parameter group):", "",
           common.markdown_table(["model", "mode"] + names, [[m, mode] + [
               "%.4f" % e[g] if g in e else "-" for g in names] for (m, mode), e in
               errors.items()])]
    for name, c in conv.items():
        out += ["", "Convergence, %s (validation loss): " % name + ", ".join(
            "seed %d: off %.4f / on %.4f" % (s, c[False, s], c[True, s])
            for s in sorted({s for _, s in c}))]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")  # smaller models
    p.add_argument("--converge-steps", type=int, default=0)  # 0: no convergence run
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--threads", type=int, default=1, help="1: two threads spin on a busy machine")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows, errors = measure(a.quick)
    conv = {m: converge(a.converge_steps, m) for m in ("gpt", "hf-gpt2")} \
        if a.converge_steps else {}
    est = activation_bytes(8, 128, 256, 4, 4, 2, len(gpt.load_corpus()[1]), dropout=False)
    ops = kernels(a.quick)
    text = table(rows, errors, conv) + (
        "\n\nmpext.memory's estimate for the benchmark GPT in bf16: %.2f MiB" % (est / common.MiB)
    ) + "\n\nThe FP8 ops, %d thread(s), median of interleaved samples:\n\n" % a.threads + (
        common.markdown_table(["op", "ns / element", "GB/s"], ops))
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    common.write_text(a.out / "activations.md", text)
    common.write_json(a.out / "activations.json", dict(rows=rows, estimate_gpt_bf16=est, ops=ops, errors={
        "%s/%s" % k: v for k, v in errors.items()}, convergence={
        "%s/%s/%d" % (m, "on" if c else "off", s): v for m, r in conv.items()
        for (c, s), v in r.items()}))


if __name__ == "__main__":
    main()
