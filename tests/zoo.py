"""The zoo of stock architectures the activation tests measure: HF GPT-2 (the hub's defaults,
eager and SDPA attention), HF Llama, a ViT from plain torch.nn, a CNN — small configs, built from
the real packages' classes — and the measurement of one BF16 forward's bytes left alive for the
backward (HeapMeter: the allocator, not mpext's counters) with each policy's gradient error.
benchmarks/bench_activations.py --zoo measures the same models (plus the project's GPT) at full
size; tests import nothing from benchmarks/ (tests/test_layout.py), so the builders are here too."""
import contextlib
import statistics

import torch

from mpext import activations as act
from mpext.memory.meter import HeapMeter


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
    sequences."""
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
    # the project's own GPT (tests/small_gpt.py: pre-LayerNorm, GELU MLP, SDPA, no dropout)
    from small_gpt import SmallGPT
    tgt = torch.randint(0, vocab, (b, seq), generator=g)
    out["gpt"] = (lambda: SmallGPT(vocab, seq, w, 2, 4), lambda dt: (ids, tgt),
                  lambda m, x: m(*x))
    return out


def zoo(policies=("all", "layers"), dev="cpu", names=None, small=False):
    """Per model: the heap bytes one forward leaves alive (BF16, uncompressed and per policy),
    and the per-parameter gradient error of each policy (relative L2 against the uncompressed
    BF16 run, first step) next to the same gradient's BF16-vs-FP32 error."""
    heap, rows = HeapMeter(dev), []
    for name, (build, batch, loss_fn) in zoo_models(small).items():
        if names and name not in names:
            continue
        grads, held = {}, {}
        for dt, policy in [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, None)] \
                + [(torch.bfloat16, p) for p in policies]:
            torch.manual_seed(0)
            model = build().to(dev, dt).train()
            xb = tuple(t.to(dev) for t in batch(dt))
            ctx = act.fp8_saved_tensors(policy, params=model, warn_unmatched=False) \
                if policy else contextlib.nullcontext()
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
        for policy in policies:
            err = {n: rel(grads[torch.bfloat16, None][n], g) for n, g in
                   grads[torch.bfloat16, policy].items()}
            worst = max(err, key=lambda n: err[n] / max(ref[n], 1e-12))
            over = [n for n in err if err[n] > 2 * ref[n] and ref[n] > 0]
            rows.append(dict(model=name, policy=policy, bf16=held[None], held=held[policy],
                             saved=1 - held[policy] / held[None], over=len(over), params=len(err),
                             worst=worst, worst_err=err[worst], worst_ref=ref[worst],
                             median_err=statistics.median(err.values()),
                             median_ref=statistics.median(ref.values()),
                             errors=err, ref=ref))
    return rows
