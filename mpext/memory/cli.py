"""The command line of mpext.memory, the training-memory calculator ("will it fit?").

``estimate`` says what a model trained in a precision mode, with an optimizer and a ZeRO stage,
holds per device (``mpext.memory.estimator``, whose docstring gives the accounting); ``measure``
counts what a live training setup holds, by the same rows (``mpext.memory.meter``). This module
is the command line and the report: ``python -m mpext.memory`` prints the estimate as a table
(``--json``, ``--png`` for a chart) and, given ``--gpu-memory``, whether each column fits that
GPU (its stated assumptions: the CUDA context, the allocator's slack) and what would make it fit
(``fit_changes``). ``docs/memory.md`` documents every row.
"""
import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from .estimator import (ALIASES, ATTENTIONS, DEFAULT_BUCKET_BYTES, DEVICES, FORMAT_MODES,  # noqa: F401
                              MODELS, MODES, OPTIMIZERS, RULES, SCALER_SCALARS, Breakdown,
                              ModelSpec, ModeSpec, activation_bytes, activation_formula,
                              estimate, format_mode,
                              format_mode_name,
                              gpt_params, gpt_shapes, llama_params, llama_shapes, model_names,
                              mode_supports, model_spec, optimizer_states, rule_states,
                              SHARDINGS, fsdp2_shard, stage_label, zero_partition,
                              activation_compression, FAMILIES, GpuBudget, fit_changes,
                              gpu_memory_bytes, CUDA_CONTEXT_BYTES, ALLOCATOR_SLACK)
from ..activations import POLICIES
from .activation_model import ACTIVATIONS
from .meter import measure  # noqa: F401

__all__ = ["MODES", "FORMAT_MODES", "ALIASES", "RULES", "OPTIMIZERS", "MODELS", "ModeSpec",
           "ModelSpec", "Breakdown", "estimate", "SHARDINGS", "fsdp2_shard",
           "zero_partition", "stage_label", "optimizer_states", "rule_states",
           "format_mode", "format_mode_name", "activation_bytes", "activation_formula",
           "activation_compression", "gpt_params", "gpt_shapes",
           "llama_params", "llama_shapes", "measure", "model_names", "model_spec", "mode_supports",
           "FAMILIES", "GpuBudget", "fit_changes", "gpu_memory_bytes", "verdict_lines", "main"]

# ---------------------------------------------------------------------------------------------
# The command line

ROWS = [("weights", "weights"), ("gradients", "gradients"), ("master_weights", "master weights"),
        ("optimizer_states", "optimizer states"), ("ema", "EMA of the weights (fp32)"),
        ("scaler", "loss scaler"), ("comm_buffers", "DDP's gradient buckets"),
        ("persistent", "**persistent**"), ("activations", "activations (per step)"),
        ("autocast_copies", "autocast weight copies (per step)"),
        ("grad_bucket", "released gradients, one bucket (per step)"),
        ("step_buffers", "FP32 master grads (during step)"), ("total", "**total**")]

OPTIONAL_ROWS = ("ema", "scaler", "comm_buffers", "autocast_copies", "grad_bucket",
                 "step_buffers")  # shown when not all zero
_COMPRESS_DEFAULTS = activation_compression(True)  # mpext.activations' own defaults
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _count_arg(minimum: int = 1):
    def parse(text: str) -> int:
        t = text.strip()
        mult = 1.0
        if t[-1:].upper() in _SUFFIX:
            mult, t = _SUFFIX[t[-1].upper()], t[:-1]
        try:
            v = float(t) * mult
        except ValueError:
            raise argparse.ArgumentTypeError("not a number: %r" % (text,)) from None
        if not math.isfinite(v) or v != int(v):
            raise argparse.ArgumentTypeError("must be a whole number, got %r" % (text,))
        if v < minimum:
            raise argparse.ArgumentTypeError("must be >= %d, got %r" % (minimum, text))
        return int(v)
    return parse


