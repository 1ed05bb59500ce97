"""The calculator's activation estimate (mpext.memory.activation_bytes) against the allocator
(mpext.memory.meter.HeapMeter: glibc's heap, not mpext's counters) on the zoo's stock
architectures that the rest of tests/test_memory.py does not fit it to: transformers' GPT-2 with
the hub's ``gelu_new`` (a pointwise chain whose intermediates autograd saves) and the CNN of
tests/zoo.py (Conv2d + BatchNorm + ReLU residual blocks), uncompressed and under
mpext.activations' default compression.

Tolerance: 5% (the issue's bar), one-sided where it can be: the heap holds, besides the saved
tensors, the autograd graph's nodes and, under compression, mpext.activations' Python
bookkeeping (a recipe, a cache entry, weak references per saved tensor: ~50-120 KB on these
models). The shapes are picked so that this is under 4% of the compressed bytes (measured:
GPT-2 1.009 and 1.040, the CNN 1.004 and 1.018); one ffn-wide tensor missing is 9% of the
GPT-2 estimate, one tensor of a CNN block 13%, so such bugs fail. Small widths and a large
batch: many bytes for few FLOPs (CI)."""
import contextlib
import inspect
import json
import sys

import pytest
import torch

from mpext import activations as act
from mpext.memory import activation_bytes, activation_formula, estimate
from mpext.memory.activation_model import ACTIVATIONS, _MLP_ACTIVATIONS
from mpext.memory.meter import HeapMeter

TOL = 0.05

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from zoo import ResBlock  # noqa: E402  (tests/ is not a package)


def _gpt2(b, s, h, L, a, v, attention):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=L, n_embd=h, n_head=a, vocab_size=v, n_positions=s,
                                  attn_implementation=attention, bos_token_id=0,
                                  eos_token_id=0)  # the hub's defaults otherwise: gelu_new, 0.1
    assert cfg.activation_function == "gelu_new" and cfg.resid_pdrop == 0.1
    ids = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
    return (lambda: transformers.GPT2LMHeadModel(cfg)), (ids,), \
        (lambda m, x: m(x[0], labels=x[0]).loss)


def _cnn(n, c, hw, blocks, classes):
    """tests/zoo.py's CNN with ``blocks`` residual blocks of ``c`` channels on hw x hw images."""
    g = torch.Generator().manual_seed(0)
    img = torch.randn(n, 3, hw, hw, generator=g)
    cls = torch.randint(0, classes, (n,), generator=g)
    build = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        *(ResBlock(c) for _ in range(blocks)), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(c, classes))
    return build, (img, cls), \
        (lambda m, x: torch.nn.functional.cross_entropy(m(x[0]).float(), x[1]))


def _heap_held(build, batch, loss_fn, device, compressions):
    """The heap bytes one BF16 training-mode forward leaves alive for the backward, for each of
    ``compressions`` (None, or fp8_saved_tensors' options), after a first uncompressed step
    that warms the allocator (a process's first forward keeps thread pools and caches)."""
    heap = HeapMeter(device)
    torch.manual_seed(0)
    model = build().to(device, torch.bfloat16).train()
    xb = tuple(t.to(device, torch.bfloat16) if t.is_floating_point() else t.to(device)
               for t in batch)
    out = []
    for compress in (None,) + tuple(compressions):
        ctx = contextlib.nullcontext() if compress is None else \
            act.fp8_saved_tensors(params=model, warn_unmatched=False, **compress)
        torch.manual_seed(1)  # the same dropout masks every time
        before = heap()
        with ctx:
            loss = loss_fn(model, xb)
        out.append(heap() - before)
        loss.float().backward()
        del loss
        model.zero_grad(set_to_none=True)
    return out[1:]


def _within(measured, estimated):
    """The heap holds the estimate plus the graph's own objects: at least the estimate (less
    0.5% for the heap's reuse of freed chunks), at most TOL above it."""
    return 0.995 * estimated <= measured <= (1 + TOL) * estimated


# (batch, seq, hidden, layers, heads, vocab): tiny widths, a batch large enough that the
# saved tensors dwarf the graph's objects
_GPT2 = (8, 128, 64, 2, 2, 64)


def test_gpt2_gelu_new_matches_the_allocator(device):
    """HF GPT-2 with the hub's defaults (gelu_new, dropout 0.1, eager attention): the gelu_new
    estimate within TOL of the heap, uncompressed and under the default compression (gelu_new's
    four intermediates recipes over its 8-bit input); the plain-GELU formula, which the
    calculator used for it, is not (it misses three ffn-wide tensors per layer)."""
    b, s, h, L, a, v = _GPT2
    build, batch, loss_fn = _gpt2(b, s, h, L, a, v, "eager")
    off, on = _heap_held(build, batch, loss_fn, device, [None, {}])
    labels = 8 * s * b  # the loss's shifted copy of the labels (int64), made by the HF loss
    est = lambda **kw: activation_bytes(b, s, h, L, a, 2, v, True, attention="eager",  # noqa
                                        device=device, **kw) + labels
    assert _within(off, est(activation="gelu_new")), (off, est(activation="gelu_new"))
    assert _within(on, est(activation="gelu_new", compress=True)), \
        (on, est(activation="gelu_new", compress=True))
    assert not _within(off, est())  # GELU's formula: 27% short here


