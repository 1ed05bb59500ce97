"""mpext.memory: the training-memory calculator.

Hand-computed byte counts for every mode, optimizer and ZeRO stage; the ZeRO paper's own figure;
the activation formula against Korthikanti et al.'s closed form and against a tensor-by-tensor
count; model presets against published parameter counts and against transformers' own models
(per tensor); bad arguments (API and command line); and the agreement check: one real training step
per mode and optimizer on the CPU, the live tensors measured storage by storage and compared
with the estimate (within 10%)."""
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mpext
from mpext import activations, memory
from mpext.memory import MODES, OPTIMIZERS, estimate

from small_gpt import SmallGPT  # the tests' own GPT (tests import nothing from benchmarks/)

REPO = Path(__file__).resolve().parent.parent

# Bytes per param of (weights, gradients, master weights) and per element of an optimizer-state
# tensor, written out per mode by hand. The lean modes (mpext.optim.Adam/AdamW only): a bf16
# param's master as its int16 remainder (2), bf16 moments (2), or no master.
MODE_BYTES = {
    "fp32": (4, 4, 0, 4),
    "amp-bf16": (4, 4, 0, 4),
    "amp-fp16": (4, 4, 0, 4),
    "mpext-bf16": (2, 2, 4, 4),
    "mpext-fp16": (2, 2, 4, 4),
    "mpext-bf16-bf16moments": (2, 2, 4, 2),
    "mpext-bf16-remainder": (2, 2, 2, 4),
    "mpext-bf16-remainder-bf16moments": (2, 2, 2, 2),
    "mpext-bf16-sr-fp32moments": (2, 2, 0, 4),
    "mpext-bf16-sr": (2, 2, 0, 2),
    "mpext-fp16-sr": (2, 2, 0, 2),
}
LEAN = [m for m in MODE_BYTES if m.count("-") >= 2]
# The mpext.optim.Adam/AdamW options of each lean mode, and its param dtype.
LEAN_OPTIONS = {
    "mpext-bf16-bf16moments": (torch.bfloat16, dict(exp_avg_dtype=torch.bfloat16,
                                                    exp_avg_sq_dtype=torch.bfloat16)),
    "mpext-bf16-remainder": (torch.bfloat16, dict(param_remainders=True)),
    "mpext-bf16-remainder-bf16moments": (torch.bfloat16, dict(
        param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
    "mpext-bf16-sr-fp32moments": (torch.bfloat16, dict(master_weights=False,
                                                       stochastic_rounding=True)),
    "mpext-bf16-sr": (torch.bfloat16, dict(master_weights=False, stochastic_rounding=True,
                                           exp_avg_dtype=torch.bfloat16,
                                           exp_avg_sq_dtype=torch.bfloat16)),
    "mpext-fp16-sr": (torch.float16, dict(master_weights=False, stochastic_rounding=True,
                                          exp_avg_dtype=torch.bfloat16,
                                          exp_avg_sq_dtype=torch.bfloat16)),
}
# mpext.optim.Adam/AdamW with 8-bit moments (Adam/AdamW only): (weights, gradients, masters)
# per param, one byte per moment element plus an FP32 scale per block of 256, the options.
Q8 = dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
Q8_MODES = {
    "mpext-bf16-8bit": ((2, 2, 4), torch.bfloat16, dict(Q8)),
    "mpext-bf16-remainder-8bit": ((2, 2, 2), torch.bfloat16, dict(Q8, param_remainders=True)),
    "mpext-bf16-sr-8bit": ((2, 2, 0), torch.bfloat16,
                           dict(Q8, master_weights=False, stochastic_rounding=True)),
    "mpext-fp16-sr-8bit": ((2, 2, 0), torch.float16,
                           dict(Q8, master_weights=False, stochastic_rounding=True)),
}
AUTOCAST_COPY = {m: 2 if m.startswith("amp-") else 0 for m in MODE_BYTES}
SCALER = {m: 8 if m in ("amp-fp16", "mpext-fp16", "mpext-fp16-sr") else 0 for m in MODE_BYTES}
# FP32 param-sized state tensors, from torch.optim's code (names in the comments).
STATES = {
    "adamw": 2, "adam": 2, "nadam": 2, "radam": 2,   # exp_avg, exp_avg_sq
    "adamax": 2,                                      # exp_avg, exp_inf
    "sgd": 0, "sgd-momentum": 1,                      # momentum_buffer
    "adagrad": 1,                                     # sum
    "rmsprop": 1, "rmsprop-momentum": 2,              # square_avg (+ momentum_buffer)
}
# Which components a ZeRO stage partitions (ZeRO paper, section 5.1-5.3).
PARTITIONED = {0: set(), 1: {"master_weights", "optimizer_states"},
               2: {"master_weights", "optimizer_states", "gradients"},
               3: {"master_weights", "optimizer_states", "gradients", "weights"}}


def test_tables_cover_the_calculator():
    assert set(MODE_BYTES) | set(Q8_MODES) == set(MODES)
    assert set(LEAN) == set(LEAN_OPTIONS)
    assert set(STATES) == set(OPTIMIZERS)


@pytest.mark.parametrize("mode", list(MODE_BYTES))
@pytest.mark.parametrize("optimizer", list(STATES))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("params,world", [(4000, 4), (4001, 4), (999, 1)])
def test_hand_computed(mode, optimizer, zero, params, world):
    if mode in LEAN and optimizer not in ("adam", "adamw"):
        with pytest.raises(ValueError, match="mode: %s is mpext.optim.Adam/AdamW's leaner "
                                             "state; the optimizer must be adam or adamw"
                                             % mode):
            estimate(params, optimizer, mode, zero=zero, world_size=world)
        return
    b = estimate(params, optimizer, mode, zero=zero, world_size=world)
    shard = -(-params // world)  # a partition holds ceil(params / world) elements
    w, g, m, st = MODE_BYTES[mode]
    want = {"weights": w, "gradients": g, "master_weights": m,
            "optimizer_states": st * STATES[optimizer]}
    for field, per_param in want.items():
        n = shard if field in PARTITIONED[zero] else params
        assert getattr(b, field) == per_param * n, field
    assert b.scaler == SCALER[mode]
    assert b.autocast_copies == AUTOCAST_COPY[mode] * params  # never partitioned
    # MixedPrecisionOptimizer's generic path (not Adam/AdamW): FP32 master grads in step().
    generic = m > 0 and optimizer not in ("adam", "adamw")
    assert b.step_buffers == (4 * (shard if zero >= 1 else params) if generic else 0)
    assert b.activations is None
    assert b.transient == max(b.autocast_copies, b.step_buffers)
    assert b.persistent == sum(getattr(b, f) for f in want) + SCALER[mode]
    assert b.total == b.persistent + b.transient


def test_numpy_and_float_counts():
    import numpy as np
    assert estimate(np.int64(1000), "adamw", "fp32").persistent == 16000
    assert estimate(7e9, "adamw", "fp32").params == 7_000_000_000
    b = estimate(np.float64(1e3), "sgd", "fp32", world_size=np.int32(2), zero=np.int64(3))
    assert (b.params, b.zero, b.world_size, b.weights) == (1000, 3, 2, 2000)


def test_examples_by_hand():
    # AdamW on 1,000 params, one device.
    assert estimate(1000, "adamw", "fp32").persistent == 16000
    assert estimate(1000, "adamw", "amp-bf16").persistent == 16000
    assert estimate(1000, "adamw", "amp-bf16").total == 18000   # + bf16 weight copies
    assert estimate(1000, "adamw", "mpext-bf16").persistent == 16000  # 2 + 2 + 4 + 8
    assert estimate(1000, "adamw", "mpext-fp16").persistent == 16008  # + scale, tracker
    assert estimate(1000, "sgd", "fp32").persistent == 8000
    assert estimate(1000, "sgd", "mpext-bf16").persistent == 8000     # 2 + 2 + 4
    assert estimate(1000, "sgd", "mpext-bf16").total == 12000  # + FP32 master grads in step()
    # SGD with momentum, mpext fp16, ZeRO-2 over 4: 2000 + 500 + 1000 + 1000 + 8.
    b = estimate(1000, "sgd-momentum", "mpext-fp16", zero=2, world_size=4)
    assert (b.weights, b.gradients, b.master_weights, b.optimizer_states, b.scaler) == \
        (2000, 500, 1000, 1000, 8)
    assert b.persistent == 4508
    assert b.bytes_per_param("persistent") == pytest.approx(4.508)


def test_lean_examples_by_hand():
    """The lean modes' bytes per param with AdamW: 2 + 2 + remainder 2 + moments 8 = 14, with
    bf16 moments 2 + 2 + 2 + 4 = 10, no master + bf16 moments 2 + 2 + 4 = 8; under ZeRO-1 over
    8 devices the remainders and moments are partitioned, the weights and gradients are not."""
    per_param = {m: estimate(1000, "adamw", m).persistent / 1000 for m in LEAN}
    assert per_param == {"mpext-bf16-bf16moments": 12, "mpext-bf16-remainder": 14,
                         "mpext-bf16-remainder-bf16moments": 10,
                         "mpext-bf16-sr-fp32moments": 12, "mpext-bf16-sr": 8,
                         "mpext-fp16-sr": 8.008}
    b = estimate(8000, "adamw", "mpext-bf16-remainder-bf16moments", zero=1, world_size=8)
    assert (b.weights, b.gradients, b.master_weights, b.optimizer_states) == \
        (16000, 16000, 2000, 4000)
    assert b.bytes_per_param("persistent") == pytest.approx(2 + 2 + 6 / 8)


def test_zero_paper_figure_1():
    """The ZeRO paper's Figure 1: 7.5B params, mixed-precision Adam (2 + 2 + K=12 bytes), 64
    devices: 120 GB, then 31.4, 16.6 and 1.9 GB per device for stages 1, 2, 3."""
    psi = 7.5e9
    gb = [estimate(psi, "adamw", "mpext-bf16", zero=z, world_size=64).persistent / 1e9
          for z in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_zero_stage_1_favours_masters_in_the_optimizer():
    # Native AMP's fp32 weights are its masters but are weights, so ZeRO-1 leaves them whole;
    # mpext's masters are optimizer state and get partitioned.
    amp = estimate(7e9, "adamw", "amp-bf16", zero=1, world_size=8)
    mp = estimate(7e9, "adamw", "mpext-bf16", zero=1, world_size=8)
    assert amp.bytes_per_param("persistent") == pytest.approx(4 + 4 + 8 / 8)
    assert mp.bytes_per_param("persistent") == pytest.approx(2 + 2 + 12 / 8)


# ---------------------------------------------------------------------------------------------
# Activations


@pytest.mark.parametrize("b,s,h,L,a", [(1, 2048, 4096, 32, 32), (8, 512, 768, 12, 12),
                                      (3, 7, 10, 1, 5)])
def test_activations_korthikanti_closed_form(b, s, h, L, a):
    """Eager attention on CUDA with 16-bit activations and dropout is the paper's equation 1,
    s*b*h*(34 + 5*a*s/h) per layer, plus what the paper leaves out: the two LayerNorms' mean
    and rstd (8*s*b per layer); outside the layers the final LayerNorm's input, output (the
    head's input) and statistics, the embedding dropout mask, the int64 position indices; with
    a vocabulary the FP32 log-softmax (4*s*b*v) and nll_loss's scalar weight."""
    got = memory.activation_bytes(b, s, h, L, a, act_bytes=2, vocab=None, dropout=True,
                                  attention="eager")
    per_layer = s * b * h * (34 + 5 * a * s / h) + 8 * s * b
    assert got == pytest.approx(L * per_layer + 5 * s * b * h + 4 * s * b + 8 * s, rel=1e-12)
    with_logits = memory.activation_bytes(b, s, h, L, a, act_bytes=2, vocab=1000, dropout=True,
                                          attention="eager")
    assert with_logits - got == 4 * s * b * 1000 + 4


def _saved_tensors(s, b, h, a, d, f, mask, attention):
    """The tensors a pre-LayerNorm GPT layer keeps for its backward, listed one by one:
    (elements, bytes per element). ``f`` is the norms' and softmax's dtype, ``d`` the matrix
    products' (they differ under autocast)."""
    sbh, ass = s * b * h, a * s * s * b
    out = [(sbh, f), (2 * s * b, f),       # LayerNorm 1: input, mean and rstd
           (sbh, d),                       # its output: the QKV projection's input
           (3 * sbh, d),                   # q, k, v
           (sbh, d),                       # the attention output: the out-projection's input
           (sbh, mask),                    # the residual dropout's mask
           (sbh, f), (2 * s * b, f),       # LayerNorm 2
           (sbh, d),                       # the MLP's input
           (4 * sbh, d), (4 * sbh, d),     # GELU input and output (the second linear's input)
           (sbh, mask)]                    # the MLP's dropout mask
    if attention == "sdpa":
        out += [(a * s * b, 4)]            # the fused kernel's log-sum-exp (float32)
    else:
        out += [(ass, f),                  # softmax output
                (ass, d if mask or d != f else 0),  # its copy for P @ V (dropout's or a cast)
                (ass, mask)]               # the attention dropout's mask
    return sum(n * size for n, size in out)


@pytest.mark.parametrize("d,f", [(2, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("dropout", [True, False])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_activations_tensor_by_tensor(d, f, dropout, attention):
    b, s, h, L, a = 2, 64, 96, 3, 4
    m = 1 if dropout else 0
    per_layer = _saved_tensors(s, b, h, a, d, f, m, attention)
    outside = s * b * h * (f + d + m) + 2 * s * b * f + 8 * s
    assert memory.activation_bytes(b, s, h, L, a, act_bytes=d, dropout=dropout, norm_bytes=f,
                                   attention=attention) == L * per_layer + outside


# What autograd really saves, seen by torch's saved-tensor hooks: the reference the formula is
# checked against (the formula is not re-run here).


class _SavedBytes:
    """A pack hook summing the bytes autograd keeps for the backward, each storage once, the
    parameters (and their views and casts: autocast's weight copies, counted apart as
    autocast_copies) and the batch left out. With ``ctx`` (an active
    ``mpext.activations.fp8_saved_tensors``) it holds what that context's pack hook returns,
    and counts each compressed object once by the storages of the tensors it keeps."""

    _VIEW_OR_CAST = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                     "PermuteBackward0", "ExpandBackward0", "UnsafeViewBackward0",
                     "AliasBackward0"}

    def __init__(self, model, batch, ctx=None):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.skip |= {t.untyped_storage().data_ptr() for t in batch}
        self.seen, self.bytes, self.ctx, self.packed = set(), 0, ctx, set()

    def _of_a_param(self, t):
        fn = t.grad_fn
        while fn is not None and fn.name() in self._VIEW_OR_CAST:
            nexts = [g for g, _ in fn.next_functions if g is not None]
            if len(nexts) != 1:
                return False
            fn = nexts[0]
        return fn is not None and type(fn).__name__ == "AccumulateGrad"

    def pack(self, t):
        stored = t if self.ctx is None else self.ctx.pack(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or self._of_a_param(t):
            return stored
        if isinstance(stored, torch.Tensor):
            if ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
        elif id(stored) not in self.packed:  # every tensor the compressed object holds
            self.packed.add(id(stored))
            self.bytes += sum(v.untyped_storage().nbytes() for v in
                              (getattr(stored, k, None) for k in stored.__slots__)
                              if isinstance(v, torch.Tensor))
        return stored

    @staticmethod
    def unpack(t):
        return t if isinstance(t, torch.Tensor) else t.restore()


# mode -> (model dtype, autocast dtype): the three ways the calculator's modes run a forward
_RUNS = {"fp32": (torch.float32, None), "amp-bf16": (torch.float32, torch.bfloat16),
         "mpext-bf16": (torch.bfloat16, None)}


def _measure_saved(model, batch, loss_fn, mode, compress=None):
    """The saved bytes of one forward in ``mode``; with ``compress`` (a dict of
    mpext.activations.fp8_saved_tensors' options) under that compression."""
    dtype, amp = _RUNS[mode]
    model = model.to(dtype).train()
    ctx = contextlib.nullcontext() if compress is None else activations.fp8_saved_tensors(
        params=model, warn_unmatched=False, **compress)
    with ctx:
        meter = _SavedBytes(model, batch, None if compress is None else ctx)
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None), \
                torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            loss = loss_fn(model, *batch)
    loss.backward()  # the graph was whole: every saved tensor is used
    return meter.bytes


def _estimated(mode, b, s, h, L, a, v, **kw):
    return estimate(10 ** 6, "adamw", mode, batch=b, seq=s, hidden=h, layers=L, heads=a,
                    vocab=v, device="cpu", **kw).activations


# (batch, seq, hidden, layers, heads, vocab): two shapes per model
_SHAPES = [(2, 32, 64, 1, 4, 42), (3, 48, 96, 2, 3, 50)]
# mpext.activations' compressions the estimate is checked under (None: none): every policy,
# the size threshold cutting between tensors, and the most lossy options with short blocks
# (48: rows of 64 and 96 end in a partial block) and every tensor eligible
_COMPRESS = [None, {}, dict(policy="linear"), dict(policy="size", min_bytes=20000),
             dict(policy="size", min_bytes=1, min_numel=1, block_size=48,
                  fp8_dtype=torch.float8_e5m2, pow2_scale=True, stochastic=True)]


@pytest.mark.parametrize("mode", list(_RUNS))
@pytest.mark.parametrize("shape", _SHAPES)
def test_activations_equal_a_gpts_saved_tensors(mode, shape):
    """tests/small_gpt.py's GPT (the benchmarks' layout, SDPA attention, no dropout): exactly."""
    b, s, h, L, a, v = shape
    torch.manual_seed(0)
    model = SmallGPT(v, s, h, L, a)
    x, y = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))
    for compress in _COMPRESS:
        got = _measure_saved(model, (x, y), lambda m, x, y: m(x, y), mode, compress)
        assert got == _estimated(mode, *shape, dropout=False, compress=compress), compress


@pytest.mark.parametrize("mode", list(_RUNS))
@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activations_equal_hf_gpt2s_saved_tensors(mode, shape, attention, dropout):
    """transformers' GPT2LMHeadModel (a small config, nothing downloaded), fused GELU, eager
    and SDPA attention, with and without dropout: exactly, but for the loss's shifted copy of
    the labels (int64, 8*s*b bytes, which a model that is given its targets does not make)."""
    transformers = pytest.importorskip("transformers")
    b, s, h, L, a, v = shape
    cfg = transformers.GPT2Config(
        n_layer=L, n_embd=h, n_head=a, vocab_size=v, n_positions=s, use_cache=False,
        attn_implementation=attention, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, activation_function="gelu_pytorch_tanh", bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, v, (b, s))
    for compress in _COMPRESS:
        got = _measure_saved(model, (x,), lambda m, x: m(x, labels=x).loss, mode, compress)
        want = _estimated(mode, *shape, dropout=dropout > 0, attention=attention,
                          compress=compress)
        assert got - want == 8 * s * b, compress
        if compress is None:  # the stated tolerance: the labels' copy is under 1%
            assert abs(got / want - 1) <= 0.01


def test_compression_options_are_fp8_saved_tensors():
    """``compress`` stands for mpext.activations.fp8_saved_tensors' options, its defaults
    included; what changes no byte is accepted, what no estimate can know is refused."""
    defaults = memory.activation_compression(True)
    ctx = activations.fp8_saved_tensors()
    assert {k: defaults[k] for k in ("policy", "block_size", "min_bytes", "min_numel",
                                     "fp8_dtype")} == dict(
        policy=ctx.policy, block_size=ctx.block_size, min_bytes=ctx.min_bytes,
        min_numel=ctx.min_numel, fp8_dtype=ctx.fp8_dtype)
    assert memory.activation_compression(None) is None
    assert memory.activation_compression(False) is None
    assert memory.activation_compression("size") == dict(defaults, policy="size")
    shape = (2, 64, 96, 3, 4)
    lossy = dict(policy="size", fp8_dtype=torch.float8_e5m2, pow2_scale=True, stochastic=True,
                 seed=3, warn_unmatched=False)
    assert memory.activation_bytes(*shape, compress=lossy) == \
        memory.activation_bytes(*shape, compress="size")
    # every policy saves bytes here, the default ("all") more than "layers", "layers" more
    # than "linear"; blocks of 1 cost 5 B a value
    off, every, layers, linear = (memory.activation_bytes(*shape, vocab=1000, compress=c)
                                  for c in (None, True, "layers", "linear"))
    assert every < layers < linear < off
    assert memory.activation_compression(True)["policy"] == "all"
    assert memory.activation_bytes(*shape, vocab=1000, compress=dict(block_size=2)) > every
    for bad, exc, match in [
            (dict(policy=lambda t: True), ValueError, "a callable policy decides per tensor"),
            ("every", ValueError, "policy must be one of all, layers, linear, size"),
            (dict(block=64), ValueError, "unknown option.s. block"),
            (dict(block_size=0), ValueError, "compress: block_size: must be >= 1"),
            (dict(min_bytes=-1), ValueError, "compress: min_bytes: must be >= 0"),
            (3, TypeError, "compress: None, True, a policy name or a dict")]:
        with pytest.raises(exc, match=match):
            memory.activation_bytes(*shape, compress=bad)
    with pytest.raises(ValueError, match="heads: the compressed estimate splits hidden=96 "
                                         "into 5 heads"):
        memory.activation_bytes(2, 64, 96, 3, 5, compress=True)
    with pytest.raises(ValueError, match="compress: only used by the activation estimate"):
        estimate(10 ** 6, compress=True)
    with pytest.raises(ValueError, match="shape: the compressed formula depends"):
        memory.activation_formula(2, compress=True)
    # the formula's text: what stays, and fp8(n, c) of what the policy compresses
    text = estimate(10 ** 6, batch=2, seq=64, hidden=96, layers=3, heads=4,
                    compress="layers").activation_formula
    # hidden 96 and heads of 24: rows shorter than a block, quantized as rows of 128
    assert text.startswith("layers*(8*s*b + 4*a*s*b + fp8(8*s*b*h, 128) + fp8(4*s*b*h, 4*h) + "
                           "bits(2*s*b*h)) + ") and \
        "fp8(n, c) = n + 4*(n/c)*ceil(c/128)" in text and "policy 'layers'" in text


def test_activation_options_are_checked():
    for kw, match in [(dict(attention="flash"), "attention: must be one of sdpa, eager"),
                      (dict(device="tpu"), "device: must be one of cuda, cpu"),
                      (dict(norm_bytes=8), "norm_bytes: must be 2 or 4")]:
        with pytest.raises(ValueError, match=match):
            memory.activation_bytes(2, 8, 16, 1, 2, **kw)
    with pytest.raises(ValueError, match="attention"):
        estimate(10 ** 6, batch=2, seq=8, hidden=16, layers=1, heads=2, attention="flash")


def test_activations_follow_the_mode():
    shape = dict(batch=2, seq=64, hidden=96, layers=3, heads=4, vocab=42)
    by_mode = {m: estimate(10 ** 6, "adamw", m, **shape).activations for m in MODE_BYTES}
    want16 = memory.activation_bytes(2, 64, 96, 3, 4, act_bytes=2, vocab=42)
    want32 = memory.activation_bytes(2, 64, 96, 3, 4, act_bytes=4, vocab=42)
    # native AMP: 16-bit products over an FP32 residual stream, norms and softmax
    amp = memory.activation_bytes(2, 64, 96, 3, 4, act_bytes=2, norm_bytes=4, vocab=42)
    assert want16 < amp < want32
    assert by_mode == dict({"fp32": want32, "amp-bf16": amp, "amp-fp16": amp,
                            "mpext-bf16": want16, "mpext-fp16": want16},
                           **{m: want16 for m in LEAN})
    b = estimate(10 ** 6, "adamw", "amp-bf16", zero=3, world_size=8, **shape)
    assert b.activations == amp  # not divided by ZeRO
    assert b.total == b.persistent + amp + 2 * 10 ** 6


# ---------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("name,count", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200), ("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320)])
def test_presets_published_counts(name, count):
    assert memory.MODELS[name].params == count


def _hf_sizes(model):
    """(name, numel) of a transformers model's parameters, its top-level prefix dropped."""
    return [(n.split(".", 1)[1] if n.startswith("transformer.") else n, p.numel())
            for n, p in model.named_parameters()]


def test_preset_tensors_are_transformers_models():
    """A preset's per-tensor sizes are those of transformers' model of the same config (built on
    the meta device: no weights, nothing downloaded), tensor by tensor."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=1000, tie_word_embeddings=False))
    spec = memory.model_spec("gpt2")
    assert _hf_sizes(gpt2) == [(n, math.prod(s)) for n, s in memory.gpt_shapes(12, 768, 50257,
                                                                                1024)]
    assert list(spec.sizes) == [k for _, k in _hf_sizes(gpt2)]
    assert _hf_sizes(llama) == [(n, math.prod(s)) for n, s in memory.llama_shapes(2, 256, 688,
                                                                                  1000)]
    assert sum(memory.model_spec("llama-7b").sizes) == memory.model_spec("llama-7b").params
    with pytest.raises(ValueError, match="model: unknown model 'bench-tiny'"):
        memory.model_spec("bench-tiny")  # benchmark models are no presets


# ---------------------------------------------------------------------------------------------
# Bad arguments (API)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(params=-5), ValueError, "params: must be >= 1"),
    (dict(params=0), ValueError, "params: must be >= 1"),
    (dict(params=1.5), ValueError, "params: must be a whole number"),
    (dict(params=float("inf")), ValueError, "params: must be a whole number"),
    (dict(params="7e9"), TypeError, "params: must be an integer"),
    (dict(params=True), TypeError, "params: must be an integer"),
    (dict(params=10, mode="amp-int8"), ValueError, "mode: unknown mode 'amp-int8'"),
    (dict(params=10, mode=["fp32"]), ValueError, r"mode: unknown mode \['fp32'\]"),
    (dict(params=10, optimizer="lamb"), ValueError, "optimizer: unknown optimizer 'lamb'"),
    (dict(params=10, optimizer="sgd", mode="mpext-bf16-sr"), ValueError,
     "mode: mpext-bf16-sr is mpext.optim.Adam/AdamW's leaner state; the optimizer must be "
     "adam or adamw, got 'sgd'"),
    (dict(params=10, zero=4), ValueError, "zero: the ZeRO stage must be 0, 1, 2 or 3"),
    (dict(params=10, zero=1.0), ValueError, "zero: the ZeRO stage"),
    (dict(params=10, world_size=0), ValueError, "world_size: must be >= 1"),
    (dict(params=10, batch=2, seq=8), ValueError, "missing hidden, layers, heads"),
    (dict(params=10, vocab=42), ValueError, "vocab: only used by the activation estimate"),
    (dict(params=10, batch=1, seq=8, hidden=4, layers=1, heads=8), ValueError,
     "heads: 8 heads cannot exceed hidden=4"),
    (dict(params=10, batch=1, seq=-8, hidden=4, layers=1, heads=2), ValueError,
     "seq: must be >= 1"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        estimate(**kwargs)


# ---------------------------------------------------------------------------------------------
# Command line


def run_main(capsys, *argv):
    code = memory.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_table(capsys):
    code, out, _ = run_main(capsys, "--params", "7B", "--mode", "fp32,mpext-bf16",
                            "--zero", "0,3", "--world-size", "8")
    assert code == 0
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("| per device"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == \
        ["fp32", "fp32 ZeRO-3/8", "mpext-bf16", "mpext-bf16 ZeRO-3/8"]
    row = {c.split("|")[1].strip(): [x.strip() for x in c.strip().strip("|").split("|")[1:]]
           for c in lines if c.startswith("| ")}
    gib = 7e9 / 2 ** 30
    assert row["weights"] == ["%.3g (4)" % (4 * gib), "%.3g (0.5)" % (0.5 * gib),
                              "%.3g (2)" % (2 * gib), "%.3g (0.25)" % (0.25 * gib)]
    assert row["**persistent**"][0] == "%.3g (16)" % (16 * gib)
    assert row["activations (per step)"] == ["—"] * 4
    assert "not estimated" in out


def test_cli_json_matches_api(capsys):
    code, out, _ = run_main(capsys, "--model", "gpt2", "--batch", "4", "--optimizer", "sgd",
                            "--mode", "all", "--json")
    assert code == 0
    data = json.loads(out)
    # 'all' is every mode the optimizer has: not the lean ones (mpext.optim.Adam/AdamW's)
    assert [r["mode"] for r in data["results"]] == [m for m in MODES
                                                    if m not in LEAN and m not in Q8_MODES]
    spec = memory.MODELS["gpt2"]
    for r in data["results"]:
        want = estimate(spec.params, "sgd", r["mode"], batch=4, seq=spec.seq, hidden=spec.hidden,
                        layers=spec.layers, heads=spec.heads, vocab=spec.vocab)
        assert r["total"] == want.total and r["activations"] == want.activations
        assert r["bytes_per_param"]["persistent"] == pytest.approx(want.persistent / spec.params)


def test_cli_attention_and_device(capsys):
    args = ("--model", "gpt2", "--batch", "2", "--mode", "amp-bf16,mpext-bf16", "--json")
    for extra, kw in [((), {}), (("--attention", "eager"), dict(attention="eager")),
                      (("--device", "cpu", "--no-dropout"), dict(device="cpu", dropout=False)),
                      (("--compress-activations",), dict(compress=True)),
                      (("--compress-activations", "size", "--compress-min-bytes", "5000000",
                        "--compress-block-size", "64", "--attention", "eager"),
                       dict(compress=dict(policy="size", min_bytes=5000000, block_size=64),
                            attention="eager"))]:
        code, out, _ = run_main(capsys, *(args + extra))
        assert code == 0
        spec = memory.MODELS["gpt2"]
        for r in json.loads(out)["results"]:
            want = estimate(list(spec.sizes), "adamw", r["mode"], batch=2, seq=spec.seq,
                            hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                            vocab=spec.vocab, **kw)
            assert r["activations"] == want.activations


def test_cli_default_modes(capsys):
    """Without --mode (or with 'all'): every mode the optimizer has, the lean ones with
    Adam/AdamW only."""
    for argv, want in ((["--params", "1e6"], list(MODES)),
                       (["--params", "1e6", "--optimizer", "adam", "--mode", "all"], list(MODES)),
                       (["--params", "1e6", "--optimizer", "rmsprop"],
                        [m for m in MODES if m not in LEAN and m not in Q8_MODES])):
        code, out, _ = run_main(capsys, *argv, "--json")
        assert code == 0 and [r["mode"] for r in json.loads(out)["results"]] == want, argv


def test_cli_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="the --png chart needs matplotlib")
    path = tmp_path / "mem.png"
    code, _, err = run_main(capsys, "--params", "1e6", "--png", str(path))
    assert code == 0 and "wrote" in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_png_path_without_extension(capsys, tmp_path):
    """The chart goes to exactly the path given, and the message names that file."""
    pytest.importorskip("matplotlib", reason="the --png chart needs matplotlib")
    path = tmp_path / "mem"
    code, _, err = run_main(capsys, "--params", "1e6", "--png", str(path))
    assert code == 0 and "wrote %s" % path in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "mem.png").exists()


def test_cli_png_missing_folder(capsys, tmp_path):
    path = tmp_path / "no" / "such" / "mem.png"
    with pytest.raises(SystemExit) as e:
        memory.main(["--params", "1e6", "--png", str(path)])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert "argument --png: the folder %s does not exist" % path.parent in out.err
    assert out.out == ""  # rejected before anything is printed


def test_cli_png_into_a_folder(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        memory.main(["--params", "1e6", "--png", str(tmp_path)])
    assert e.value.code == 2
    assert "argument --png: %s is a folder" % tmp_path in capsys.readouterr().err


def test_cli_png_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit) as e:
        memory.main(["--params", "1e6", "--png", str(tmp_path / "mem.png")])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert "argument --png: needs matplotlib" in out.err and out.out == ""
    assert not (tmp_path / "mem.png").exists()


CLI_ERRORS = [
    (["--params", "-7e9"], "argument --params: must be >= 1, got '-7e9'"),
    (["--params", "-7B"], "argument --params: must be >= 1, got '-7B'"),
    (["--params", "0"], "argument --params: must be >= 1, got '0'"),
    (["--params", "7.5"], "argument --params: must be a whole number"),
    (["--params", "lots"], "argument --params: not a number: 'lots'"),
    (["--params", "1e6", "--mode", "fp8"], "argument --mode: unknown mode 'fp8'"),
    (["--params", "1e6", "--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
    (["--params", "1e6", "--optimizer", "sgd", "--mode", "fp32,mpext-bf16-remainder"],
     "argument --mode: mpext-bf16-remainder is mpext.optim.Adam/AdamW's leaner state, not "
     "available with --optimizer sgd"),
    (["--params", "1e6", "--zero", "4"], "argument --zero: ZeRO stage must be 0, 1, 2 or 3"),
    (["--params", "1e6", "--world-size", "0"], "argument --world-size: must be >= 1"),
    (["--params", "1e6", "--batch", "2"], "needs --seq, --hidden, --layers, --heads as well"),
    (["--params", "1e6", "--vocab", "42"], "argument --vocab: only used with"),
    (["--model", "gpt2", "--batch", "1", "--heads", "1000"], "argument --heads: 1000 heads"),
    ([], "one of the arguments --params --model is required"),
    (["--params", "1e6", "--model", "gpt2"], "not allowed with argument"),
    (["--model", "gpt2", "--batch", "1", "--attention", "flash"],
     "argument --attention: invalid choice: 'flash'"),
    (["--model", "gpt2", "--batch", "1", "--device", "tpu"],
     "argument --device: invalid choice: 'tpu'"),
    (["--model", "gpt2", "--compress-activations"],
     "argument --compress-activations: only used with the activation shape"),
    (["--model", "gpt2", "--batch", "1", "--compress-activations", "every"],
     "argument --compress-activations: invalid choice: 'every'"),
    (["--model", "gpt2", "--batch", "1", "--compress-block-size", "64"],
     "argument --compress-block-size: only with --compress-activations"),
    (["--model", "gpt2", "--batch", "1", "--compress-activations", "--compress-min-bytes", "9"],
     "argument --compress-min-bytes: the size policy's threshold, only with "
     "--compress-activations size"),
    (["--model", "gpt2", "--batch", "1", "--compress-activations", "--compress-block-size",
      "0"], "argument --compress-block-size: must be >= 1"),
    (["--params", "1e6", "--batch", "1", "--seq", "8", "--hidden", "8", "--layers", "1",
      "--heads", "3", "--compress-activations"], "argument --heads: --compress-activations "
     "needs heads that divide --hidden 8"),
]


def _python_m(*argv):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mpext.memory", *argv], capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=120)


def test_python_m_runs():
    ok = _python_m("--model", "llama-7b", "--mode", "amp-bf16,mpext-bf16")
    assert ok.returncode == 0, ok.stderr
    assert "llama-7b" in ok.stdout and "| **persistent**" in ok.stdout
    bad = _python_m("--params", "-1")
    assert bad.returncode == 2 and "argument --params: must be >= 1" in bad.stderr


@pytest.mark.parametrize("doc", ["README.md", "docs/memory.md"])
def test_documented_output_is_the_real_output(capsys, doc):
    """Every ``$ python -m mpext.memory ...`` block of the docs shows what that command prints."""
    text = (REPO / doc).read_text()
    blocks = re.findall(r"```console\n\$ python -m mpext\.memory ([^\n]*)\n(.*?)```", text, re.S)
    assert blocks, "no command output shown in %s" % doc
    for argv, shown in blocks:
        code, out, _ = run_main(capsys, *argv.split())
        assert code == 0 and out == shown, argv


# ---------------------------------------------------------------------------------------------
# measure(): the live-tensor count, by hand on a tiny model


def test_measure_by_hand():
    lin = nn.Linear(3, 2)  # 8 params
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    got = memory.measure(lin.parameters(), opt)
    assert got["weights"] == 32 and got["gradients"] == 32
    assert got["optimizer_states"] == 64 and got["master_weights"] == 0
    assert got["other"] == 2 * 4  # the two float32 step scalars

    low = nn.Linear(3, 2).to(torch.bfloat16)
    mopt = mpext.optim.AdamW(low.parameters())
    low(torch.ones(1, 3, dtype=torch.bfloat16)).float().sum().backward()
    mopt.step()
    got = memory.measure(low.parameters(), mopt)
    assert (got["weights"], got["gradients"], got["master_weights"],
            got["optimizer_states"]) == (16, 16, 32, 64)


# ---------------------------------------------------------------------------------------------
# Agreement with one real training step


def _make_optimizer(name, params):
    lr = 1e-3
    return {
        "adamw": lambda: torch.optim.AdamW(params, lr=lr),
        "adam": lambda: torch.optim.Adam(params, lr=lr),
        "nadam": lambda: torch.optim.NAdam(params, lr=lr),
        "radam": lambda: torch.optim.RAdam(params, lr=lr),
        "adamax": lambda: torch.optim.Adamax(params, lr=lr),
        "sgd": lambda: torch.optim.SGD(params, lr=lr),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=lr),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=lr),
        "rmsprop-momentum": lambda: torch.optim.RMSprop(params, lr=lr, momentum=0.9),
    }[name]()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 64))


def _mixed_precision_optimizer():
    cls = getattr(mpext, "MixedPrecisionOptimizer", None)
    if cls is None:
        from mpext.amp.mixed_precision import MixedPrecisionOptimizer as cls
    return cls


def _one_step(mode, optimizer, wrapper=False):
    """One real training step in ``mode``; returns (model, optimizer object, scaler). mpext
    modes use mpext.optim.Adam/AdamW (masters in their state) or, with ``wrapper``, the torch
    optimizer inside mpext.MixedPrecisionOptimizer (masters as its params)."""
    model = _model()
    x = torch.randn(16, 64)
    y = torch.randn(16, 64)
    scaler = None
    if mode in ("fp32", "amp-bf16", "amp-fp16"):
        opt = _make_optimizer(optimizer, list(model.parameters()))
        if mode == "amp-fp16":
            scaler = torch.amp.GradScaler("cpu")
        dtype = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(mode)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = (model(x).float() - y).pow(2).mean()
        _backward_step(loss, opt, scaler)
        return model, opt, scaler
    dtype, options = LEAN_OPTIONS.get(mode, (torch.bfloat16 if mode == "mpext-bf16"
                                             else torch.float16, {}))
    model = model.to(dtype)
    loss = (model(x.to(dtype)).float() - y).pow(2).mean()
    if wrapper:
        opt = _mixed_precision_optimizer()(
            _make_optimizer(optimizer, list(model.parameters())),
            loss_scale="dynamic" if mode == "mpext-fp16" else None)
        opt.backward(loss)
        opt.step()
        return model, opt, None
    opt = {"adamw": mpext.optim.AdamW, "adam": mpext.optim.Adam}[optimizer](model.parameters(),
                                                                          **options)
    if dtype == torch.float16:
        scaler = mpext.GradScaler("cpu")
    _backward_step(loss, opt, scaler)
    return model, opt, scaler


def _backward_step(loss, opt, scaler):
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


AGREEMENT = [(m, o, False) for m in ("fp32", "amp-bf16", "amp-fp16") for o in STATES] + \
    [(m, o, False) for m in ["mpext-bf16", "mpext-fp16"] + LEAN for o in ("adamw", "adam")] + \
    [(m, o, True) for m in ("mpext-bf16", "mpext-fp16") for o in STATES]


@pytest.mark.parametrize("mode,optimizer,wrapper", AGREEMENT)
def test_agreement_with_a_real_step(mode, optimizer, wrapper):
    """The live tensors after one real step (params, grads, optimizer state with masters or
    remainders, scaler), storage by storage, against the estimate: within 10% in total, and the
    large components exact (for the lean modes: mpext.optim's state in the mode's dtypes)."""
    model, opt, scaler = _one_step(mode, optimizer, wrapper)
    if mode in LEAN:  # the state is the mode's, not mpext's defaults
        dtype, options = LEAN_OPTIONS[mode]
        moment = options.get("exp_avg_dtype", torch.float32)
        for p in model.parameters():
            st = opt.state[p]
            assert p.dtype == dtype and st["exp_avg"].dtype == st["exp_avg_sq"].dtype == moment
            assert ("param_remainder" in st) == options.get("param_remainders", False)
            assert ("master_param" in st) == (options.get("master_weights", True)
                                              and not options.get("param_remainders", False))
    got = memory.measure(model.parameters(), opt, scaler)
    n = sum(p.numel() for p in model.parameters())
    want = estimate(n, optimizer, mode)
    measured = sum(got.values())
    assert abs(measured - want.persistent) <= 0.10 * want.persistent, (got, want)
    assert got["weights"] == want.weights
    assert got["gradients"] == want.gradients  # the wrapper's FP32 master grads are freed
    assert got["master_weights"] == want.master_weights
    assert got["optimizer_states"] == want.optimizer_states
    assert got["scaler"] >= want.scaler  # scale and growth tracker (+ mpext extras)


TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=500)


def _tiny_gpt2_step(mode):
    """One real AdamW step of transformers' GPT-2 (``TINY_GPT2``: its head tied to its
    embedding, its norms and biases under MIN_8BIT_NUMEL) in ``mode``; returns (model,
    optimizer, scaler)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **TINY_GPT2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, TINY_GPT2["vocab_size"], (2, TINY_GPT2["n_positions"]))
    if mode in ("fp32", "amp-bf16", "amp-fp16"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu") if mode == "amp-fp16" else None
        dtype = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(mode)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(ids, labels=ids).loss
    else:
        dtype, options = (Q8_MODES[mode][1:] if mode in Q8_MODES else LEAN_OPTIONS.get(
            mode, (torch.float16 if "fp16" in mode else torch.bfloat16, {})))
        model.to(dtype)
        opt = mpext.optim.AdamW(model.parameters(), lr=1e-3, **options)
        scaler = mpext.GradScaler("cpu") if dtype == torch.float16 else None
        loss = model(ids, labels=ids).loss.float()
    _backward_step(loss, opt, scaler)
    return model, opt, scaler


@pytest.mark.parametrize("mode", list(MODES))
def test_agreement_tied_gpt2(mode):
    """transformers' tiny GPT-2 after one step, every mode: the live tensors equal the estimate
    of its per-tensor sizes (``gpt_shapes``), component by component, the tied head counted
    once and the small tensors' FP32 moments in the 8-bit modes."""
    model, opt, scaler = _tiny_gpt2_step(mode)
    sizes = [math.prod(shape) for _, shape in memory.gpt_shapes(
        TINY_GPT2["n_layer"], TINY_GPT2["n_embd"], TINY_GPT2["vocab_size"],
        TINY_GPT2["n_positions"])]
    assert sorted(sizes) == sorted(p.numel() for p in model.parameters())
    got = memory.measure(model.parameters(), opt, scaler)
    want = estimate(sizes, "adamw", mode)
    for field in ("weights", "gradients", "master_weights", "optimizer_states"):
        assert got[field] == getattr(want, field), (field, got, want)
    assert got["scaler"] >= want.scaler


def test_cli_model_counts_each_tensor():
    """``--model NAME`` estimates the model's tensors, not its bare count: in an 8-bit mode the
    FP32 moments of GPT-2's norms and biases are counted, as transformers' GPT-2 has them."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        sizes = [p.numel() for p in transformers.GPT2LMHeadModel(
            transformers.GPT2Config()).parameters()]
    out = _python_m("--model", "gpt2", "--mode", "mpext-bf16-sr-8bit,mpext-bf16-sr",
                    "--zero", "0,1", "--world-size", "4", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["results"]
    for r in got:
        want = estimate(sizes, "adamw", r["mode"], zero=r["zero"], world_size=4)
        assert r["optimizer_states"] == want.optimizer_states and r["total"] == want.total
    bare = estimate(sum(sizes), "adamw", "mpext-bf16-sr-8bit")
    assert got[0]["optimizer_states"] > bare.optimizer_states


@pytest.mark.parametrize("mode", list(Q8_MODES))
def test_q8_under_fsdp2_counts_the_blocks_each_shard_touches(capsys, mode):
    """Under FSDP2 a rank keeps its shard's codes and the scales of every block of the whole
    tensor its shard touches: a 67 x 64 weight over 4 ranks (rows 17, 17, 17, 16: elements
    [0, 1088), [1088, 2176), [2176, 3264), [3264, 4288)) touches blocks 0-4, 4-8, 8-12 and
    12-16, five each (20 scales where one process keeps 17); the 67-element bias keeps FP32
    moments."""
    for r, (lo, hi) in enumerate([(0, 1088), (1088, 2176), (2176, 3264), (3264, 4288)]):
        touched = (hi - 1) // 256 - lo // 256 + 1
        bias = min(17, 67 - 17 * r) * 4
        got = estimate([(67, 64), (67,)], "adamw", mode, zero=3, world_size=4,
                       sharding="torch", rank=r)
        assert touched == 5 and got.optimizer_states == 2 * ((hi - lo) + 4 * touched + bias)
    even = estimate(67 * 64, "adamw", mode, zero=3, world_size=4)  # one partition of 1072
    assert even.optimizer_states == 2 * (1072 + 4 * 5)
    code, out, _ = run_main(capsys, "--params", "1e6", "--mode", mode, "--zero", "2,3",
                            "--world-size", "4")
    assert code == 0 and "%s ZeRO-3/4" % mode in out.split("\n")[2]


# ---------------------------------------------------------------------------------------------
# 8-bit moments (mpext.optim.Adam/AdamW)


@pytest.mark.parametrize("mode", list(Q8_MODES))
@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("params,world", [(4096, 4), (4001, 4), (999, 1)])
def test_q8_hand_computed(mode, zero, params, world):
    b = estimate(params, "adamw", mode, zero=zero, world_size=world)
    shard = -(-params // world)
    w, g, m = Q8_MODES[mode][0]
    n_state = shard if zero >= 1 else params
    want = {"weights": w * (shard if zero >= 3 else params),
            "gradients": g * (shard if zero >= 2 else params),
            "master_weights": m * n_state,
            # two moments: a byte per element, 4 bytes per block of 256
            "optimizer_states": 2 * (n_state + 4 * -(-n_state // 256))}
    for field, value in want.items():
        assert getattr(b, field) == value, field


def test_q8_budgets():
    """The issue's budgets per param, with AdamW: master-free stochastic rounding + 8-bit
    moments 2 + 2 + 2 * (1 + 4/256) = 6.03 <= 6.1; remainder + 8-bit 8.03 <= 8.1."""
    per = {m: estimate(256 * 10 ** 6, "adamw", m).persistent / (256 * 10 ** 6) for m in Q8_MODES}
    assert per == {"mpext-bf16-8bit": 10.03125, "mpext-bf16-remainder-8bit": 8.03125,
                   "mpext-bf16-sr-8bit": 6.03125, "mpext-fp16-sr-8bit": 6.03125 + 8 / 256e6}
    assert per["mpext-bf16-sr-8bit"] <= 6.1 and per["mpext-bf16-remainder-8bit"] <= 8.1


def test_q8_modes_need_adam():
    with pytest.raises(ValueError, match="mode: mpext-bf16-sr-8bit is mpext.optim.Adam/AdamW's "
                                         "leaner state; the optimizer must be adam or adamw, got "
                                         "'sgd'"):
        estimate(10, "sgd", "mpext-bf16-sr-8bit")


def test_measure_counts_state_whatever_its_keys():
    """Every per-param state tensor but the scalars is optimizer state, whatever a format names
    its keys (8-bit codes and block scales renamed here): the measurement follows no key names."""
    _, dtype, options = Q8_MODES["mpext-bf16-sr-8bit"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64)).to(dtype)
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-3, **options)
    _backward_step((model(torch.randn(4, 64, dtype=dtype)).float() - 1).pow(2).mean(), opt, None)
    want = memory.measure(model.parameters(), opt)
    renamed = type("Renamed", (), {})()
    renamed.param_groups = opt.param_groups
    renamed.state = {p: {("codes_%d" % i if v.dim() else k): v
                         for i, (k, v) in enumerate(st.items())}
                     for p, st in opt.state.items()}
    got = memory.measure(model.parameters(), renamed)
    assert got["optimizer_states"] == want["optimizer_states"] == estimate(
        [p.numel() for p in model.parameters()], "adamw", "mpext-bf16-sr-8bit").optimizer_states


# ---------------------------------------------------------------------------------------------
# Per-tensor sizes and the EMA of the weights


def test_per_tensor_sizes_by_hand():
    """Given the tensors' sizes, an 8-bit mode keeps FP32 moments for each tensor under
    MIN_8BIT_NUMEL elements and one FP32 scale per started block of each larger one; every
    other row (and every other mode) is the estimate of the total count."""
    from mpext.optim import MIN_8BIT_NUMEL
    assert MIN_8BIT_NUMEL == 4096
    sizes = [0, 10, 4095, 4096, 4097, 70000]
    n = sum(sizes)
    b = estimate(sizes, "adamw", "mpext-bf16-sr-8bit")
    # fp32 moments for 10 and 4095; codes + ceil(s/256) scales, two moments each, for the rest
    by_hand = 2 * (4 * (10 + 4095) + (4096 + 16 * 4) + (4097 + 17 * 4) + (70000 + 274 * 4))
    assert b.optimizer_states == by_hand
    assert (b.params, b.weights, b.gradients, b.master_weights) == (n, 2 * n, 2 * n, 0)
    assert estimate(n, "adamw", "mpext-bf16-sr-8bit").optimizer_states \
        == 2 * (n + 4 * -(-n // 256)) != by_hand
    for mode in ("fp32", "mpext-bf16", "mpext-bf16-remainder-bf16moments"):
        assert estimate(sizes, "adamw", mode) == estimate(n, "adamw", mode)
    # ZeRO-1 over 4: the per-tensor total partitioned
    assert estimate(sizes, "adamw", "mpext-bf16-sr-8bit", zero=1,
                    world_size=4).optimizer_states == -(-by_hand // 4)


@pytest.mark.parametrize("bad,message", [
    ([], "params: the tensors' sizes must add up to at least 1"),
    ([0, 0], "params: the tensors' sizes must add up to at least 1"),
    ([5, -1], "params[1]: must be >= 0"),
    ([5, 2.5], "params[1]: must be a whole number"),
])
def test_per_tensor_sizes_bad(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate(bad, "adamw", "mpext-bf16-8bit")
    with pytest.raises(TypeError, match=re.escape("params[0]: must be an integer")):
        estimate(["7"], "adamw", "mpext-bf16")


@pytest.mark.parametrize("mode,zero", [(m, z) for m in MODES for z in range(4)])
def test_ema_by_hand(mode, zero):
    """ema=True adds one FP32 copy of the weights, 4 B/param: mpext's lives in the optimizer
    state (ZeRO partitions it from stage 1), native's AveragedModel is a model copy (partitioned
    only at stage 3); nothing else changes."""
    n, w = 1001, 4
    plain = estimate(n, "adamw", mode, zero=zero, world_size=w)
    b = estimate(n, "adamw", mode, zero=zero, world_size=w, ema=True)
    mpext_mode = mode.startswith("mpext")
    partitioned = zero >= (1 if mpext_mode else 3)
    assert b.ema == 4 * (-(-n // w) if partitioned else n)
    assert b.persistent == plain.persistent + b.ema and plain.ema == 0
    assert dataclasses.replace(b, ema=0) == plain


def test_ema_errors():
    with pytest.raises(ValueError, match=re.escape(
            "ema: mpext keeps an FP32 EMA of the weights in mpext.optim.Adam/AdamW "
            "(ema_decay=...); with optimizer 'sgd', mpext-bf16 has none")):
        estimate(10, "sgd", "mpext-bf16", ema=True)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="ema: must be True or False"):
            estimate(10, "adamw", "mpext-bf16", ema=bad)
    # native modes keep theirs outside the optimizer: any optimizer
    assert estimate(10, "sgd", "amp-bf16", ema=True).ema == 40
    assert not memory.mode_supports("mpext-fp16", "rmsprop", ema=True)
    assert memory.mode_supports("mpext-fp16", "rmsprop")


def test_cli_ema(capsys):
    code, out, _ = run_main(capsys, "--params", "1e6", "--ema", "--json")
    rows = json.loads(out)["results"]
    assert code == 0 and [r["mode"] for r in rows] == list(MODES)
    assert all(r["ema"] == 4 * 10 ** 6 for r in rows)
    code, out, _ = run_main(capsys, "--params", "1e6", "--ema", "--optimizer", "sgd", "--json")
    assert [r["mode"] for r in json.loads(out)["results"]] == ["fp32", "amp-bf16", "amp-fp16"]
    code, out, _ = run_main(capsys, "--params", "1e6", "--ema", "--mode", "amp-bf16,mpext-bf16")
    assert "| EMA of the weights (fp32)" in out
    code, out, _ = run_main(capsys, "--params", "1e6", "--mode", "mpext-bf16")
    assert "EMA" not in out  # the row shows only when some column has one
    with pytest.raises(SystemExit) as exc:
        memory.main(["--params", "1e6", "--ema", "--optimizer", "sgd", "--mode",
                     "amp-bf16,mpext-bf16"])
    assert exc.value.code == 2
    assert "argument --ema: mpext keeps an EMA in mpext.optim.Adam/AdamW (ema_decay), not " \
           "with --optimizer sgd; drop --ema or the mode(s) mpext-bf16" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(1,), (), (1, 1)])
def test_measure_one_element_params(shape):
    """The moments of a one-element (or 0-dim) param are optimizer state like any other's;
    only the per-param ``step`` scalars are 'other'."""
    big = nn.Parameter(torch.randn(64, 64))
    tiny = nn.Parameter(torch.randn(shape))
    opt = torch.optim.AdamW([big, tiny])
    (big.sum() + tiny.sum()).backward()
    opt.step()
    got = memory.measure([big, tiny], opt)
    want = estimate([big.numel(), tiny.numel()], "adamw", "fp32")
    assert got["optimizer_states"] == want.optimizer_states == 8 * (64 * 64 + 1)
    assert got["other"] == 2 * 4  # the two float32 step scalars


# ---------------------------------------------------------------------------------------------
# The modes derived from mpext.optim.formats, per rule; gradient release

import warnings  # noqa: E402

import optim_table as T  # noqa: E402  (the rules x formats table of the optimizer tests)

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _mode_of(fmt, dtype):
    """The FORMAT_MODES name of a table format on params of ``dtype``."""
    return memory.format_mode_name(_DTYPE_NAME[dtype], fmt.param_format, fmt.moment_format)


def _rule_of(rule):
    """(memory's rule, momentum) of a table rule (momentum is SGD's option there: Muon's
    buffer is always kept)."""
    name = rule.name.split("-")[0]
    return name, rule.kwargs.get("momentum", 0.0) if name == "sgd" else 0.0


def test_every_mode_of_the_table_exists_and_its_aliases_are_formats():
    """Each (format, param dtype) of the optimizer tests' table is a FORMAT_MODES entry with the
    table's bytes (written there by hand) per element: the param's, its FP32 value's storage,
    each moment's, 8-bit codes' block; every mpext lean name of MODES is one of them."""
    names = set()
    for fmt in T.FORMATS.values():
        for dt in fmt.param_dtypes:
            spec = memory.FORMAT_MODES[_mode_of(fmt, dt)]
            names.add(_mode_of(fmt, dt))
            assert (spec.weight, spec.grad) == (dt.itemsize, dt.itemsize)
            assert spec.master == fmt.storage_bytes
            assert spec.state == fmt.moment_bytes
            assert spec.state_block == fmt.block and spec.state_meta == (4 if fmt.block else 0)
            assert spec.scaler == (dt == torch.float16)
    assert names == set(memory.FORMAT_MODES)
    for alias, (dt, pf, mf) in memory.ALIASES.items():
        a, f = MODES[alias], memory.FORMAT_MODES[memory.format_mode_name(dt, pf, mf)]
        assert dataclasses.replace(a, description="", optimizers=None) == \
            dataclasses.replace(f, description="", optimizers=None), alias
    # the hand-written bytes of this file's tables, for the aliases
    for mode, (w, g, m, st) in MODE_BYTES.items():
        if mode in memory.ALIASES:
            spec = MODES[mode]
            assert (spec.weight, spec.grad, spec.master, spec.state) == (w, g, m, st), mode


def test_rules_are_the_optimizer_classes_moments():
    """RULES lists each rule's moments as its mpext.optim class keeps them (for the classes in
    this tree), and the table's rules are all among them."""
    classes = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion", "sgd": "SGD", "muon": "Muon"}
    assert set(classes) == set(memory.RULES)
    found = 0
    for rule, name in classes.items():
        cls = getattr(mpext.optim, name, None)
        if cls is not None:
            found += 1
            assert tuple(q.name for q in cls.moments) == memory.RULES[rule], rule
    assert found >= 2
    assert {_rule_of(r)[0] for r in T.RULES.values()} <= set(memory.RULES)
    assert memory.rule_states("sgd") == 0 and memory.rule_states("sgd", 0.9) == 1
    assert memory.rule_states("lion") == 1 and memory.rule_states("adamw") == 2


TABLE_LIVE = [(r, f, dt) for r, f in T.pairs() for dt in f.param_dtypes]


@pytest.mark.parametrize("rule,fmt,dtype", TABLE_LIVE, ids=[T.pair_id(c) for c in TABLE_LIVE])
def test_every_rule_and_format_agrees_with_live_tensors(rule, fmt, dtype):
    """Every (rule, format) pair of the optimizer tests' table after two real steps, with an
    EMA: the live tensors (memory.measure) equal the estimate of the params' sizes for that
    rule and format, component by component (8-bit codes with their scales, the small tensors'
    FP32 moments)."""
    params = T.make_params((dtype,), rule=rule)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*master_weights=False without")
        opt = rule.make(params, ema_decay=0.9, **fmt.kwargs_for(rule))
    for s in range(2):
        T.set_grads(params, T.make_grads(params, s))
        opt.step()
    got = memory.measure(params, opt)
    name, momentum = _rule_of(rule)
    want = estimate([p.numel() for p in params], mode=_mode_of(fmt, dtype), rule=name,
                    momentum=momentum, ema=True)
    for field in ("weights", "gradients", "master_weights", "optimizer_states", "ema"):
        assert got[field] == getattr(want, field), (field, got, want)


def test_rule_by_hand():
    """--rule: the rule's moments are the state (Lion 1, SGD 0 or 1 with momentum, Adam 2), in
    any mode; no FP32 gradient buffers (mpext.optim's step is fused); an EMA in any mode."""
    n = 1000
    assert estimate(n, mode="mpext-bf16-sr", rule="lion").persistent == n * (2 + 2 + 2)
    assert estimate(n, mode="mpext-bf16-8bit", rule="sgd").optimizer_states == 0
    b = estimate(n, mode="mpext-bf16-8bit", rule="sgd", momentum=0.9)
    assert b.optimizer_states == n + 4 * 4 and b.optimizer == "sgd-momentum"
    b = estimate(n, mode="mpext-fp16-master-float32", rule="sgd", momentum=0.5, ema=True)
    assert (b.master_weights, b.optimizer_states, b.ema, b.step_buffers, b.scaler) == \
        (4 * n, 4 * n, 4 * n, 0, 8)
    assert estimate(n, mode="fp32", rule="adam", ema=True, zero=3, world_size=4).ema == 4 * 250
    for kw, match in ((dict(rule="rmsprop"), "rule: unknown rule 'rmsprop'"),
                      (dict(rule="lion", momentum=0.9), "momentum: SGD's option"),
                      (dict(rule="sgd", momentum=-1), "momentum: must be a number >= 0"),
                      (dict(momentum=0.9), "momentum: SGD's option of rule='sgd'"),
                      (dict(mode="mpext-fp16-remainder-q8"), "mode: unknown mode")):
        with pytest.raises(ValueError, match=match):
            estimate(n, **dict(dict(mode="mpext-bf16"), **kw))


def test_grad_release_by_hand():
    """--grad-release: no gradient persists; one bucket (bucket_bytes, or every gradient when
    they are fewer) is alive during the backward, on top of the activations."""
    b = estimate(10 ** 6, "adamw", "mpext-bf16", grad_release=True)
    assert b.gradients == 0 and b.persistent == 10 ** 6 * (2 + 4 + 8)
    assert b.grad_bucket == 2 * 10 ** 6 and b.total == b.persistent + 2 * 10 ** 6
    b = estimate(10 ** 7, mode="mpext-bf16-remainder-q8", rule="lion", grad_release=True,
                 batch=1, seq=8, hidden=16, layers=1, heads=2)
    assert b.grad_bucket == 4 * 2 ** 20
    assert b.transient == b.activations + 4 * 2 ** 20
    assert estimate(1000, "adam", "fp32", grad_release=True, bucket_bytes=100).grad_bucket == 100
    for kw, exc, match in ((dict(optimizer="sgd"), ValueError, "grad_release: the release is "
                                                               "mpext.optim's"),
                           (dict(world_size=2), ValueError, "more than one process"),
                           (dict(bucket_bytes=-1), ValueError, "bucket_bytes: must be >= 0"),
                           (dict(grad_release=1), TypeError, "grad_release: must be True")):
        with pytest.raises(exc, match=match):
            estimate(1000, **dict(dict(mode="mpext-bf16", grad_release=True), **kw))


def test_cli_rule_and_grad_release(capsys):
    code, out, _ = run_main(capsys, "--params", "1e6", "--rule", "sgd", "--momentum", "0.9",
                            "--mode", "mpext-bf16-remainder-q8,mpext-bf16-sr", "--grad-release",
                            "--bucket-bytes", "65536", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["rule"] == "sgd" and data["grad_release"] is True
    for r in data["results"]:
        want = estimate(10 ** 6, mode=r["mode"], rule="sgd", momentum=0.9, grad_release=True,
                        bucket_bytes=65536)
        assert r["total"] == want.total and r["grad_bucket"] == 65536 and r["gradients"] == 0
    code, out, _ = run_main(capsys, "--params", "1e6", "--rule", "lion", "--json")
    assert [r["mode"] for r in json.loads(out)["results"]] == list(MODES)
    code, out, _ = run_main(capsys, "--params", "1e6", "--rule", "adamw", "--grad-release")
    assert "released gradients, one bucket" in out and "gradient release" in out


CLI_RULE_ERRORS = [
    (["--params", "1e6", "--momentum", "0.9"], "argument --momentum: SGD's momentum"),
    (["--params", "1e6", "--rule", "sgd", "--momentum", "-1"], "must be >= 0"),
    (["--params", "1e6", "--rule", "rmsprop"], "argument --rule: invalid choice"),
    (["--params", "1e6", "--grad-release", "--optimizer", "sgd"],
     "argument --grad-release: the release is mpext.optim's"),
    (["--params", "1e6", "--grad-release", "--rule", "adam", "--world-size", "2"],
     "not supported with more than one process"),
]


# Every mode mpext.optim.AdamW steps (FP32 params, the named mpext formats), and an EMA on a
# remainder and on the master-free 8-bit format: (mode, param dtype, options, ema).
RELEASE_MODES = [("fp32", torch.float32, {}, False), ("mpext-bf16", torch.bfloat16, {}, False),
                 ("mpext-fp16", torch.float16, {}, False)] + \
    [(m, *LEAN_OPTIONS[m], False) for m in LEAN] + \
    [(m, *Q8_MODES[m][1:], False) for m in Q8_MODES] \
    + [("mpext-bf16-remainder", *LEAN_OPTIONS["mpext-bf16-remainder"], True),
       ("mpext-bf16-sr-8bit", *Q8_MODES["mpext-bf16-sr-8bit"][1:], True)]


def _released_agreement(mode, dtype, options, ema, predict=estimate):
    """Two released steps of the tests' GPT (tied head; norms and biases under MIN_8BIT_NUMEL)
    in ``mode``, with a bucket of the largest gradient's bytes (so a bucket of several
    overshoots it): the live tensors equal ``predict``'s for the model's tensor sizes,
    component by component, no gradient persisting; the gradient bytes alive as each gradient
    completes never exceed its ``grad_bucket`` (``_release_peak``: under a bucket plus the
    largest gradient) and stay under the whole model's."""
    torch.manual_seed(0)
    model = SmallGPT(96, 16, 64, 2, 2).to(dtype)
    params = list(model.parameters())
    opt = mpext.optim.AdamW(params, lr=1e-3, **dict(options, **({"ema_decay": 0.9} if ema else {})))
    scaler = mpext.GradScaler("cpu") if dtype == torch.float16 else None
    bucket, live = max(p.numel() for p in params) * dtype.itemsize, []

    def watch(_):  # registered first, so it runs before the release's hook frees a bucket
        live.append(sum(q.grad.nbytes for q in params if q.grad is not None))

    hooks = [p.register_post_accumulate_grad_hook(watch) for p in params]
    release = opt.release_grads(bucket_bytes=bucket, scaler=scaler)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        release.backward(scaler.scale(loss) if scaler else loss)
        if scaler:
            scaler.update()
    for hk in hooks:
        hk.remove()
    release.remove()
    sizes = [p.numel() for p in params]
    want = predict(sizes, "adamw", mode, ema=ema, grad_release=True, bucket_bytes=bucket)
    got = memory.measure(params, opt, scaler)
    assert got["gradients"] == 0 and all(p.grad is None for p in params)
    for field in ("weights", "gradients", "master_weights", "optimizer_states", "ema"):
        assert got[field] == getattr(want, field), (field, got, want)
    assert got["scaler"] >= want.scaler
    assert max(live) <= want.grad_bucket < dtype.itemsize * sum(sizes), (max(live), want)
    assert max(live) > bucket  # a bucket did overshoot: the bound is not slack by a bucket


@pytest.mark.parametrize("mode,dtype,options,ema", RELEASE_MODES,
                         ids=[m[0] + ("-ema" if m[3] else "") for m in RELEASE_MODES])
def test_grad_release_agrees_with_live_tensors(mode, dtype, options, ema):
    _released_agreement(mode, dtype, options, ema)


@pytest.mark.parametrize("wrong", ["gradients counted", "bucket alone", "moments as FP32"])
def test_grad_release_agreement_fails_on_a_wrong_prediction(wrong):
    """The check above is not vacuous: a prediction that counts the gradients as persistent,
    takes the peak as the bucket alone, or counts 8-bit moments as FP32 fails it."""
    def predict(*a, **kw):
        if wrong == "moments as FP32":
            a = a[:2] + ("mpext-bf16-sr-fp32moments",)
        b = estimate(*a, **dict(kw, grad_release=wrong != "gradients counted"))
        return dataclasses.replace(b, grad_bucket=kw["bucket_bytes"] - 1) \
            if wrong == "bucket alone" else b
    with pytest.raises(AssertionError):
        _released_agreement("mpext-bf16-sr-8bit", *Q8_MODES["mpext-bf16-sr-8bit"][1:], False,
                            predict=predict)


# ---------------------------------------------------------------------------------------------
# PyTorch's engines (sharding="torch"): FSDP2's padded dim-0 chunks, ZeroRedundancyOptimizer's
# whole-tensor partition. The live tensors of 2- and 4-rank gloo runs equal these per rank:
# tests/test_distributed.py, test_per_device_bytes_measured_equal_the_estimate.


def test_fsdp2_shard_by_hand():
    # 67 rows over 4 ranks: chunks of 17 rows, the last rank 16; every rank allocates 17
    assert [memory.fsdp2_shard((67, 64), 4, r) for r in range(4)] == \
        [(17 * 64, 17 * 64)] * 3 + [(16 * 64, 17 * 64)]
    # 5 rows over 4: chunks of 2, so 2, 2, 1 and an empty shard, each allocating 2 rows
    assert [memory.fsdp2_shard((5, 3), 4, r) for r in range(4)] == \
        [(6, 6), (6, 6), (3, 6), (0, 6)]
    assert [memory.fsdp2_shard((1,), 2, r) for r in range(2)] == [(1, 1), (0, 1)]
    with pytest.raises(ValueError, match="params: FSDP2 shards dim 0"):
        memory.fsdp2_shard((), 2, 0)


def test_zero_partition_is_torchs_greedy_one():
    # largest first, each to the rank holding the fewest elements (the lowest on a tie)
    assert memory.zero_partition([4288, 67, 335, 5, 5, 1], 2) == [[0], [2, 1, 3, 4, 5]]
    assert memory.zero_partition([4288, 67, 335, 5, 5, 1], 4) == [[0], [2], [1], [3, 4, 5]]
    assert memory.zero_partition([3, 3, 3], 2) == [[0, 2], [1]]


def test_torch_sharding_by_hand():
    shapes = [(67, 64), (67,), (5, 67), (5,), (1, 5), (1,)]
    n = sum(math.prod(s) for s in shapes)
    per_rank = [estimate(shapes, "adamw", "mpext-bf16-remainder-bf16moments", zero=3,
                         world_size=4, sharding="torch", rank=r) for r in range(4)]
    padded = 17 * 64 + 17 + 2 * 67 + 2 + 5 + 1
    own = [17 * 64 + 17 + 2 * 67 + 2 + 5 + 1, 17 * 64 + 17 + 2 * 67 + 2,
           17 * 64 + 17 + 67 + 1, 16 * 64 + 16]
    for r, b in enumerate(per_rank):
        assert (b.weights, b.gradients, b.master_weights, b.optimizer_states, b.rank) == \
            (2 * padded, 2 * padded, 2 * own[r], 2 * 2 * own[r], r)
        assert b.label() == "mpext-bf16-remainder-bf16moments FSDP2/4"
    # the default is the busiest rank; a bare count is one 1-D tensor (ZeRO-3's even figure)
    assert estimate(shapes, "adamw", "mpext-bf16", zero=3, world_size=4,
                    sharding="torch").rank == 0
    even = estimate(n, "adamw", "mpext-bf16", zero=3, world_size=4)
    bare = estimate(n, "adamw", "mpext-bf16", zero=3, world_size=4, sharding="torch")
    assert bare.persistent == even.persistent and bare.label().endswith("FSDP2/4")
    # ZeroRedundancyOptimizer: rank 0 steps the 67 x 64 weight (8-bit), rank 1 the rest (FP32)
    z = [estimate(shapes, "adamw", "mpext-bf16-sr-8bit", zero=1, world_size=2,
                  sharding="torch", rank=r) for r in range(2)]
    assert [b.optimizer_states for b in z] == [2 * (4288 + 4 * 17), 2 * 4 * (n - 4288)]
    assert all(b.weights == 2 * n and b.gradients == 2 * n for b in z)
    assert estimate(shapes, "adamw", "mpext-bf16-sr-8bit", zero=1, world_size=2,
                    sharding="torch").rank == 0
    assert z[0].label() == "mpext-bf16-sr-8bit ZeRO-1/2 torch"
    # zero 0 is the same under both
    assert estimate(shapes, "adamw", "mpext-bf16", sharding="torch").persistent == \
        estimate(shapes, "adamw", "mpext-bf16").persistent


@pytest.mark.parametrize("kwargs,match", [
    (dict(sharding="fsdp"), "sharding: must be one of even, torch, got 'fsdp'"),
    (dict(sharding="torch", zero=2), "zero: PyTorch has no ZeRO-2 of its own"),
    (dict(rank=1, zero=3, world_size=2), "rank: only with sharding='torch'"),
    (dict(sharding="torch", rank=2, zero=3, world_size=2), "rank: must be < world_size=2"),
    (dict(sharding="torch", rank=-1, zero=3, world_size=2), "rank: must be >= 0"),
    (dict(sharding="torch", zero=3, world_size=2, optimizer="sgd"),
     "optimizer: mpext-bf16 with 'sgd' is mpext.MixedPrecisionOptimizer, which has no DTensor"),
    (dict(sharding="torch", zero=1, world_size=2, grad_release=True),
     "grad_release: not supported with more than one process but under PyTorch's DDP"),
])
def test_torch_sharding_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        estimate([(4, 3)], **dict(dict(optimizer="adamw", mode="mpext-bf16"), **kwargs))


def test_cli_fsdp2_and_torch_zero1(capsys):
    code, out, _ = run_main(capsys, "--model", "llama-7b", "--mode", "mpext-bf16,"
                            "mpext-bf16-sr-8bit", "--zero", "3,fsdp2,zero1-torch",
                            "--world-size", "8", "--json")
    assert code == 0
    res = json.loads(out)
    labels = [memory.Breakdown(**{k: v for k, v in r.items() if k in {
        f.name for f in dataclasses.fields(memory.Breakdown)}}).label() for r in res["results"]]
    assert labels == ["mpext-bf16 ZeRO-3/8", "mpext-bf16 FSDP2/8", "mpext-bf16 ZeRO-1/8 torch",
                      "mpext-bf16-sr-8bit ZeRO-3/8", "mpext-bf16-sr-8bit FSDP2/8",
                      "mpext-bf16-sr-8bit ZeRO-1/8 torch"]
    assert "unsupported" not in res
    spec = memory.model_spec("llama-7b")
    assert res["results"][1] == estimate(list(spec.shapes), "adamw", "mpext-bf16", zero=3,
                                         world_size=8, sharding="torch",
                                         family="llama").to_dict()
    with pytest.raises(SystemExit):
        memory.main(["--params", "1e6", "--zero", "fsdp3"])
    assert "or PyTorch's fsdp2 or zero1-torch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["--params", "1e6", "--mode", "mpext-bf16", "--optimizer", "sgd",
                     "--zero", "fsdp2", "--world-size", "2"])
    assert "argument --zero: optimizer: mpext-bf16 with 'sgd' is mpext.MixedPrecisionOptimizer" \
        in capsys.readouterr().err



