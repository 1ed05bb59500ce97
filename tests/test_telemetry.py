"""Precision telemetry (issue 46, the gradient and loss-scale half): mpext.ops.unscale_stats_
against a float64 reference written here and against mpext.ops.unscale_ (same bits), on every
CPU ISA path and device; mpext.telemetry on a training run: counting changes no bit of it, no host
read between reads, counters equal the reference on the run's own gradients, the overflow site
named; the Lightning and HF Trainer callbacks."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpext
from mpext import ops
from mpext.ops import NO_INDEX

from conftest import HostReads

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# The reference: float64 arithmetic on the stored values, definitions of mpext/telemetry.h.

def ref_stats(g, stat_inv):
    """[zeros, subnormal, headroom, nonfinite] and max_abs of one stored (scaled) gradient."""
    fi = torch.finfo(g.dtype)
    x = g.detach().cpu().reshape(-1)
    fin = torch.isfinite(x)
    v = x.double().abs()
    zeros = int(((v == 0) & fin).sum())
    sub = int(((v > 0) & (v < fi.tiny) & fin).sum())
    head = int((fin & (v * 2 > fi.max)).sum())
    bad = int((~fin).sum())
    vmax = float(v[fin].max()) if bool(fin.any()) else 0.0
    # |g| (<= 24 bits) times stat_inv as the float32 the kernel reads (24 bits) is exact in
    # float64; one rounding to float32
    inv32 = float(torch.tensor(float(stat_inv), dtype=torch.float32))
    amax = torch.tensor(vmax * inv32, dtype=torch.float64).float()
    return [zeros, sub, head, bad], amax


def special_values(n, dtype, gen, rate=0.2):
    """Random values of mixed magnitudes with zeros, subnormals, values without headroom, the
    largest values, +-Inf and NaN mixed in at `rate`."""
    fi = torch.finfo(dtype)
    x = (torch.randn(n, generator=gen, dtype=torch.float64)
         * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).double()))
    specials = torch.tensor([0.0, -0.0, fi.tiny / 4, -fi.tiny / 2, fi.max, -fi.max / 1.5,
                             fi.max / 2, fi.max / 2.5, float("inf"), -float("inf"),
                             float("nan"), fi.tiny, fi.smallest_normal * 0.999],
                            dtype=torch.float64)
    pick = torch.rand(n, generator=gen) < rate
    idx = torch.randint(0, len(specials), (n,), generator=gen)
    x = torch.where(pick, specials[idx], x)
    return x.to(dtype)


def make_grads(specs, gen, device):
    return [special_values(n, dt, gen, rate).to(device) for dt, n, rate in specs]


def bits(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def run_stats(grads, inv, stat_inv=None, counts=None, amax=None, first=None):
    dev = grads[0].device if grads else "cpu"
    n = len(grads)
    counts = torch.zeros((n, 4), dtype=torch.int64, device=dev) if counts is None else counts
    amax = torch.zeros(n, dtype=torch.float32, device=dev) if amax is None else amax
    first = torch.full((1,), NO_INDEX, dtype=torch.int64, device=dev) if first is None else first
    found = torch.zeros(1, device=dev)
    ops.unscale_stats_(grads, found, torch.tensor([inv], device=dev), counts, amax, first,
                       stat_inv_scale=None if stat_inv is None
                       else torch.tensor([stat_inv], device=dev))
    return found, counts, amax, first


# ---------------------------------------------------------------------------------------------
# The op.

SPECS = [(torch.float32, 70001, 0.05), (torch.float16, 17, 0.3), (torch.bfloat16, 0, 0.0),
         (torch.bfloat16, 16385, 0.02), (torch.float16, 33000, 0.01), (torch.float32, 1, 0.0),
         (torch.bfloat16, 9, 0.5), (torch.float16, 65536 + 7, 0.001)]


@pytest.mark.parametrize("inv", [2.0 ** -16, 0.375, 1.0, 1e30])
def test_unscale_stats_counts_and_bits(device, isa, inv):
    """Counts, max_abs and first_nonfinite equal the float64 reference; grads and found_inf have
    unscale_'s bits; a second call accumulates (counts add, max_abs keeps the max, the first
    index the lowest)."""
    gen = torch.Generator().manual_seed(46)
    stat_inv = 2.0 ** -12 if inv == 1.0 else None
    grads = make_grads(SPECS, gen, device)
    twins = [g.clone() for g in grads]
    want = [ref_stats(g, stat_inv if stat_inv is not None else inv) for g in grads]
    found, counts, amax, first = run_stats(grads, inv, stat_inv)
    found_ref = torch.zeros(1, device=device)
    ops.unscale_(twins, found_ref, torch.tensor([inv], device=device))
    for i, (g, t) in enumerate(zip(grads, twins)):
        assert torch.equal(bits(g), bits(t)), i
    assert float(found) == float(found_ref) == 1.0
    for i, (c, m) in enumerate(want):
        assert counts[i].tolist() == c, (i, counts[i].tolist(), c)
        assert bits(amax[i:i + 1]).item() == bits(m.reshape(1)).item(), (i, amax[i], m)
    bad = [i for i, (c, _) in enumerate(want) if c[3] > 0]
    assert int(first) == bad[0]

    # accumulate: a clean second batch, from the totals left by the first call
    grads2 = make_grads([(dt, n, 0.0) for dt, n, _ in SPECS], gen, device)
    want2 = [ref_stats(g, stat_inv if stat_inv is not None else inv) for g in grads2]
    before_c, before_m = counts.clone(), amax.clone()
    found2, counts, amax, first = run_stats(grads2, inv, stat_inv, counts, amax, first)
    for i, (c, m) in enumerate(want2):
        assert (counts[i] - before_c[i]).tolist() == c
        assert float(amax[i]) == max(float(before_m[i]), float(m))
    bad2 = [i for i, (c, _) in enumerate(want2) if c[3] > 0]
    assert int(first) == min(bad + bad2)
    assert float(found2) == (1.0 if bad2 else 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_stats_every_16bit_pattern(device, isa, dtype):
    """All 65536 bit patterns of the 16-bit dtypes: each class counted exactly once."""
    g = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = g.to(device)
    want, m = ref_stats(g, 1.0)
    found, counts, amax, first = run_stats([g], 1.0)
    assert counts[0].tolist() == want
    assert float(amax[0]) == float(m) == torch.finfo(dtype).max
    # the reference itself, against the bit layout: per sign, one zero, 2^m - 1 subnormals,
    # 2^m patterns in the top binade (no headroom) and 2^m with the exponent all ones
    m = 7 if dtype == torch.bfloat16 else 10
    assert want == [2, 2 * ((1 << m) - 1), 2 << m, 2 << m]
    assert int(first) == 0 and float(found) == 1.0


def test_unscale_stats_underflow_at_the_loss_scale(device):
    """What the counters are for: the same unscaled fp16 gradient, backward-scaled by a small
    and a large scale: at 1 many values are subnormal or zero, at 2^12 none underflow, and at
    2^16 the largest lose their headroom."""
    gen = torch.Generator().manual_seed(1)
    true = torch.randn(4096, generator=gen, dtype=torch.float64) * 1e-6
    counts = {}
    for scale in (1.0, 2.0 ** 12, 2.0 ** 16):
        g = (true * scale).to(torch.float16).to(device)
        want, _ = ref_stats(g, 1 / scale)
        _, c, _, _ = run_stats([g], 1 / scale)
        assert c[0].tolist() == want
        counts[scale] = want
    assert counts[1.0][1] > 1000 and counts[2.0 ** 12][1] < counts[1.0][1] // 10
    assert counts[2.0 ** 16][2] == 0


def test_unscale_stats_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    grads = make_grads([(torch.float32, 33, 0.1), (torch.bfloat16, 8, 0.0)], gen, device)
    args = (grads, torch.zeros(1, device=device), torch.tensor([0.5], device=device),
            torch.zeros((2, 4), dtype=torch.int64, device=device),
            torch.zeros(2, device=device),
            torch.full((1,), NO_INDEX, dtype=torch.int64, device=device))
    torch.library.opcheck(torch.ops.mpext.unscale_stats_.default, args,
                          {"stat_inv_scale": torch.tensor([0.25], device=device)})


@pytest.mark.parametrize("case,match", [
    ("counts_dtype", "counts must have dtype int64"),
    ("counts_shape", r"counts must have shape \[len\(grads\), 4\]"),
    ("amax_dtype", "max_abs must have dtype float32"),
    ("amax_shape", r"max_abs must have shape \[len\(grads\)\]"),
    ("first_dtype", "first_nonfinite must have dtype int64"),
    ("stat_inv_numel", "stat_inv_scale must have 1 element"),
    ("overlap", "counts and max_abs overlap in memory"),
    ("grad_dtype", r"grads\[1\] must have dtype"),
])
def test_unscale_stats_bad_arguments(device, case, match):
    """A clear error naming the argument, and nothing written."""
    g = [torch.full((8,), 3.0, device=device), torch.full((4,), 2.0, device=device)]
    counts = torch.zeros((2, 4), dtype=torch.int64, device=device)
    amax = torch.zeros(2, device=device)
    first = torch.full((1,), NO_INDEX, dtype=torch.int64, device=device)
    found = torch.zeros(1, device=device)
    kw = {}
    if case == "counts_dtype":
        counts = counts.int()
    elif case == "counts_shape":
        counts = torch.zeros((3, 4), dtype=torch.int64, device=device)
    elif case == "amax_dtype":
        amax = amax.double()
    elif case == "amax_shape":
        amax = torch.zeros(3, device=device)
    elif case == "first_dtype":
        first = first.float()
    elif case == "stat_inv_numel":
        kw["stat_inv_scale"] = torch.ones(2, device=device)
    elif case == "overlap":
        amax = counts.view(-1).view(torch.float32)[:2]
    elif case == "grad_dtype":
        g[1] = g[1].double()
    snap = [t.clone() for t in g + [counts, amax, first, found]]
    with pytest.raises((RuntimeError, ValueError), match=match):
        ops.unscale_stats_(g, found, torch.tensor([0.5], device=device), counts, amax, first,
                           **kw)
    for a, b in zip(g + [counts, amax, first, found], snap):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# mpext.telemetry on a training run.

class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.a = torch.nn.Linear(16, 32, dtype=dtype)
        self.b = torch.nn.Linear(32, 32, dtype=dtype)
        self.c = torch.nn.Linear(32, 4, dtype=dtype)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def train(device, telemetry, steps=6, explicit_unscale=False, inf_at=(2,), every=3,
          dtype=torch.float16, hook=None, poll=True):
    """A few steps of mpext.GradScaler + mpext.optim.AdamW on fp16 (or bf16) params, an inf
    injected into c.weight's gradient at the steps in inf_at (skipped by the scaler)."""
    torch.manual_seed(0)
    model = Net(dtype).to(device)
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    tel = mpext.telemetry.attach(scaler, model=model, every=every) if telemetry else None
    gen = torch.Generator().manual_seed(3)
    step = [0]
    inject = model.c.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1], device=g.device), float("inf"))
        if step[0] in inf_at else g)
    reads = []
    for s in range(steps):
        step[0] = s
        x = torch.randn(8, 16, generator=gen).to(device=device, dtype=dtype)
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if hook is not None:
            hook(model, scaler)
        if explicit_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if tel is not None and poll:
            r = tel.poll()
            if r is not None:
                reads.append(r)
    inject.remove()
    return model, opt, scaler, tel, reads