def test_cnn_matches_the_allocator(device):
    """tests/zoo.py's CNN (Conv2d + BatchNorm + ReLU residual blocks, BF16, training mode):
    the cnn estimate within TOL of the heap, uncompressed and under the default compression,
    with four blocks: the fourth block's output is past the recipes' MAX_OPS chain and is an
    8-bit copy (rows of 16 pixels, coded in blocks of 128 consecutive elements)."""
    n, c, hw, blocks, classes = 32, 32, 16, 4, 10
    off, on = _heap_held(*_cnn(n, c, hw, blocks, classes), device, [None, {}])
    est = lambda **kw: activation_bytes(n, hw * hw, c, blocks, 1, 2, classes,  # noqa: E731
                                        family="cnn", **kw)
    assert _within(off, est()), (off, est())
    assert _within(on, est(compress=True)), (on, est(compress=True))
    assert est(width=hw) == est()


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_mlp_rows_are_what_autograd_saves(name):
    """Each MLP activation's rows (the ffn-wide tensors the calculator counts between the up-
    and the down-projection) against what autograd saves when transformers' own function
    (ACT2FN, what GPT2MLP calls) runs between two linear layers, in BF16: the same number of
    storages, and the estimate's difference to GELU's is their bytes, per layer."""
    transformers = pytest.importorskip("transformers")
    fn = transformers.activations.ACT2FN[name]
    b, s, h, L, a = 2, 16, 8, 3, 2
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.nn.Parameter(torch.randn(*shape, generator=g).bfloat16())
              for shape in ((4 * h, h), (h, 4 * h)))
    x = torch.randn(b, s, h, generator=g).bfloat16()
    seen = {}

    def pack(t):
        if t.numel() == b * s * 4 * h and not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.nn.functional.linear(fn(torch.nn.functional.linear(x, w1)), w2)
    assert len(seen) == len(_MLP_ACTIVATIONS[name])
    per_layer = lambda act_: (activation_bytes(b, s, h, L, a, 2, device="cpu",  # noqa: E731
                                               activation=act_) -
                              activation_bytes(b, s, h, L - 1, a, 2, device="cpu",
                                               activation=act_))
    assert per_layer(name) - per_layer("gelu") == sum(seen.values()) - 2 * b * s * 4 * h * 2
    del y


def test_bad_activation_arguments_are_refused():
    """Each bad argument named, before anything is computed."""
    shape = (2, 16, 8, 2, 2)
    for kw, message in ((dict(activation="gelu_fast"), "activation: the gpt family's MLP"),
                        (dict(activation=None), "activation: the gpt family's MLP"),
                        (dict(activation="relu", family="llama", ffn=20, dropout=False),
                         "activation: only the gpt family's MLP"),
                        (dict(family="cnn"), "heads: the cnn family has no attention"),
                        (dict(width=4), "width: only the cnn family")):
        with pytest.raises(ValueError, match=message):
            activation_bytes(*shape, **kw)
    for kw, message in ((dict(), "width: seq=15 pixels is not a square image"),
                        (dict(width=4), "width: must divide seq"),
                        (dict(width=0), "width"),
                        (dict(dropout=True), "dropout: the cnn formula has no dropout"),
                        (dict(checkpointing=True), "checkpointing: not estimated for the cnn")):
        with pytest.raises(ValueError, match=message):
            activation_bytes(2, 15, 8, 2, 1, family="cnn", **kw)
    with pytest.raises(ValueError, match="activation: the gpt family's MLP activation"):
        activation_formula(2, activation="gelu_fast")


def test_cli_describes_the_cnn_and_checks_the_activation_flags(capsys):
    """``python -m mpext.memory --family cnn``: the estimate of tests/zoo.py's CNN (its
    activations row is activation_bytes' figure) and each misuse named."""
    from mpext.memory.cli import main
    argv = ["--params", "1e5", "--mode", "mpext-bf16", "--family", "cnn", "--batch", "32",
            "--seq", "256", "--hidden", "32", "--layers", "4", "--heads", "1", "--vocab", "10",
            "--json"]
    for extra, compress in (([], None), (["--compress-activations"], True)):
        assert main(argv + extra) == 0
        out = json.loads(capsys.readouterr().out)
        rows = out if isinstance(out, list) else out["results"]
        assert rows[0]["activations"] == activation_bytes(32, 256, 32, 4, 1, 2, 10,
                                                          family="cnn", compress=compress)
    for extra, message in ((["--heads", "2"], "argument --heads: the cnn family has no"),
                           (["--seq", "250"], "argument --seq: the cnn family's --seq"),
                           (["--activation", "relu"], "argument --activation: the gpt family's"),
                           (["--checkpointing"], "argument --checkpointing: not estimated for "
                                                 "the cnn")):
        with pytest.raises(SystemExit):
            main(argv + extra)
        assert message in capsys.readouterr().err


@pytest.mark.skipif("activation" not in inspect.signature(estimate).parameters,
                    reason="needs mpext.memory.estimate(activation=...), the estimator change "
                           "the act_calc branch asked the lead for (estimator.py is not its)")
def test_cli_activation_flag(capsys):
    """``--activation gelu_new``: the gpt family's estimate with gelu_new's rows (the figure
    activation_bytes gives), and its formula says so."""
    from mpext.memory.cli import main
    argv = ["--params", "1e6", "--mode", "mpext-bf16", "--batch", "2", "--seq", "64", "--hidden",
            "128", "--layers", "2", "--heads", "4", "--vocab", "256", "--device", "cpu", "--json"]
    for extra, act_ in (([], "gelu"), (["--activation", "gelu_new"], "gelu_new")):
        assert main(argv + extra) == 0
        out = json.loads(capsys.readouterr().out)
        row = (out if isinstance(out, list) else out["results"])[0]
        assert row["activations"] == activation_bytes(2, 64, 128, 2, 4, 2, 256, True,
                                                      device="cpu", activation=act_)
        assert ("gelu_new MLP" in row["activation_formula"]) == (act_ == "gelu_new")