# ---------------------------------------------------------------------------------------------
# The Llama formula and activation checkpointing, against a small stock transformers Llama
# measured by torch's saved-tensor hooks (nothing of mpext on the measuring side)


def _tiny_llama(b, s, h, L, a, F, v, attention="sdpa", device="cpu"):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=h, intermediate_size=F, num_hidden_layers=L, num_attention_heads=a,
        num_key_value_heads=a, vocab_size=v, max_position_embeddings=s, use_cache=False,
        attn_implementation=attention, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device), \
        torch.randint(0, v, (b, s), device=device)


def _llama_estimate(mode, b, s, h, L, a, F, v, **kw):
    return estimate(10 ** 6, "adamw", mode, batch=b, seq=s, hidden=h, layers=L, heads=a,
                    vocab=v, family="llama", ffn=F, device="cpu", **kw).activations


# (batch, seq, hidden, layers, heads, ffn, vocab): two shapes, the second with odd sizes
_LLAMA_SHAPES = [(2, 32, 64, 2, 4, 172, 50), (3, 24, 96, 3, 3, 250, 61)]


@pytest.mark.parametrize("mode", list(_RUNS))
@pytest.mark.parametrize("shape", _LLAMA_SHAPES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_activations_equal_hf_llamas_saved_tensors(mode, shape, attention, device):
    """transformers' LlamaForCausalLM (full multi-head attention, no dropout) saves what the
    llama formula says, storage by storage, in FP32, under AMP BF16 and as a BF16 model: on the
    CPU exactly, but for the loss's shifted copy of the labels (int64, 8*s*b bytes, as with
    GPT-2). On CUDA the fused attention kernels may pad their log-sum-exp and keep RNG scalars:
    within 1%."""
    b, s, h, L, a, F, v = shape
    model, x = _tiny_llama(b, s, h, L, a, F, v, attention, device)
    dtype, amp = _RUNS[mode]
    model = model.to(dtype).train()
    meter = _SavedBytes(model, (x,))
    with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None), \
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(x, labels=x).loss
    loss.backward()
    want = _llama_estimate(mode, *shape, attention=attention)
    if device == "cpu":
        assert meter.bytes - want == 8 * s * b
    else:
        assert abs(meter.bytes - 8 * s * b - want) <= 0.01 * want
    # and not the GPT formula, which the preset used to apply: it misses the SwiGLU tensors
    gpt = estimate(10 ** 6, "adamw", mode, batch=b, seq=s, hidden=h, layers=L, heads=a, vocab=v,
                   dropout=False, attention=attention, device="cpu").activations
    assert abs(gpt / meter.bytes - 1) > 0.1


