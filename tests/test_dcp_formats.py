"""torch.distributed.checkpoint (DCP) across mpext's state formats, in one process.

Through ``get_state_dict`` -> ``dcp.save`` -> ``get_state_dict`` of an optimizer in another
format -> ``dcp.load(planner=mpext.dcp.LoadPlanner())`` -> ``set_state_dict``, the loaded state
must be what ``load_state_dict`` of a ``torch.save`` checkpoint makes of it (the one conversion,
docs/lean_state.md), bit for bit, and the resumed runs must continue alike. Without the planner a
change of format must fail loudly, never load codes as values. (1 -> 2 gloo ranks:
tests/test_distributed.py.)"""
import itertools
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import mpext.dcp
from mpext.optim import AdamW, q8_decode

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


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 80), nn.GELU(), nn.Linear(80, 8)).to(BF16)


def _train(model, opt, steps):
    for k in steps:
        gen = torch.Generator().manual_seed(100 + k)
        x = torch.randn(16, 64, generator=gen).to(BF16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _saved(tmp_path, fmt):
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, **FORMATS[fmt])
    _train(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / fmt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    return path, buf.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    return {fmt: _saved(tmp, fmt) for fmt in FORMATS}


def _dcp_resume(path, fmt, planner):
    model = _model(seed=1)  # other weights: the model's state must come from the checkpoint
    opt = AdamW(model.parameters(), lr=1e-2, **FORMATS[fmt])
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _torch_save_resume(blob, fmt):
    model = _model(seed=1)
    opt = AdamW(model.parameters(), lr=1e-2, **FORMATS[fmt])
    sd = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return model, opt


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and sa[k].device == sb[k].device, k
            assert torch.equal(sa[k], sb[k]) or (sa[k].isnan().any() and torch.equal(
                sa[k].nan_to_num(), sb[k].nan_to_num())), k


@pytest.mark.parametrize("src,dst", list(itertools.product(FORMATS, FORMATS)))
def test_dcp_load_converts_as_load_state_dict(saved, src, dst):
    path, blob = saved[src]
    got, want = _dcp_resume(path, dst, mpext.dcp.LoadPlanner()), _torch_save_resume(blob, dst)
    _assert_same(got, want)
    for m, o in (got, want):
        _train(m, o, range(3, 5))
    _assert_same(got, want)


def test_8bit_codes_load_into_bf16_moments_as_their_decoded_values(saved):
    path, blob = saved["q8"]
    model, opt = _dcp_resume(path, "bf16_moments", mpext.dcp.LoadPlanner())
    src = torch.load(io.BytesIO(blob), weights_only=False)["optim"]["state"][0]
    st = opt.state[next(model.parameters())]
    want = q8_decode(src["exp_avg_q8"], src["exp_avg_q8_scale"]).to(BF16)
    assert st["exp_avg"].dtype == BF16 and torch.equal(st["exp_avg"], want)
    assert want.abs().max() < 1  # values, not codes


@pytest.mark.parametrize("src,dst", [("q8", "bf16_moments"), ("q8", "master"),
                                     ("bf16_moments", "q8"), ("master", "remainder")])
def test_without_the_planner_a_change_of_format_fails_loudly(saved, src, dst):
    path, _ = saved[src]
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: "
                                            r"optim\.state\.0\.weight\."):
        _dcp_resume(path, dst, None)