def _list_arg(name: str, choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if items == ["all"]:
            return None  # every choice (for --mode: every mode the optimizer has)
        bad = [s for s in items if s not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError("unknown %s %r; choose from %s (comma-separated, "
                                             "or 'all')" % (name, ",".join(bad) or text,
                                                            ", ".join(choices)))
        return items
    return parse


def _size_arg(option: str):
    def parse(text: str) -> int:
        try:
            return gpu_memory_bytes(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    return parse


def _share_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not a number: %r" % (text,)) from None
    if not (math.isfinite(v) and 0 <= v < 10):
        raise argparse.ArgumentTypeError("a share of the estimate between 0 and 10 (0.1 is "
                                         "10%%), got %r" % (text,))
    return v


# --zero's words for PyTorch's own engines (estimate's sharding='torch'): (stage, sharding)
# ("ddp": DistributedDataParallel's replicas, estimate's ddp=True)
ZERO_WORDS = {"fsdp2": (3, "torch"), "zero1-torch": (1, "torch"), "ddp": (0, "ddp")}


def _zero_arg(text: str) -> List[tuple]:
    """--zero: (stage, sharding) per comma-separated item, a stage 0-3 (the even partition)
    or one of ZERO_WORDS."""
    out = []
    for s in text.split(","):
        s = s.strip()
        if s in ("0", "1", "2", "3"):
            out.append((int(s), "even"))
        elif s in ZERO_WORDS:
            out.append(ZERO_WORDS[s])
        else:
            raise argparse.ArgumentTypeError(
                "ZeRO stage must be 0, 1, 2 or 3, or PyTorch's %s (comma-separated for "
                "several), got %r" % (" or ".join(ZERO_WORDS), text))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpext.memory",
        description="Per-device training memory: weights, gradients, master weights, optimizer "
                    "states, activations, for native AMP and mpext modes, with ZeRO stages.",
        epilog="Examples: python -m mpext.memory --model llama-7b --mode fp32,amp-bf16,mpext-bf16 "
               "--zero 0,1,2,3 --world-size 8 --batch 1; python -m mpext.memory --model "
               "llama-7b --batch 1 --gpu-memory 80GiB (does it fit, and what would make it "
               "fit). Accounting: docs/memory.md.")
    # So that "--params -7e9" reaches the check (and its message) instead of reading as an
    # option: argparse's own pattern knows no exponents. No option looks like a number.
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[KMBGTkmbgt]?$")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count_arg(),
                     help="parameter count: 7e9, 7B, 124M, 1300000")
    src.add_argument("--model", choices=model_names(),
                     help="a known model (sets params and the activation shape)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                   help="default: %(default)s")
    p.add_argument("--rule", choices=list(RULES),
                   help="mpext.optim's optimizer instead of --optimizer: its moments are the "
                        "state, every mode and format exists for it")
    p.add_argument("--momentum", type=float, default=0.0,
                   help="SGD's momentum, with --rule sgd (default 0: no momentum_buffer)")
    p.add_argument("--mode", type=_list_arg("mode", list(MODES) + list(FORMAT_MODES)),
                   default=None,
                   help="one or more of %s, comma-separated, or 'all' (default: every mode "
                        "the optimizer has; the mpext-bf16-*/mpext-fp16-sr* lean modes are "
                        "mpext.optim.Adam/AdamW's); or any format of mpext.optim as "
                        "mpext-<fp32|bf16|fp16>-<param format>-<moment format>, e.g. %s"
                        % (", ".join(MODES), ", ".join(list(FORMAT_MODES)[:3])))
    p.add_argument("--ema", action="store_true",
                   help="keep an FP32 EMA of the weights (mpext: mpext.optim.Adam/AdamW's "
                        "ema_decay; native: an FP32 AveragedModel)")
    p.add_argument("--grad-release", action="store_true",
                   help="the step inside backward (mpext.optim's release_grads): no gradient "
                        "persists; one bucket of them is alive during the backward")
    p.add_argument("--bucket-bytes", type=_count_arg(0), default=DEFAULT_BUCKET_BYTES,
                   help="the release's bucket, in bytes (default 4 MiB; under FSDP2 per rank: "
                        "the whole gradients' bytes over the world size)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, metavar="MB",
                   help="with --zero ddp: DDP's bucket_cap_mb (default DDP's: 25, the first "
                        "bucket 1 MiB); sets the released gradients' peak")
    p.add_argument("--zero", type=_zero_arg, default=[(0, "even")],
                   help="ZeRO stage(s) 0-3 (the paper's even partition), fsdp2 (PyTorch's "
                        "fully_shard: dim 0 of each tensor padded to a multiple of the world "
                        "size), zero1-torch (ZeroRedundancyOptimizer: each tensor's state "
                        "whole on one rank) or ddp (DistributedDataParallel: replicas, its "
                        "gradient buckets counted), comma-separated (default 0); PyTorch's "
                        "figures are the busiest rank's. --grad-release on more than one "
                        "process: fsdp2 and ddp")
    p.add_argument("--world-size", type=_count_arg(), default=1,
                   help="data-parallel devices (default 1)")
    act = p.add_argument_group("activations (all of batch, seq, hidden, layers, heads; "
                               "--model fills in all but batch)")
    act.add_argument("--batch", type=_count_arg(), help="micro-batch size per device")
    act.add_argument("--seq", type=_count_arg(), help="sequence length")
    act.add_argument("--hidden", type=_count_arg(), help="hidden size")
    act.add_argument("--layers", type=_count_arg(), help="transformer layers")
    act.add_argument("--heads", type=_count_arg(), help="attention heads")
    act.add_argument("--vocab", type=_count_arg(),
                     help="vocabulary size (adds the FP32 logits)")
    act.add_argument("--no-dropout", action="store_true",
                     help="no dropout masks in the activation estimate")
    act.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                     help="sdpa (fused: no s x s tensor saved; default) or eager (the "
                          "probabilities saved)")
    act.add_argument("--device", choices=DEVICES, default="cuda",
                     help="where it trains: on the CPU dropout masks take the input's dtype "
                          "and SDPA with dropout saves what eager does (default cuda)")
    act.add_argument("--compress-activations", nargs="?", const="all", choices=POLICIES,
                     metavar="POLICY",
                     help="the saved activations mpext.activations stores in FP8 (1 byte per "
                          "element + a float32 scale per block): POLICY all (default), "
                          "layers, linear or size")
    act.add_argument("--compress-block-size", type=_count_arg(), metavar="N",
                     help="elements per scale along the last dimension (default %d)"
                          % _COMPRESS_DEFAULTS["block_size"])
    act.add_argument("--compress-min-bytes", type=_count_arg(0), metavar="N",
                     help="the size policy's threshold (default %d)"
                          % _COMPRESS_DEFAULTS["min_bytes"])
    act.add_argument("--family", choices=FAMILIES,
                     help="whose activation formula, with --params: gpt (pre-LayerNorm, GELU "
                          "MLP; the default), llama (RMSNorm, RoPE, SwiGLU; needs --ffn) or cnn "
                          "(Conv2d + BatchNorm + ReLU residual blocks: --batch images, --seq "
                          "H*W pixels of a square image, --hidden channels, --layers blocks, "
                          "--heads 1, --vocab classes; docs/memory.md). --model sets it")
    act.add_argument("--activation", choices=ACTIVATIONS,
                     help="the gpt family's MLP activation, by its transformers name (default "
                          "gelu; GPT-2's hub default is gelu_new, whose pointwise chain saves "
                          "five ffn-wide tensors where gelu saves two)")
    act.add_argument("--ffn", type=_count_arg(),
                     help="the llama family's MLP width (intermediate_size)")
    act.add_argument("--checkpointing", action="store_true",
                     help="activation checkpointing of every block: each block's input kept, "
                          "one block recomputed at a time in the backward")
    fit = p.add_argument_group("does it fit?")
    fit.add_argument("--gpu-memory", type=_size_arg("--gpu-memory"), metavar="SIZE",
                     help="the GPU's memory: 24GB, 80GiB, or a bare number of GB (10^9 bytes, "
                          "as GPUs are sold; a card sold as 80GB holds about 80GiB); prints "
                          "whether each column fits and what to change to make it fit")
    fit.add_argument("--cuda-context", type=_size_arg("--cuda-context"), metavar="SIZE",
                     default=CUDA_CONTEXT_BYTES,
                     help="GPU memory taken by the CUDA context and kernels before any tensor "
                          "(assumed: 512MiB)")
    fit.add_argument("--allocator-slack", type=_share_arg, metavar="SHARE",
                     default=ALLOCATOR_SLACK,
                     help="what the caching allocator reserves beyond the live tensors, as a "
                          "share of the estimate (assumed: 0.10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", metavar="PATH", help="also write a stacked bar chart of the columns")
    return p


def _configs(args, parser) -> List[Breakdown]:
    shape = {k: getattr(args, k) for k in ("batch", "seq", "hidden", "layers", "heads", "vocab")}
    dropout = not args.no_dropout
    family, ffn = args.family or "gpt", args.ffn
    if args.model:
        m = model_spec(args.model)
        if args.family and args.family != m.family:
            parser.error("argument --family: %s is a %s model (its own formula), not %s"
                         % (args.model, m.family, args.family))
        if args.ffn is not None:
            parser.error("argument --ffn: --model %s sets it" % args.model)
        family, ffn = m.family, m.ffn
        params = list(m.shapes)  # per tensor: 8-bit keeps small ones in FP32, FSDP2 pads dim 0
        dropout = dropout and m.dropout
        for k, v in (("seq", m.seq), ("hidden", m.hidden), ("layers", m.layers),
                     ("heads", m.heads), ("vocab", m.vocab)):
            if shape[k] is None:
                shape[k] = v
        if shape["batch"] is None:  # no batch: persistent memory only
            shape = {k: None for k in shape}
    else:
        params = args.params
    if shape["heads"] is not None and shape["hidden"] is not None \
            and shape["heads"] > shape["hidden"]:
        parser.error("argument --heads: %d heads cannot exceed --hidden %d"
                     % (shape["heads"], shape["hidden"]))
    core = [k for k in ("batch", "seq", "hidden", "layers", "heads")]
    given = [k for k in core if shape[k] is not None]
    if given and len(given) != len(core):
        parser.error("the activation estimate needs --%s as well (given: --%s)"
                     % (", --".join(k for k in core if shape[k] is None), ", --".join(given)))
    if shape["vocab"] is not None and not given:
        parser.error("argument --vocab: only used with the activation shape (--batch, --seq, "
                     "--hidden, --layers, --heads)")
    for opt, used in (("--checkpointing", args.checkpointing), ("--ffn", args.ffn is not None),
                      ("--family", args.family is not None)):
        if used and not given:
            parser.error("argument %s: only used with the activation shape (--batch, --seq, "
                         "--hidden, --layers, --heads)" % opt)
    if family == "llama":
        if ffn is None:
            parser.error("argument --ffn: the llama formula needs the MLP's width "
                         "(intermediate_size; LLaMA-7B: 11008)")
        if not args.no_dropout and not args.model:
            dropout = False  # LLaMA trains without dropout; its formula has none
    elif args.ffn is not None:
        parser.error("argument --ffn: only with --family llama")
    if args.activation is not None:
        if not given:
            parser.error("argument --activation: only used with the activation shape (--batch, "
                         "--seq, --hidden, --layers, --heads)")
        if family != "gpt":
            parser.error("argument --activation: the gpt family's MLP activation; the %s "
                         "family's is its own" % family)
    if family == "cnn" and given:
        if shape["heads"] != 1:
            parser.error("argument --heads: the cnn family has no attention; give --heads 1")
        if math.isqrt(shape["seq"]) ** 2 != shape["seq"]:
            parser.error("argument --seq: the cnn family's --seq is the H*W pixels of a square "
                         "image, got %d (other shapes: mpext.memory.activation_bytes(..., "
                         "width=W))" % shape["seq"])
        if args.checkpointing:
            parser.error("argument --checkpointing: not estimated for the cnn family")
        dropout = False  # its formula has none
    if args.checkpointing and args.compress_activations:
        parser.error("argument --checkpointing: not estimated together with "
                     "--compress-activations")
    compress = None
    if args.compress_activations:
        compress = {"policy": args.compress_activations}
        if args.compress_block_size is not None:
            compress["block_size"] = args.compress_block_size
        if args.compress_min_bytes is not None:
            if args.compress_activations != "size":
                parser.error("argument --compress-min-bytes: the size policy's threshold, "
                             "only with --compress-activations size")
            compress["min_bytes"] = args.compress_min_bytes
        if not given:
            parser.error("argument --compress-activations: only used with the activation "
                         "shape (--batch, --seq, --hidden, --layers, --heads)")
        if family == "llama":
            parser.error("argument --compress-activations: estimated for the gpt family only "
                         "of the transformer families (and for cnn): not measured on %s's "
                         "tensors yet" % family)
        if shape["hidden"] % shape["heads"]:
            parser.error("argument --heads: --compress-activations needs heads that divide "
                         "--hidden %d (the blocks run along a head's width), got %d"
                         % (shape["hidden"], shape["heads"]))
    elif args.compress_block_size is not None or args.compress_min_bytes is not None:
        parser.error("argument --compress-%s: only with --compress-activations"
                     % ("block-size" if args.compress_block_size is not None else "min-bytes"))
    if any(z > 0 for z, _ in args.zero) and args.world_size == 1:
        print("note: ZeRO with --world-size 1 partitions over one device (no saving)",
              file=sys.stderr)
    if args.momentum and args.rule != "sgd":
        parser.error("argument --momentum: SGD's momentum, only with --rule sgd")
    if args.momentum < 0:
        parser.error("argument --momentum: must be >= 0, got %r" % args.momentum)
    if args.grad_release and args.rule is None and args.optimizer not in ("adam", "adamw"):
        parser.error("argument --grad-release: the release is mpext.optim's; give --rule, or "
                     "--optimizer adam or adamw")
    engines = [s for z, s in args.zero if not (z, s) in ((3, "torch"), (0, "ddp"))]
    if args.grad_release and args.world_size > 1 and engines:
        parser.error("argument --grad-release: not supported with more than one process "
                     "(--world-size %d) but under --zero fsdp2 or ddp (the release steps the "
                     "gradients PyTorch's FSDP2 or DDP reduced)" % args.world_size)
    if args.ddp_bucket_cap_mb is not None and (
            not all(s == "ddp" for _, s in args.zero) or not args.ddp_bucket_cap_mb > 0):
        parser.error("argument --ddp-bucket-cap-mb: a number > 0, with --zero ddp only")
    modes = args.mode
    if modes is None:
        modes = [m for m in MODES if mode_supports(m, args.optimizer, args.ema, args.rule)]
    bad = [m for m in modes if not mode_supports(m, args.optimizer, rule=args.rule)]
    if bad:
        parser.error("argument --mode: %s %s mpext.optim.Adam/AdamW's leaner state, not "
                     "available with --optimizer %s (use adam or adamw)"
                     % (", ".join(bad), "is" if len(bad) == 1 else "are", args.optimizer))
    bad = [m for m in modes if not mode_supports(m, args.optimizer, args.ema, args.rule)]
    if bad:
        parser.error("argument --ema: mpext keeps an EMA in mpext.optim.Adam/AdamW (ema_decay), "
                     "not with --optimizer %s; drop --ema or the mode(s) %s"
                     % (args.optimizer, ", ".join(bad)))
    out = []
    for mode in modes:
        for z, sharding in args.zero:
            engine = dict(ddp=True, ddp_bucket_cap_mb=args.ddp_bucket_cap_mb) \
                if sharding == "ddp" else {}
            kw = dict(params=params, optimizer=args.optimizer, mode=mode, zero=z, **engine,
                      world_size=args.world_size, sharding="even" if engine else sharding,
                      dropout=dropout,
                      attention=args.attention, device=args.device, ema=args.ema,
                      rule=args.rule, momentum=args.momentum, grad_release=args.grad_release,
                      bucket_bytes=args.bucket_bytes, compress=compress, family=family,
                      ffn=ffn if given else None, checkpointing=args.checkpointing, **shape)
            if args.activation is not None:  # the gpt family's MLP (estimate's activation=)
                kw["activation"] = args.activation
            try:
                out.append((estimate(**kw), kw))
            except ValueError as exc:  # a combination only the estimate knows to refuse
                parser.error("argument --zero: %s" % exc)
    return out


def _unit(results: Sequence[Breakdown]) -> tuple:
    """(name, bytes) of the unit a table or chart of ``results`` is shown in: GiB, or MiB / KiB
    for small models."""
    top = max(r.total for r in results)
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if top >= size:
            return name, float(size)
    return "B", 1.0


def format_table(results: Sequence[Breakdown]) -> str:
    """Markdown table: one row per component, one column per configuration, each cell
    'size (bytes/param)' in the unit of the header (GiB, or MiB/KiB for small models)."""
    unit, size = _unit(results)
    head = ["per device: %s (bytes/param)" % unit] + [r.label() for r in results]
    rows = []
    for field, name in ROWS:
        if field in OPTIONAL_ROWS and not any(getattr(r, field) for r in results):
            continue
        cells = [name]
        for r in results:
            v = getattr(r, field)
            if v is None:
                cells.append("—")
            elif 0 < v < 0.01 * size:  # e.g. the scaler's scalars: in bytes
                cells.append("%d B (%.2g)" % (v, v / r.params))
            else:
                cells.append("%.3g (%.3g)" % (v / size, v / r.params))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|:" + "-" * (widths[0] + 1) + "|" + "|".join("-" * (w + 1) + ":"
                                                          for w in widths[1:]) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def plot(results: Sequence[Breakdown], path: str, title: str = "") -> str:
    """A stacked bar chart (GiB, or MiB/KiB, per device) of each configuration's components."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = _unit(results)
    parts = [f for f in Breakdown.PERSISTENT + Breakdown.TRANSIENT]
    names = dict(ROWS)

    def shown(r, f):  # the step's buffers and the forward/backward peak do not overlap
        if f in Breakdown.PERSISTENT:
            return getattr(r, f)
        step_peak = r.step_buffers > (r.activations or 0) + r.autocast_copies
        return (r.step_buffers if step_peak else 0) if f == "step_buffers" else \
            (0 if step_peak else getattr(r, f) or 0)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results) + 2), 4.5))
    x = list(range(len(results)))
    bottom = [0.0] * len(results)
    for f in parts:
        ys = [shown(r, f) / size for r in results]
        if not any(ys):
            continue
        hatch = "//" if f in Breakdown.TRANSIENT else None
        ax.bar(x, ys, bottom=bottom, label=names[f], hatch=hatch)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(x)
    ax.set_xticklabels([r.label() for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("%s per device" % unit)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # to ``path`` as given, even without an extension
    plt.close(fig)
    return path


def _check_png(parser: argparse.ArgumentParser, path: str) -> None:
    """Rejects a ``--png`` that cannot be written before anything is printed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("argument --png: needs matplotlib (pip install matplotlib)")
    if Path(path).is_dir():
        parser.error("argument --png: %s is a folder" % path)
    if not Path(path).parent.is_dir():
        parser.error("argument --png: the folder %s does not exist" % Path(path).parent)