def test_llama_per_token_and_layer_at_7b_aspect_ratios():
    """The issue's figure: at LLaMA-7B's aspect ratios (hidden 512, 4 heads of 128, ffn 1376 =
    512 * 11008 / 4096), a BF16 model with SDPA saves 23,320 bytes per token and layer
    (measured: one layer more, over the tokens), where the GPT formula says 16,408."""
    b, s, h, a, F, v = 1, 16, 512, 4, 1376, 32

    def measured(L):
        model, x = _tiny_llama(b, s, h, L, a, F, v)
        return _measure_saved(model, (x,), lambda m, x: m(x, labels=x).loss, "mpext-bf16")

    per = (measured(2) - measured(1)) / (b * s)
    assert per == 23320
    est = lambda L, **kw: memory.activation_bytes(b, s, h, L, a, **kw)  # noqa: E731
    assert (est(2, family="llama", ffn=F) - est(1, family="llama", ffn=F)) / (b * s) == per
    assert (est(2, dropout=False) - est(1, dropout=False)) / (b * s) == 16408


class _PeakSaved(_SavedBytes):
    """The peak of the bytes autograd holds for the backward at any moment of a forward and
    backward, each storage once, the parameters (and their casts) and the batch left out: each
    saved tensor is held in a small box whose release by autograd frees its count."""

    class _Box:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def __init__(self, model, batch):
        super().__init__(model, batch)
        self.live, self.now, self.peak = {}, 0, 0
        self.params = {id(p) for p in model.parameters()}

    def _of_a_param(self, t):
        """A cast or view of a parameter, not of another leaf: the reentrant checkpoint's
        detached block inputs are leaves too, and what a block saves of them counts."""
        fn = t.grad_fn
        while fn is not None and fn.name() in self._VIEW_OR_CAST:
            nexts = [g for g, _ in fn.next_functions if g is not None]
            if len(nexts) != 1:
                return False
            fn = nexts[0]
        return fn is not None and id(getattr(fn, "variable", None)) in self.params

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or self._of_a_param(t):
            return t
        box = self._Box(t)
        n, size = self.live.get(ptr, (0, 0))
        if n == 0:  # a storage at this address anew (an earlier one there may have been freed)
            size = t.untyped_storage().nbytes()
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[ptr] = (n + 1, size)
        import weakref
        weakref.finalize(box, self._free, ptr)
        return box

    def _free(self, ptr):
        n, size = self.live[ptr]
        self.live[ptr] = (n - 1, size)
        if n == 1:
            self.now -= size

    @staticmethod
    def unpack(t):
        return t.t if isinstance(t, _PeakSaved._Box) else t


