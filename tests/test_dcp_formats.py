"""torch.distributed.checkpoint (DCP) across mpext's state formats, in one process.

Through ``get_state_dict`` -> ``dcp.save`` -> ``get_state_dict`` of an optimizer in another
format -> ``dcp.load(planner=mpext.integrations.dcp.LoadPlanner())`` -> ``set_state_dict``, the
loaded state must be what ``load_state_dict`` of a ``torch.save`` checkpoint makes of it (the one
conversion, docs/lean_state.md), bit for bit, and the resumed runs must continue alike. Without
the planner a change of format must fail loudly, never load codes as values.

Two tables: AdamW across its param formats (masters, remainders, SR, EMA) and moment formats;
every rule (Adam, AdamW, Lion, SGD with momentum) x every pair of moment formats of the formats
table (``mpext.optim.formats.MOMENT_FORMATS``), in one process on every device and from a
2-rank FSDP2 checkpoint (gloo) into one process. (1 -> 2 gloo ranks: tests/test_distributed.py.)"""
import itertools
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import mpext.integrations.dcp
import mpext.optim
from conftest import CUDA_OK, NO_CUDA_REASON
from mpext.optim import formats, q8_decode
from optim_table import same_bits  # equal bits, NaNs included (a NaN 8-bit block decodes to NaN)

BF16, I8, U8 = torch.bfloat16, torch.int8, torch.uint8
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
Q8 = dict(exp_avg_dtype=I8, exp_avg_sq_dtype=U8)
FORMATS = {
    "master": {},
    "remainder": dict(param_remainders=True),
    "sr": dict(master_weights=False, stochastic_rounding=True),
    "bf16_moments": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
    "q8": Q8,
    "q8_remainder": dict(param_remainders=True, **Q8),
    "ema": dict(ema_decay=0.9),
}

# The rules x moment formats table: each rule's hyperparameters, and every moment quantity of
# the rule (its ``moments``) set to one format of the formats table, by the format's name.
RULES = {"Adam": dict(lr=1e-2, weight_decay=0.01), "AdamW": dict(lr=1e-2),
         "Lion": dict(lr=1e-3, weight_decay=0.1), "SGD": dict(lr=1e-2, momentum=0.9)}
MOMENTS = tuple(formats.MOMENT_FORMATS)  # float32, bfloat16, q8
RULE_CASES = {(rule, m): (rule, dict(RULES[rule], **{q.setting: m for q in
                                                      getattr(mpext.optim, rule).moments}))
              for rule in RULES for m in MOMENTS}
RULE_PAIRS = [(rule, src, dst) for rule in RULES for src in MOMENTS for dst in MOMENTS]


def _case(name):
    """(rule, keywords) of a FORMATS name (AdamW) or a RULE_CASES key."""
    return RULE_CASES[name] if isinstance(name, tuple) else ("AdamW", dict(lr=1e-2,
                                                                           **FORMATS[name]))


def _model(device, seed=0):
    """Its first weight (5120 elements) keeps 8-bit moments in an 8-bit format, the rest FP32
    (fewer than MIN_8BIT_NUMEL)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 80), nn.GELU(), nn.Linear(80, 8)).to(device, BF16)


def _opt(model, name):
    rule, kw = _case(name)
    return getattr(mpext.optim, rule)(model.parameters(), **kw)


def _train(model, opt, steps):
    device = next(model.parameters()).device
    for k in steps:
        gen = torch.Generator().manual_seed(100 + k)
        x = torch.randn(16, 64, generator=gen).to(device, BF16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _saved(tmp_path, name, device):
    model = _model(device)
    opt = _opt(model, name)
    _train(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / ("%s_%s" % (device, "_".join(name) if isinstance(name, tuple)
                                      else name)))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    return path, buf.getvalue()


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory):
    """device -> checkpoint name -> (DCP path, torch.save bytes), made on first use."""
    tmp = tmp_path_factory.mktemp("dcp")
    cache = {}

    def get(device, name):
        if (device, name) not in cache:
            cache[(device, name)] = _saved(tmp, name, device)
        return cache[(device, name)]
    return get


def _dcp_resume(path, name, planner, device):
    model = _model(device, seed=1)  # other weights: the model's state must come from the
    opt = _opt(model, name)         # checkpoint
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _torch_save_resume(blob, name, device):
    model = _model(device, seed=1)
    opt = _opt(model, name)
    sd = torch.load(io.BytesIO(blob), weights_only=False, map_location=device)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return model, opt


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert same_bits(p.detach(), q.detach())
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].device == sb[k].device, k
            assert same_bits(sa[k], sb[k]), k


def _check_conversion(saved_on, device, src, dst):
    path, blob = saved_on(device, src)
    got = _dcp_resume(path, dst, mpext.integrations.dcp.LoadPlanner(), device)
    want = _torch_save_resume(blob, dst, device)
    _assert_same(got, want)
    for m, o in (got, want):
        _train(m, o, range(3, 5))
    _assert_same(got, want)
    return got


@pytest.mark.parametrize("src,dst", list(itertools.product(FORMATS, FORMATS)))
def test_dcp_load_converts_as_load_state_dict(saved_on, device, src, dst):
    _check_conversion(saved_on, device, src, dst)


@pytest.mark.parametrize("rule,src,dst", RULE_PAIRS)
def test_every_rule_converts_every_moment_format_as_load_state_dict(saved_on, device, rule,
                                                                     src, dst):
    """Every rule x every (saved, loaded) pair of moment formats, SGD's momentum_buffer[_q8]
    included: DCP with the planner loads what load_state_dict makes of the torch.save twin."""
    model, opt = _check_conversion(saved_on, device, (rule, src), (rule, dst))
    st = opt.state[model[0].weight]
    fmt = formats.MOMENT_FORMATS[dst]
    for q in type(opt).moments:  # the loaded optimizer keeps its own format
        keys = fmt.keys(q.name)
        assert set(keys) <= set(st), (q.name, sorted(st))
        assert st[keys[0]].dtype == fmt.storage_dtype(q), (q.name, st[keys[0]].dtype)
        other = {k for f in formats.MOMENT_FORMATS.values() for k in f.keys(q.name)}
        assert not (other - set(keys)) & set(st), (q.name, sorted(st))


@pytest.mark.skipif(not CUDA_OK, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("rule,src,dst", RULE_PAIRS)
def test_a_cpu_checkpoint_converts_on_cuda_to_the_bits_of_the_cpu(saved_on, rule, src, dst):
    """A CPU run's checkpoint loaded with the planner into an optimizer on CUDA (the
    conversion's decode and encode run there) holds the bits of the same load on the CPU."""
    path, _ = saved_on("cpu", (rule, src))
    (mc, oc), (mg, og) = [_dcp_resume(path, (rule, dst), mpext.integrations.dcp.LoadPlanner(), d)
                          for d in ("cpu", "cuda")]
    for p, q in zip(mc.parameters(), mg.parameters()):
        assert q.device.type == "cuda" and same_bits(p.detach(), q.detach().cpu())
        assert oc.state[p].keys() == og.state[q].keys()
        for k, v in oc.state[p].items():
            assert og.state[q][k].device.type == "cuda", k
            assert same_bits(v, og.state[q][k].cpu()), k


