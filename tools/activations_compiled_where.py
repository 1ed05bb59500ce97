"""What a compiled zoo model's forward graphs hand their backward, tensor by tensor, under
mpext.activations.fp8_saved_tensors(): each saved value of each forward graph (inductor's
partitioner, min-cut, run through aot_autograd with graphs kept) with its dtype and shape, and
whether it is an 8-bit code, a scale, bits, or a raw tensor, and the graph count (breaks).

    PYTHONPATH=.:tests python tools/activations_compiled_where.py hf-llama [--small]

The model's outputs are listed too (first), and parameters as "raw placeholder" (they stay
alive anyway). FILTER=no_static in the environment sets AOTAutograd's
saved_tensors_hooks_filtering_mode (default "donated") for the run.
"""
import collections
import sys

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import mpext.activations as act
from zoo import zoo_models


def main(name, small=False):
    fw, graphs = [], []

    def keep(store):
        def compiler(gm, inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    inner = aot_autograd(fw_compiler=keep(fw), bw_compiler=keep([]),
                         partition_fn=min_cut_rematerialization_partition)

    def backend(gm, inputs):
        graphs.append(gm)
        return inner(gm, inputs)
    build, batch, loss_fn = zoo_models(small)[name]
    torch.manual_seed(0)
    model = build().to(torch.bfloat16).train()
    xb = batch(torch.bfloat16)
    cm = torch.compile(model, backend=backend)
    import os
    mode = os.environ.get("FILTER", "donated")
    with act.fp8_saved_tensors(params=model, warn_unmatched=False), \
            torch._functorch.config.patch(saved_tensors_hooks_filtering_mode=mode):
        loss = loss_fn(cm, xb)
    loss.float().backward()
    by = collections.Counter()
    for g in fw:
        outs = [n for n in g.graph.nodes if n.op == "output"][0].args[0]
        for n in outs:
            v = getattr(n, "meta", {}).get("val") if hasattr(n, "meta") else None
            if not isinstance(v, torch.Tensor):
                continue
            kind = {torch.int8: "int8 code", torch.uint8: "bits"}.get(v.dtype, "raw")
            src = n.op if n.op == "placeholder" else "intermediate"
            by[kind, src, str(v.dtype).replace("torch.", ""),
               "x".join(map(str, v.shape))] += v.numel() * v.element_size()
    print("%s: %d dynamo graphs, %d forward graphs" % (name, len(graphs), len(fw)))
    for k, b in by.most_common(30):
        print("%-10s %-12s %-9s %-16s %8.0f KiB" % (k + (b / 1024,)))


if __name__ == "__main__":
    main(sys.argv[1], small="--small" in sys.argv)
