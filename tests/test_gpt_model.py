"""The benchmark model and corpus (benchmarks/gpt.py): deterministic data, the model in every
param dtype, the emulated low-precision GEMM against torch's own, and bad input."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpt  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    return gpt.load_corpus()


def test_corpus_deterministic_and_structured(corpus):
    data, vocab = corpus
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert len(data) >= gpt.CORPUS_CHARS
    assert vocab == sorted(set(vocab)) and int(data.max()) < len(vocab)
    text = "".join(vocab[i] for i in data[:5000].tolist())
    assert text == gpt.corpus_text()[:5000]
    # a fresh generator (not the cached text) gives the same bytes
    fresh = gpt.corpus_text.__wrapped__(20_000, gpt.CORPUS_SEED)
    assert len(fresh) >= 20_000 and gpt.corpus_text().startswith(fresh)
    assert gpt.corpus_text.__wrapped__(20_000, 1) != gpt.corpus_text.__wrapped__(20_000, 2)
    # unigram entropy against a pure-Python count
    counts = {}
    for c in gpt.corpus_text():
        counts[c] = counts.get(c, 0) + 1
    n = sum(counts.values())
    want = -sum(v / n * math.log(v / n) for v in counts.values())
    assert gpt.unigram_entropy(data) == pytest.approx(want, rel=1e-9)


def test_get_batch_deterministic(corpus):
    data, _ = corpus
    x1, y1 = gpt.get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    torch.manual_seed(0)  # the global RNG must not matter
    x2, y2 = gpt.get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    ix = torch.randint(len(data) - 16, (4,), generator=torch.Generator().manual_seed(3))
    for row, i in zip(x1, ix.tolist()):
        assert torch.equal(row, data[i:i + 16].long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_runs_in_each_dtype(corpus, dtype):
    data, vocab = corpus
    cfg = gpt.GPTConfig.preset("tiny", len(vocab))
    torch.manual_seed(0)
    model = gpt.GPT(cfg).to(dtype)
    assert model.head.weight is model.wte.weight
    assert gpt.count_params(model) == sum(
        p.numel() for n, p in model.named_parameters())  # tied weight counted once
    x, y = gpt.get_batch(data, 2, cfg.block_size, torch.Generator().manual_seed(0))
    logits, loss = model(x, y)
    assert logits.dtype == dtype and loss.dtype == torch.float32
    assert logits.shape == (2, cfg.block_size, len(vocab))
    # near-uniform predictions at init
    assert abs(float(loss.detach()) - math.log(len(vocab))) < 0.1
    want = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_causal(corpus):
    data, vocab = corpus
    cfg = gpt.GPTConfig.preset("tiny", len(vocab))
    model = gpt.GPT(cfg).eval()
    x, _ = gpt.get_batch(data, 1, cfg.block_size, torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % len(vocab)
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [False, True])
def test_fp32_gemm_matches_native_lowp_linear(dtype, autocast):
    """The emulated GEMM (rounded operands, FP32 accumulation, rounded result) against a
    float64 reference on the same rounded operands: within one rounding of the output, which
    torch's own low-precision linear is too."""
    torch.manual_seed(0)
    lin = gpt.Linear(96, 80)
    x = torch.randn(64, 96)
    if not autocast:
        lin = lin.to(dtype)
        x = x.to(dtype)
    lin.fp32_gemm = True
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        got = lin(x)
    lin.fp32_gemm = False
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        native = lin(x)
    assert got.dtype == native.dtype == dtype
    ref = F.linear(x.to(dtype).double(), lin.weight.to(dtype).double(),
                   lin.bias.to(dtype).double())
    eps = torch.finfo(dtype).eps
    tol = eps * ref.abs() + 1e-4
    assert ((got.double() - ref).abs() <= tol).all()
    assert ((native.double() - ref).abs() <= 2 * tol).all()


def test_fp32_gemm_is_identity_for_fp32():
    torch.manual_seed(0)
    lin = gpt.Linear(8, 4)
    x = torch.randn(3, 8)
    want = lin(x)
    lin.fp32_gemm = True
    assert torch.equal(lin(x), want)


def test_bad_input(corpus):
    data, vocab = corpus
    with pytest.raises(ValueError, match="n_embd"):
        gpt.GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, n_embd=8)
    with pytest.raises(ValueError, match="block_size"):
        gpt.GPTConfig(vocab_size=10, block_size=0, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ValueError, match="dropout"):
        gpt.GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=1.0)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        gpt.GPTConfig.preset("huge", 10)
    with pytest.raises(TypeError, match="config"):
        gpt.GPT({"vocab_size": 10})
    model = gpt.GPT(gpt.GPTConfig.preset("tiny", len(vocab)))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="generator"):
        gpt.get_batch(data, 2, 8, None)
    with pytest.raises(ValueError, match="block_size"):
        gpt.get_batch(data[:8], 2, 8, torch.Generator())
    with pytest.raises(TypeError, match="enabled"):
        model.set_fp32_gemm(1)