# torch refuses scaler.unscale_ on fp16 gradients: the explicit path runs bf16 and fp32 params
PATHS = [(torch.float16, False), (torch.bfloat16, False), (torch.bfloat16, True),
         (torch.float32, True)]


@pytest.mark.parametrize("dtype,explicit_unscale", PATHS)
def test_telemetry_on_off_same_bits(device, explicit_unscale, dtype):
    """Counting changes no bit of training: params, optimizer state and the scaler's state are
    equal with telemetry on and off (the fused-optimizer path and the unscale_ path, a skipped
    step included)."""
    on = train(device, True, explicit_unscale=explicit_unscale, dtype=dtype)
    off = train(device, False, explicit_unscale=explicit_unscale, dtype=dtype)
    for (n, a), (_, b) in zip(on[0].named_parameters(), off[0].named_parameters()):
        assert torch.equal(bits(a), bits(b)), n
    sa, sb = on[1].state_dict(), off[1].state_dict()
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert on[2].state_dict() == off[2].state_dict()
    assert on[2].get_skipped_steps() == 1
    assert len(on[4]) == 2 and on[4][0]["scale/skips"] == 1 and on[4][1]["scale/skips"] == 0


@pytest.mark.parametrize("dtype,explicit_unscale", PATHS)
def test_telemetry_counts_equal_reference(device, explicit_unscale, dtype):
    """The read's counters equal the reference on the run's own scaled gradients (captured
    after backward), summed over the window; max_abs unscaled by the scale of its step, in both
    unscale paths (the fused optimizer's check-only pass uses the scaler's scale)."""
    want = {"elems": 0, "c": [0, 0, 0, 0], "amax": 0.0}

    def capture(model, scaler):
        inv = 1.0 / scaler.get_scale()
        for p in model.parameters():
            c, m = ref_stats(p.grad, inv)
            want["elems"] += p.numel()
            want["c"] = [x + y for x, y in zip(want["c"], c)]
            want["amax"] = max(want["amax"], float(m))

    model, opt, scaler, tel, reads = train(device, True, steps=3, every=3, inf_at=(),
                                           explicit_unscale=explicit_unscale, hook=capture,
                                           dtype=dtype)
    r = reads[0]
    assert r["grad/elements"] == want["elems"]
    assert r["grad/underflow_count"] == want["c"][1]
    assert r["grad/zeros_frac"] == want["c"][0] / want["elems"]
    assert r["grad/headroom_overflow_frac"] == want["c"][2] / want["elems"]
    assert r["grad/nonfinite_frac"] == 0.0
    assert r["grad/max_abs"] == want["amax"] > 0
    assert r["overflow/site"] == "" and r["scale/skips"] == 0
    assert {"grad/a/underflow_frac", "grad/b/max_abs", "grad/c/zeros_frac"} <= set(r)
    assert r["telemetry/uncounted_unscales"] == 0
    # the window was reset: the next read counts only what came after
    assert tel.read()["grad/elements"] == 0


