"""What a compiled zoo model's forward graphs hand their backward, tensor by tensor, under
mpext.activations.fp8_saved_tensors() (or without it: --plain): the graphs inductor really
compiles (torch._inductor.compile_fx with a recording inner compile), each saved value with
its dtype, shape and bytes, what made it (for a packed value, the tensor the pack read), and
whether it is an 8-bit code, a scale, bits, or raw, with the reason a raw one was not packed.

    PYTHONPATH=.:tests python tools/activations_compiled_where.py hf-llama [--small] [--plain]

FILTER=no_static in the environment sets AOTAutograd's saved_tensors_hooks_filtering_mode
(default: mpext's) for the run.
"""
import collections
import contextlib
import os
import sys

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.multiprocessing.reductions import StorageWeakRef

import mpext.activations as act
from zoo import zoo_models

_VIEWS = {"view", "_unsafe_view", "permute", "transpose", "t", "expand", "slice", "select",
          "unsqueeze", "squeeze", "alias", "as_strided", "reshape", "clone", "convert_element_type",
          "_to_copy", "contiguous"}


def _short(n):
    t = n.op
    if n.op == "call_function":
        t = getattr(n.target, "__name__", None) if not isinstance(
            n.target, torch._ops.OpOverload) else str(n.target)
        t = t or str(n.target)
    return t.replace("aten.", "").replace("prims.", "").replace(".default", "") \
        .replace("mpext.", "")


def _quantizer(n):
    """The quantize node a pack output (a getitem of it) comes from, or None."""
    if n.op == "call_function" and _short(n) == "getitem" and \
            isinstance(n.args[0], torch.fx.Node) and _short(n.args[0]).split(".")[0] in (
                "int8_block_quantize", "fp8_quantize"):
        return n.args[0]
    return None


def _origin(n):
    """The node a saved value was made from: for a pack's outputs the tensor the quantize
    read (through the views and copies the pack adds), for a raw view its base."""
    q = _quantizer(n)
    if q is not None:
        n = q.args[0]
    for _ in range(8):
        src = [a for a in n.args if isinstance(a, torch.fx.Node)] \
            if n.op == "call_function" else []
        if not src or _short(n).split(".")[0] not in _VIEWS:
            break
        n = src[0]
    return n


def saved_table(name, small=False, plain=False):
    """Rows (kind, what made it, dtype, shape, bytes) of every value the forward graphs save
    for backward, and the number of dynamo graphs."""
    fw, bw, graphs = [], [], []

    def inner(gm, inputs, **kw):
        (bw if kw.get("is_backward") else fw).append(gm)
        return compile_fx_inner(gm, inputs, **kw)

    def backend(gm, inputs):
        graphs.append(gm)
        return compile_fx(gm, inputs, inner_compile=inner)
    build, batch, loss_fn = zoo_models(small)[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build().to(torch.bfloat16).train()
    xb = batch(torch.bfloat16)
    cm = torch.compile(model, backend=backend)
    mode = os.environ.get("FILTER")
    cfg = torch._functorch.config.patch(saved_tensors_hooks_filtering_mode=mode) if mode \
        else contextlib.nullcontext()
    ctx = contextlib.nullcontext() if plain else act.fp8_saved_tensors(
        params=model, warn_unmatched=False)
    with ctx, cfg:
        loss = loss_fn(cm, xb)
    loss.float().backward()
    rows = []
    for g in fw:
        outs = [n for n in g.graph.nodes if n.op == "output"][0].args[0]
        names = {n.name for n in outs if isinstance(n, torch.fx.Node)}
        # backward graphs compile as the backward reaches them (in reverse): the one whose
        # saved inputs are all this forward's outputs
        saved_names = []
        for b in bw:
            cand = [n.name for n in b.graph.nodes if n.op == "placeholder"
                    and not n.name.startswith("tangents")]
            if cand and set(cand) <= names:
                saved_names = cand
                break
        by_name = {n.name: n for n in outs if isinstance(n, torch.fx.Node)}
        user = outs[:len(outs) - len(saved_names)]  # the graph's outputs, then what it saves
        store = lambda n: StorageWeakRef(n.meta["val"].untyped_storage())  # noqa: E731
        ins = {store(n) for n in g.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor)}
        outputs = {store(n) for n in user if isinstance(n, torch.fx.Node)
                   and isinstance(n.meta.get("val"), torch.Tensor)}
        for name in saved_names:
            n = by_name.get(name)
            v = n.meta.get("val") if n is not None else None
            if not isinstance(v, torch.Tensor):
                continue
            o = _origin(n)
            kind = {torch.int8: "int8 code", torch.uint8: "bits"}.get(v.dtype, "raw")
            if n.op == "placeholder":
                kind = "input"  # a parameter or the batch: alive anyway
            elif _quantizer(n) is not None and kind == "raw":
                kind = "scale"
            elif kind == "raw" and store(n) in outputs:
                kind = "raw output"  # an alias of what the graph returns (HF's KV cache)
            elif kind == "raw" and store(n) in ins:
                kind = "raw input view"
            ov = o.meta.get("val")
            made = "%s %s" % (_short(o), "x".join(map(str, ov.shape))) \
                if isinstance(ov, torch.Tensor) and o is not n else _short(n)
            rows.append((kind, made, str(v.dtype).replace("torch.", ""),
                         "x".join(map(str, v.shape)) + ("" if v.is_contiguous() else " (strided)"),
                         v.untyped_storage().nbytes() if n.op != "placeholder"
                         else v.numel() * v.element_size()))
    return rows, len(graphs)


def main(name, small=False, plain=False):
    rows, ngraphs = saved_table(name, small, plain)
    tot = collections.Counter()
    for r in rows:
        tot[r[0]] += r[4]
    print("%s: %d dynamo graph(s); saved for backward: %s" % (name, ngraphs, ", ".join(
        "%s %.0f KiB" % (k, b / 1024) for k, b in tot.most_common())))
    by = collections.Counter()
    for kind, made, dt, shape, b in rows:
        by[kind, made, dt, shape] += b
    for k, b in by.most_common(40):
        print("%-11s %-34s %-9s %-20s %8.1f KiB" % (k + (b / 1024,)))


if __name__ == "__main__":
    main(sys.argv[1], small="--small" in sys.argv, plain="--plain" in sys.argv)