def _gib(v: float) -> str:
    return "%.3g GiB" % (v / 2 ** 30)


def _size_text(text_bytes: int) -> str:
    """A size as given: GB when it is a whole number of them (as GPUs are sold), else GiB."""
    if text_bytes % 10 ** 9 == 0 or text_bytes % 2 ** 30:
        return "%.4g GB (%s)" % (text_bytes / 1e9, _gib(text_bytes))
    return _gib(text_bytes)


def _verdict(b: Breakdown, budget: GpuBudget) -> str:
    need = budget.need(b)
    if budget.fits(b):
        return "fits: %s + %.3g%% = %s of %s usable, %s to spare" % (
            _gib(b.total), 100 * budget.slack, _gib(need), _gib(budget.usable),
            _gib(budget.usable - need))
    return "does NOT fit: %s + %.3g%% = %s of %s usable, %s short" % (
        _gib(b.total), 100 * budget.slack, _gib(need), _gib(budget.usable),
        _gib(need - budget.usable))


def verdict_lines(configs, budget: GpuBudget) -> List[str]:
    """The --gpu-memory report: the assumptions with their figures, then per column of
    ``configs`` ((Breakdown, estimate's keyword arguments) pairs) whether it fits ``budget``
    and, where it does not, what each change would need (``fit_changes``)."""
    lines = ["Does it fit on %s? Assumed: the CUDA context and kernels take %s before any tensor "
             "(--cuda-context), the caching allocator reserves %.3g%% beyond the estimate "
             "(--allocator-slack): %s usable for the estimate and its slack. Not counted: "
             "temporaries of the forward and backward (the gradients flowing between layers, "
             "the logits before the loss), communication buffers, other processes on the GPU."
             % (_size_text(budget.capacity), _gib(budget.context), 100 * budget.slack,
                _gib(budget.usable)), ""]
    for b, kw in configs:
        lines.append("- %s: %s." % (b.label(), _verdict(b, budget)))
        if budget.fits(b):
            continue
        changes = fit_changes(kw, budget)
        if not changes:
            lines.append("  nothing the calculator can change makes it fit.")
            continue
        lines.append("  what would change it (each estimated):")
        for what, c in changes:
            lines.append("  - %s: %s" % (what, _verdict(c, budget)))
        if not any(budget.fits(c) for _, c in changes):
            lines.append("  none of these fits; more devices (--zero with --world-size) or a "
                         "larger GPU would be needed.")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``python -m mpext.memory`` command; returns the exit status (argparse exits with 2 on
    bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = _configs(args, parser)
    results = [b for b, _ in configs]
    budget = None
    if args.gpu_memory is not None:
        try:
            budget = GpuBudget(args.gpu_memory, args.cuda_context, args.allocator_slack)
        except ValueError as exc:
            parser.error("argument --cuda-context: %s" % exc)
    elif args.cuda_context != CUDA_CONTEXT_BYTES or args.allocator_slack != ALLOCATOR_SLACK:
        parser.error("argument --cuda-context/--allocator-slack: only with --gpu-memory")
    if args.png:
        _check_png(parser, args.png)
    what = args.model or "%s params" % format(results[0].params, ",")
    optimizer = results[0].optimizer if args.rule is None else \
        "mpext.optim %s" % results[0].optimizer
    title = "%s, %s%s, world size %d" % (what, optimizer,
                                          ", gradient release" if args.grad_release else "",
                                          args.world_size)
    if args.json:
        data = {"model": args.model, "optimizer": results[0].optimizer,
                "rule": args.rule, "grad_release": args.grad_release,
                "results": [r.to_dict() for r in results]}
        if budget is not None:
            data["gpu"] = dict(capacity=budget.capacity, cuda_context=budget.context,
                               allocator_slack=budget.slack, usable=budget.usable,
                               columns=[dict(label=b.label(), need=budget.need(b),
                                             fits=budget.fits(b),
                                             changes=[dict(change=w, total=c.total,
                                                           need=budget.need(c),
                                                           fits=budget.fits(c))
                                                      for w, c in ([] if budget.fits(b) else
                                                                   fit_changes(kw, budget))])
                                        for b, kw in configs])
        print(json.dumps(data, indent=1))
    else:
        print("## Training memory per device: %s" % title)
        print()
        print(format_table(results))
        print()
        f = next((r.activation_formula for r in results if r.activation_formula), "")
        print("Activations: %s." % (f if f else "not estimated (give --batch with --model, or "
                                    "--batch --seq --hidden --layers --heads)"))
        print("Per-step rows exist only while a step runs; see docs/memory.md for each row.")
        if budget is not None:
            print()
            print("\n".join(verdict_lines(configs, budget)))
    if args.png:
        try:
            plot(results, args.png, title)
        except OSError as exc:
            parser.error("argument --png: cannot write %s: %s" % (args.png, exc.strerror or exc))
        print("wrote %s" % args.png, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