def test_telemetry_overflow_site_and_scale_history(device):
    """An inf injected into c.weight's gradient at step 2: the read names c.weight as the site,
    counts one skipped step and the scale backed off at that step in the history."""
    model, opt, scaler, tel, reads = train(device, True, steps=6, every=3, inf_at=(2,))
    r = reads[0]
    assert r["overflow/site"] == "c.weight"
    assert r["overflow/params"] == 1
    assert r["scale/skips"] == 1 and r["scale/skips_total"] == 1
    # one row of c.weight (32 values) was inf, in a window of 3 steps
    assert r["grad/nonfinite_frac"] == 32 / (3 * sum(p.numel() for p in model.parameters()))
    scales = [h["scale"] for h in tel.history]
    skipped = [h["skipped"] for h in tel.history]
    assert skipped == [False, False, True, False, False, False]
    assert scales[1] == 2.0 ** 11 and scales[2] == 2.0 ** 10  # grew at 2, backed off at the inf
    assert reads[1]["overflow/site"] == ""


def test_telemetry_site_is_nearest_the_loss(device):
    """An inf entering backward at b's output flows into every gradient of b and a: the site is
    the parameter nearest the loss (b's), and all four are counted as holding one."""
    torch.manual_seed(0)
    model = Net(torch.float16).to(device)
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 10)
    tel = mpext.telemetry.attach(scaler, model=model, every=1)
    def poison(module, inputs, out):  # an inf in b's output gradient, at backward time
        out.register_hook(lambda g: g.index_fill(1, torch.tensor([0], device=g.device),
                                                 float("inf")))

    h = model.b.register_forward_hook(poison)
    x = torch.randn(8, 16).to(device=device, dtype=torch.float16)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    h.remove()
    r = tel.poll()
    assert r["overflow/site"].split(".")[0] == "b"
    assert r["overflow/params"] == 4  # a.weight, a.bias, b.weight, b.bias