def test_8bit_codes_load_into_bf16_moments_as_their_decoded_values(saved_on, device):
    path, blob = saved_on(device, "q8")
    model, opt = _dcp_resume(path, "bf16_moments", mpext.integrations.dcp.LoadPlanner(), device)
    src = torch.load(io.BytesIO(blob), weights_only=False, map_location=device)["optim"]
    src = src["state"][0]
    st = opt.state[next(model.parameters())]
    want = q8_decode(src["exp_avg_q8"], src["exp_avg_q8_scale"]).to(BF16)
    assert st["exp_avg"].dtype == BF16 and torch.equal(st["exp_avg"], want)
    assert want.abs().max() < 1  # values, not codes


@pytest.mark.parametrize("src,dst", [("q8", "bf16_moments"), ("q8", "master"),
                                     ("bf16_moments", "q8"), ("master", "remainder"),
                                     (("SGD", "q8"), ("SGD", "float32")),
                                     (("SGD", "float32"), ("SGD", "q8"))])
def test_without_the_planner_a_change_of_format_fails_loudly(saved_on, device, src, dst):
    path, _ = saved_on(device, src)
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: "
                                            r"optim\.state\.0\.weight\."):
        _dcp_resume(path, dst, None, device)


def test_format_entries_are_every_rules_every_quantitys_keys():
    """The planner's entries, against the keys written out here from the formats table's
    definition (docs/lean_state.md, "State keys")."""
    want = {"master_param", "param_remainder", "ema_param"}
    for rule in ("Adam", "Lion", "SGD"):
        for q in getattr(mpext.optim, rule).moments:
            want |= {q.name, q.name + "_q8", q.name + "_q8_scale",
                     q.name + "_scale"}  # the last: codes saved before they had keys
    assert mpext.integrations.dcp.format_entries() == want


# ---- 2 gloo ranks -> 1 process ---------------------------------------------------------------
# Every rule x moment format saved by a 2-rank FSDP2 run (one spawn saves all of them), loaded
# in one process into every moment format. The reference is load_state_dict converting the
# same state: the checkpoint loaded, without conversion, into an optimizer of its own format,
# whose state_dict() the optimizer of the other format loads. (gloo: CPU tensors.)

GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()


def _two_rank_saves(rank, out_dir):
    import os
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for name in RULE_CASES:
        model = _model("cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _opt(model, name)
        _train(model, opt, range(3))  # the full batch on both ranks
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, *name))
    return {}


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    from test_distributed import _spawn

    out = tmp_path_factory.mktemp("dcp_2ranks")
    _spawn(_two_rank_saves, out, world=2)
    return out


@pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available")
@pytest.mark.parametrize("rule,src,dst", RULE_PAIRS)
def test_two_rank_checkpoint_converts_in_one_process_as_load_state_dict(two_rank_checkpoints,
                                                                        rule, src, dst):
    path = str(two_rank_checkpoints / rule / src)
    got = _dcp_resume(path, (rule, dst), mpext.integrations.dcp.LoadPlanner(), "cpu")
    m_src, o_src = _dcp_resume(path, (rule, src), None, "cpu")  # the state as saved
    assert all(float(s["step"]) == 3 for s in o_src.state.values())
    model = _model("cpu", seed=1)
    opt = _opt(model, (rule, dst))
    model.load_state_dict(m_src.state_dict())
    opt.load_state_dict(o_src.state_dict())
    _assert_same(got, (model, opt))
    for m, o in (got, (model, opt)):
        _train(m, o, range(3, 5))
    _assert_same(got, (model, opt))