@pytest.mark.parametrize("mode", list(_RUNS))
@pytest.mark.parametrize("shape", _LLAMA_SHAPES)
def test_checkpointing_equals_torch_utils_checkpoint_on_a_llama(mode, shape):
    """transformers' own gradient checkpointing of every decoder layer (torch.utils.checkpoint,
    reentrant: its recomputation runs under the hooks the meter sets, where the non-reentrant
    one's runs under hooks of its own, which no outside meter sees): the peak of the saved
    bytes over the forward and backward is the estimate, exactly, on the CPU."""
    b, s, h, L, a, F, v = shape
    model, x = _tiny_llama(b, s, h, L, a, F, v)
    dtype, amp = _RUNS[mode]
    model = model.to(dtype).train()
    model.activation_checkpointing_enable({"use_reentrant": True})
    meter = _PeakSaved(model, (x,))
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None), \
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(x, labels=x).loss
        loss.backward()
    assert meter.now == 0  # every saved tensor was released: the meter saw the whole run
    want = _llama_estimate(mode, *shape, checkpointing=True)
    assert meter.peak == want
    # what the option saves: well under the whole forward's, above layers x block input
    full = _llama_estimate(mode, *shape)
    assert L * s * b * h * (4 if mode != "mpext-bf16" else 2) < want < full