class SyncCounter(TorchDispatchMode):
    """Counts the aten ops that read a tensor's value on the host (_local_scalar_dense: item(),
    bool(), ...) and the copies of a non-CPU tensor to the CPU: what synchronises with an
    accelerator."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if "_local_scalar_dense" in name:
            self.syncs.append(name)
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst_dev = (args[0].device if func is torch.ops.aten.copy_.default
                       else kwargs.get("device"))
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" \
                    and dst_dev is not None and torch.device(dst_dev).type == "cpu":
                self.syncs.append(name)
        return func(*args, **kwargs)


def test_telemetry_no_host_sync_between_reads(device):
    """Between reads, telemetry adds no host read: the steps of a run with telemetry on make as
    many host reads (ops and Python-level) as the same steps with it off (none, with
    mpext.GradScaler and the fused mpext.optim.AdamW); the read itself is one."""
    counts = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = Net(torch.float16).to(device)
        opt = mpext.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = mpext.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
        tel = mpext.telemetry.attach(scaler, model=model, every=4) if on else None
        x = torch.randn(8, 16).to(device=device, dtype=torch.float16)
        # a first step outside the count: lazy initialisations may read once
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        mode, host = SyncCounter(), HostReads()
        with host.counting(), mode:
            for _ in range(2):
                scaler.scale(model(x).float().pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if tel is not None:
                    assert tel.poll() is None
        counts[on] = (len(mode.syncs), host.count)
        if tel is not None:
            with host.counting():
                n0 = host.count
                tel.read()
                assert host.count - n0 == 1  # the read's one host transfer (tolist)
    assert counts[True] == counts[False] == (0, 0), counts


def test_attach_bad_arguments():
    scaler = mpext.GradScaler("cpu")
    with pytest.raises(TypeError, match="scaler must be an mpext.GradScaler"):
        mpext.telemetry.attach(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        mpext.telemetry.attach(scaler, every=0)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mpext.telemetry.attach(scaler, model=object())
    tel = mpext.telemetry.attach(scaler)
    with pytest.raises(RuntimeError, match="already has a Telemetry"):
        mpext.telemetry.attach(scaler)
    tel.detach()
    assert "_unscale_grads_" not in scaler.__dict__
    mpext.telemetry.attach(scaler).detach()


# ---------------------------------------------------------------------------------------------
# Integrations.

def test_lightning_callback_logs(tmp_path):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from mpext.telemetry.lightning import TelemetryCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(torch.float16)
            self.automatic_optimization = False
            self.scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 10)
            self.tel = mpext.telemetry.attach(self.scaler, model=self.net, every=2)

        def training_step(self, batch, i):
            opt = self.optimizers()
            loss = self.net(batch[0].half()).float().pow(2).mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(opt.optimizer)
            self.scaler.update()
            opt.optimizer.zero_grad()

        def configure_optimizers(self):
            return mpext.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    cb = TelemetryCallback(module.tel)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16)),
                                       batch_size=8)
    # manual optimization stepping the raw optimizer does not advance global_step: one epoch of
    # 4 batches bounds the run
    trainer = L.Trainer(max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), accelerator="cpu")
    trainer.fit(module, data)
    assert cb.last is not None and cb.last["telemetry/steps"] == 2
    logged = trainer.callback_metrics
    assert "grad/underflow_frac" in logged and "scale/value" in logged
    assert float(logged["scale/value"]) == module.scaler.get_scale()


class Tokens(torch.utils.data.Dataset):
    """16 sequences of 12 tokens (vocabulary 64) for the HF Trainer tests: inputs are labels."""

    def __init__(self):
        self.x = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_hf_trainer_callback_logs(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    import mpext.accelerate
    import mpext.telemetry.hf

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, fp16=True, logging_steps=100, report_to=[], seed=0,
        disable_tqdm=True, dataloader_pin_memory=False, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizer_cls_and_kwargs=(mpext.optim.AdamW, {}))
    scaler = mpext.accelerate.setup_trainer(trainer, init_scale=1024.0)
    tel = mpext.telemetry.hf.attach(trainer, scaler, every=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad/underflow_frac" in h]
    assert [h["step"] for h in logged] == [2, 4]
    assert logged[-1]["scale/value"] == scaler.get_scale()
    assert logged[0]["grad/elements"] == 2 * sum(p.numel() for p in model.parameters()
                                                 if p.requires_grad)
    assert tel.read()["grad/elements"] == 0


@pytest.mark.filterwarnings("ignore:.*master_weights=False without stochastic")
def test_hf_trainer_callback_logs_step_counters(tmp_path):
    """optimizer="trainer": the Trainer's mpext optimizer is counted too, with no scaler (a bf16
    model without masters): the step keys join the logged metrics every 2 steps, with the
    elements of two counted steps, and the window restarts after each."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import mpext.telemetry.hf

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-4, logging_steps=100, report_to=[], seed=0, disable_tqdm=True,
        dataloader_pin_memory=False, save_strategy="no")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(),
        optimizer_cls_and_kwargs=(mpext.optim.AdamW, dict(master_weights=False)))
    with pytest.raises(ValueError, match="optimizer must be None or"):
        mpext.telemetry.hf.attach(trainer, None, optimizer="yes")
    tel = mpext.telemetry.hf.attach(trainer, None, every=2, optimizer="trainer", step_every=1)
    assert trainer.optimizer is not None
    trainer.train()
    logged = [h for h in trainer.state.log_history if "update/lost_frac" in h]
    assert [h["step"] for h in logged] == [2, 4]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all(h["update/elements"] == 2 * numel for h in logged)
    # lr 1e-4 against bf16 params of magnitude ~0.02 (ulp 2^-13): a share of the updates is lost
    assert all(0.0 < h["update/lost_frac"] <= 1.0 for h in logged)
    assert tel.read()["update/elements"] == 0


def test_hf_attach_refuses_a_torch_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import mpext.telemetry.hf
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args)
    with pytest.raises(TypeError, match="must be an mpext.optim optimizer"):
        mpext.telemetry.hf.attach(trainer, None, optimizer="trainer")
    with pytest.raises(ValueError, match="give the scaler"):
        mpext.telemetry.hf.attach(trainer, None)


@pytest.mark.parametrize("inf_at,site", [(5, "c.weight"), (1, "")])
def test_telemetry_unread_window_keeps_the_last_steps(device, inf_at, site):
    """Read after 7 updates with every=3: the history and the site cover the last 3 steps (an
    overflow at step 1 is outside it and its slot, reused, names nothing), the counts every
    step since the last read."""
    model, opt, scaler, tel, _ = train(device, True, steps=7, every=3, inf_at=(inf_at,),
                                       poll=False)
    r = tel.read()
    assert [h["step"] for h in tel.history] == [4, 5, 6]
    assert [h["skipped"] for h in tel.history] == [s == inf_at for s in (4, 5, 6)]
    assert r["overflow/site"] == site
    assert r["overflow/params"] == 1
    assert r["grad/elements"] == 7 * sum(p.numel() for p in model.parameters())