def test_checkpointing_by_hand():
    """layers x block input + one block's full activations (+ what the layers' backward still
    needs outside them: RoPE's cos and sin), or the end of the forward when that is larger."""
    b, s, h, L, a, F = 2, 32, 64, 5, 4, 172
    one = memory.activation_bytes(b, s, h, 2, a, family="llama", ffn=F) - \
        memory.activation_bytes(b, s, h, 1, a, family="llama", ffn=F)
    rope = 2 * s * (h // a) * 2
    got = memory.activation_bytes(b, s, h, L, a, family="llama", ffn=F, checkpointing=True)
    assert got == L * s * b * h * 2 + one + rope
    # FP32: the first RMSNorm saves the block's input itself, one storage
    one32 = memory.activation_bytes(b, s, h, 2, a, 4, family="llama", ffn=F) - \
        memory.activation_bytes(b, s, h, 1, a, 4, family="llama", ffn=F)
    got = memory.activation_bytes(b, s, h, L, a, 4, family="llama", ffn=F, checkpointing=True)
    assert got == (L - 1) * s * b * h * 4 + one32 + 2 * rope
    # a vocabulary large enough that the forward's end is the peak: its log-softmax
    v = 100_000
    end = memory.activation_bytes(b, s, h, L, a, vocab=v, family="llama", ffn=F,
                                  checkpointing=True)
    outside = memory.activation_bytes(b, s, h, 1, a, vocab=v, family="llama", ffn=F) - one
    assert end == L * s * b * h * 2 + outside > got


def test_unknown_family_is_refused():
    """No model is estimated with another family's formula: an unknown family, a llama
    without its MLP width, with dropout or with compression (not measured) are refused, and
    --model llama-* uses the llama formula."""
    shape = dict(batch=1, seq=8, hidden=16, layers=1, heads=2)
    for kw, exc, match in [
            (dict(family="mistral"), ValueError, "family: no activation formula for 'mistral'"),
            (dict(family=None), ValueError, "family: no activation formula for None"),
            (dict(family="llama"), ValueError, "ffn: the llama formula needs"),
            (dict(family="llama", ffn=40, dropout=True), ValueError,
             "dropout: the llama formula is LLaMA's training without dropout"),
            (dict(family="llama", ffn=40, compress=True), ValueError,
             "compress: no compressed estimate for the llama formula"),
            (dict(ffn=40), ValueError, "ffn: only the llama formula reads it"),
            (dict(checkpointing=True, compress=True), ValueError,
             "compress: not estimated together with checkpointing"),
            (dict(checkpointing=1), TypeError, "checkpointing: must be True or False")]:
        with pytest.raises(exc, match=match):
            estimate(10 ** 6, **dict(shape, **kw))
    with pytest.raises(ValueError, match="family: no activation formula for 'mistral'"):
        estimate(10 ** 6, family="mistral")  # refused with or without a shape
    with pytest.raises(ValueError, match="checkpointing: only used by the activation estimate"):
        estimate(10 ** 6, checkpointing=True)
    assert {m.family for m in memory.MODELS.values()} <= set(memory.FAMILIES)
    assert memory.model_spec("llama-7b").family == "llama"
    spec = memory.model_spec("llama-7b")
    b = estimate(list(spec.sizes), batch=1, seq=spec.seq, hidden=spec.hidden,
                 layers=spec.layers, heads=spec.heads, vocab=spec.vocab, family="llama",
                 ffn=spec.ffn)
    assert "LLaMA" in b.activation_formula and b.family == "llama"


CLI_FAMILY_AND_GPU_ERRORS = [
    (["--params", "1e6", "--batch", "1", "--seq", "8", "--hidden", "16", "--layers", "1",
      "--heads", "2", "--family", "mistral"], "argument --family: invalid choice: 'mistral'"),
    (["--params", "1e6", "--batch", "1", "--seq", "8", "--hidden", "16", "--layers", "1",
      "--heads", "2", "--family", "llama"], "argument --ffn: the llama formula needs"),
    (["--model", "llama-7b", "--batch", "1", "--family", "gpt"],
     "argument --family: llama-7b is a llama model"),
    (["--model", "llama-7b", "--batch", "1", "--ffn", "9"], "argument --ffn: --model llama-7b"),
    (["--model", "llama-7b", "--checkpointing"], "argument --checkpointing: only used with"),
    (["--model", "llama-7b", "--batch", "1", "--compress-activations"],
     "argument --compress-activations: estimated for the gpt family only"),
    (["--model", "gpt2", "--batch", "1", "--compress-activations", "--checkpointing"],
     "argument --checkpointing: not estimated together with --compress-activations"),
    (["--params", "1e6", "--gpu-memory", "24XB"], "argument --gpu-memory: a size such as"),
    (["--params", "1e6", "--gpu-memory", "0"], "argument --gpu-memory: must be a positive"),
    (["--params", "1e6", "--cuda-context", "1GiB"],
     "argument --cuda-context/--allocator-slack: only with --gpu-memory"),
    (["--params", "1e6", "--gpu-memory", "1GB", "--cuda-context", "2GB"],
     "argument --cuda-context: context: 2000000000 bytes leave nothing"),
    (["--params", "1e6", "--gpu-memory", "1GB", "--allocator-slack", "-0.1"],
     "argument --allocator-slack: a share of the estimate between 0 and 10"),
]


# ---------------------------------------------------------------------------------------------
# Does it fit? (--gpu-memory)


def test_gb_and_gib():
    """GB are 10^9 bytes (a bare number too: GPUs are sold by them), GiB 2^30."""
    G = memory.gpu_memory_bytes
    assert G("24GB") == G("24") == G("24 gb") == G("24000MB") == 24 * 10 ** 9
    assert G("80GiB") == G("80 GiB") == G("81920MiB") == 80 * 2 ** 30
    assert G("0.5TiB") == 2 ** 39 and G("1.5e1GB") == 15 * 10 ** 9
    assert G("80GiB") - G("80GB") == 80 * (2 ** 30 - 10 ** 9)
    for bad in ("24XB", "GB", "", "-1", "0", "1e-12", "nan", "24 G B"):
        with pytest.raises(ValueError, match="gpu_memory: "):
            G(bad)
    for kw, match in [(dict(capacity=-1), "capacity: must be a whole number"),
                      (dict(capacity=10, context=10), "context: 10 bytes leave nothing"),
                      (dict(capacity=10, slack=-0.5), "slack: a share"),
                      (dict(capacity=10, slack=True), "slack: a share")]:
        with pytest.raises(ValueError, match=match):
            memory.GpuBudget(**kw)


def _cli_verdict(capsys, *argv):
    code, out, _ = run_main(capsys, *argv)
    assert code == 0
    return [ln for ln in out.splitlines() if ln.startswith("- ") or ln.startswith("Does it fit")]


def test_verdict_by_hand(capsys):
    """A 1e9-parameter model in mpext-bf16 (16 B/param: 16e9 bytes) on a 24 GB GPU: the
    context (512 MiB) off the 24e9 bytes, 10% slack on the estimate: 17.6e9 of 23.46e9 usable
    bytes fits; a 7e9 one (112e9 bytes, 123.2e9 with the slack) does not fit 80 GiB; the GB /
    GiB reading and the assumptions change the verdict as computed."""
    usable24 = 24e9 - 2 ** 29
    lines = _cli_verdict(capsys, "--params", "1e9", "--mode", "mpext-bf16", "--gpu-memory",
                         "24GB")
    g = lambda v: "%.3g GiB" % (v / 2 ** 30)  # noqa: E731
    assert lines[0].startswith("Does it fit on 24 GB (22.4 GiB)? Assumed: the CUDA context "
                               "and kernels take 0.5 GiB") and "reserves 10% beyond" in lines[0]
    assert lines[1] == "- mpext-bf16: fits: %s + 10%% = %s of %s usable, %s to spare." % (
        g(16e9), g(17.6e9), g(usable24), g(usable24 - 17.6e9))
    assert _cli_verdict(capsys, "--params", "1e9", "--mode", "mpext-bf16",
                        "--gpu-memory", "24")[1] == lines[1]  # a bare number is GB
    usable80 = 80 * 2 ** 30 - 2 ** 29
    lines = _cli_verdict(capsys, "--params", "7e9", "--mode", "mpext-bf16", "--gpu-memory",
                         "80GiB")
    assert lines[0].startswith("Does it fit on 80 GiB?")
    assert lines[1] == "- mpext-bf16: does NOT fit: %s + 10%% = %s of %s usable, %s short." % (
        g(112e9), g(123.2e9), g(usable80), g(123.2e9 - usable80))
    # 1.35e9 params: 21.6e9 bytes, 23.76e9 with the slack: fits 24 GiB, not 24 GB; fits 24 GB
    # with 4% slack (22.464e9 <= 23.46e9); not with a 3.3 GB context and no slack either
    args = ("--params", "1.35e9", "--mode", "mpext-bf16", "--gpu-memory")
    assert "fits:" in _cli_verdict(capsys, *args, "24GiB")[1]
    assert "does NOT fit:" in _cli_verdict(capsys, *args, "24GB")[1]
    assert "fits:" in _cli_verdict(capsys, *args, "24GB", "--allocator-slack", "0.04")[1]
    assert "does NOT fit:" in _cli_verdict(capsys, *args, "24GB", "--allocator-slack", "0",
                                           "--cuda-context", "3.3GB")[1]
    budget = memory.GpuBudget(24 * 10 ** 9)
    b = estimate(1.35e9, "adamw", "mpext-bf16")
    assert budget.need(b) == math.ceil(21.6e9 * 1.1) and budget.usable == usable24
    assert not budget.fits(b)


def test_fit_changes_are_computed():
    """What to change: each proposal is the estimate with that change (recomputed here), the
    format the first of the leaner ones that fits (by hand: 7e9 params on 80 GiB, 85.36e9 bytes
    usable, fits at most 11.09 B/param with the slack: the remainder + BF16 moments, 10 B, not
    the FP32 master's 16 or the remainder's 14), the micro-batch the largest that fits."""
    budget = memory.GpuBudget(80 * 2 ** 30)
    kw = dict(params=7e9, optimizer="adamw", mode="mpext-bf16")
    changes = dict(memory.fit_changes(kw, budget))
    assert changes["mode mpext-bf16-remainder-bf16moments"].total == 70e9
    assert changes["mode mpext-bf16-remainder-bf16moments"] == \
        estimate(**dict(kw, mode="mpext-bf16-remainder-bf16moments"))
    # gradient release drops the 2 B/param of gradients and keeps one 4 MiB bucket: no fit
    rel = changes["gradient release"]
    assert rel.total == 14 * 7e9 + 4 * 2 ** 20 and not budget.fits(rel)
    assert list(changes) == ["mode mpext-bf16-remainder-bf16moments", "gradient release"]
    # with activations: checkpointing and the largest micro-batch that fits
    spec = memory.model_spec("gpt2-xl")
    kw = dict(params=list(spec.sizes), mode="mpext-bf16-remainder-bf16moments", batch=32,
              seq=spec.seq, hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
              vocab=spec.vocab)
    budget = memory.GpuBudget(40 * 10 ** 9)
    assert not budget.fits(estimate(**kw))
    changes = dict(memory.fit_changes(kw, budget))
    assert changes["activation checkpointing"] == estimate(**dict(kw, checkpointing=True))
    mb = [k for k in changes if k.startswith("micro-batch")]
    assert len(mb) == 1
    n = int(mb[0].split()[1])
    assert budget.fits(estimate(**dict(kw, batch=n)))
    assert not budget.fits(estimate(**dict(kw, batch=n + 1)))
    assert changes[mb[0]] == estimate(**dict(kw, batch=n))
    # nothing fits alone: the smallest combinations that do, each checked here
    budget = memory.GpuBudget(24 * 10 ** 9)
    spec = memory.model_spec("llama-7b")
    kw = dict(params=list(spec.sizes), mode="mpext-bf16", batch=1, seq=spec.seq,
              hidden=spec.hidden, layers=spec.layers, heads=spec.heads, vocab=spec.vocab,
              family="llama", ffn=spec.ffn)
    out = memory.fit_changes(kw, budget)
    assert not any(budget.fits(b) for _, b in out)  # a 7B full fine-tune: >= 4 B/param
    last_what, last = out[-1]
    assert last_what == "mode mpext-bf16-sr-8bit + gradient release + activation checkpointing"
    assert last == estimate(**dict(kw, mode="mpext-bf16-sr-8bit", grad_release=True,
                                   checkpointing=True))
    assert last.persistent > budget.usable


def test_cli_gpu_memory_json(capsys):
    code, out, _ = run_main(capsys, "--model", "llama-7b", "--batch", "1", "--mode",
                            "mpext-bf16,mpext-bf16-sr-8bit", "--gpu-memory", "80GiB",
                            "--checkpointing", "--json")
    assert code == 0
    data = json.loads(out)
    gpu = data["gpu"]
    assert gpu["capacity"] == 80 * 2 ** 30 and gpu["usable"] == 80 * 2 ** 30 - 2 ** 29
    assert gpu["cuda_context"] == 2 ** 29 and gpu["allocator_slack"] == 0.1
    for r, col in zip(data["results"], gpu["columns"]):
        assert col["need"] == math.ceil(r["total"] * 1.1)
        assert col["fits"] == (col["need"] <= gpu["usable"])
        assert r["checkpointing"] and r["family"] == "llama"
    assert [c["fits"] for c in gpu["columns"]] == [False, True]
    assert gpu["columns"][0]["changes"] and not gpu["columns"][1]["changes"]


def test_readme_budget_table_is_the_calculators(capsys):
    """Every row of README's "Settings by memory budget" is what its command prints: the
    estimate + slack in GiB (3 figures) and whether it fits."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Settings by memory budget", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+) \| `([^`]+)` \| ([0-9.]+) GiB \| (fits|does not fit) \|$",
                      section, re.M)
    assert len(rows) >= 10 and {r[3] for r in rows} == {"fits", "does not fit"}
    for gpu, argv, need, verdict in rows:
        code, out, _ = run_main(capsys, *argv.split(), "--json")
        assert code == 0
        col = json.loads(out)["gpu"]["columns"][0]
        assert "%.3g" % (col["need"] / 2 ** 30) == need, argv
        assert col["fits"] == (verdict == "fits"), argv
        assert gpu.split(" ×")[0].replace(" ", "") in argv.replace("GiB", " GiB").replace(
            "GB", " GB").replace(" ", ""), argv  # the GPU column is the command's


@pytest.mark.parametrize("mode", list(_RUNS))
@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_equals_torch_utils_checkpoint_on_gpt2(mode, shape, dropout):
    """The gpt family's checkpointed peak against transformers' GPT2LMHeadModel with its own
    (reentrant) checkpointing of every block, with and without dropout (the CPU's SDPA math
    path with it): exactly, on the CPU (the labels' copy is freed before the first block is
    recomputed)."""
    transformers = pytest.importorskip("transformers")
    b, s, h, L, a, v = shape
    cfg = transformers.GPT2Config(
        n_layer=L, n_embd=h, n_head=a, vocab_size=v, n_positions=s, use_cache=False,
        attn_implementation="sdpa", resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, activation_function="gelu_pytorch_tanh", bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(0)
    dtype, amp = _RUNS[mode]
    model = transformers.GPT2LMHeadModel(cfg).to(dtype).train()
    model.activation_checkpointing_enable({"use_reentrant": True})
    x = torch.randint(0, v, (b, s))
    meter = _PeakSaved(model, (x,))
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None), \
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(x, labels=x).loss
        loss.backward()
    assert meter.now == 0
    assert meter.peak == _estimated(mode, *shape, dropout=dropout > 0, checkpointing=True)


def test_heap_meter_sees_a_tensor_come_and_go():
    """mpext.memory.meter.HeapMeter (the allocator meter the activation tests and benchmark
    read) counts a 64 MiB CPU tensor while it lives and not after it is freed: within 1 MiB,
    the other allocations a Python call makes."""
    from mpext.memory.meter import HeapMeter
    heap = HeapMeter("cpu")
    before = heap()
    t = torch.empty(16 << 20, dtype=torch.float32)
    t.fill_(1.0)
    during = heap()
    del t
    after = heap()
    assert abs((during - before) - (64 << 20)) < (1 << 20)
    assert abs(after - before) < (1 << 20)


@pytest.mark.parametrize("argv,message", CLI_ERRORS + CLI_RULE_ERRORS + CLI_FAMILY_AND_GPU_ERRORS)
def test_cli_errors(capsys, argv, message):
    """A bad command line: exit status 2, the message on stderr, nothing on stdout."""
    with pytest.raises(SystemExit) as e:
        memory.main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == ""
