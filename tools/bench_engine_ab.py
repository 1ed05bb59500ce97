"""A/B of two builds of mpext._C on the Adam step, one storage mode at a time: the speed of a
change to the C core measured against the build before it, in the same run.

    python tools/bench_engine_ab.py --old DIR [--new DIR] [--rounds 7] [--numel N]
        [--threads 1] [--isa avx512] [--modes master,sr_bf16m,...]

DIR is a directory holding a built ``mpext._C*.so`` (the new one defaults to this checkout's
``mpext/``); each is run with DIR's own Python package when DIR is a checkout's ``mpext/``,
else with this checkout's. The two builds run in separate
processes, alternately (the order swapped every round), ``--rounds`` times each; a process
times every mode (warm-up, then the median of ``--samples`` steps of ``--numel`` elements) and
prints its times. Reported per mode: each build's median time and the ratio new/old, the
median over rounds of the per-round ratios with their min and max (the spread). A ratio below 1
is the new build faster.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> what it steps: param dtype, grad dtype, param storage, moments, extras
MODES = {
    "master": dict(p="bf16", g="bf16", kind="master"),
    "master_wb": dict(p="bf16", g="bf16", kind="master", wb=True),
    "master_g32": dict(p="bf16", g="fp32", kind="master"),
    "fp16_master": dict(p="fp16", g="fp16", kind="master"),
    "fp32": dict(p="fp32", g="fp32", kind="fp32"),
    "remainder": dict(p="bf16", g="bf16", kind="remainder"),
    "remainder_bf16m": dict(p="bf16", g="bf16", kind="remainder", mom="bf16"),
    "remainder_bf16m_ema": dict(p="bf16", g="bf16", kind="remainder", mom="bf16", ema=True),
    "sr_bf16m": dict(p="bf16", g="bf16", kind="sr", mom="bf16"),
    "sr": dict(p="bf16", g="bf16", kind="sr"),
    "rne": dict(p="bf16", g="bf16", kind="rne"),
    "q8_remainder": dict(p="bf16", g="bf16", kind="remainder", mom="q8"),
    "q8_sr": dict(p="bf16", g="bf16", kind="sr", mom="q8"),
}


def _worker(args):
    import torch
    import mpext  # noqa: F401  (registers torch.ops.mpext)

    torch.set_num_threads(args.threads)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    adam = torch.ops.mpext.adam_step_
    n = args.numel
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name in args.modes.split(","):
        c = MODES[name]
        p32 = torch.randn(n, generator=gen) * 0.02
        p = p32.to(dt[c["p"]])
        g = (torch.randn(n, generator=gen) * 1e-3).to(dt[c["g"]])
        mom = c.get("mom", "fp32")
        kw = dict(inv_scale=torch.full((1,), 0.5), found_inf=torch.zeros(()),
                  unscale_grads=c.get("wb", False))
        masters = []
        if c["kind"] == "master":
            masters = [p32.clone()]
        elif c["kind"] == "remainder":
            masters = [torch.empty(0)]
            kw["remainders"] = [torch.zeros(n, dtype=torch.int16)]
        elif c["kind"] in ("sr", "rne"):
            kw.update(master_free=True, stochastic_rounding=c["kind"] == "sr")
        if mom == "q8":
            m = torch.zeros(n, dtype=torch.int8)
            v = torch.zeros(n, dtype=torch.uint8)
            kw.update(exp_avg_scales=[torch.zeros(-(-n // 256))],
                      exp_avg_sq_scales=[torch.zeros(-(-n // 256))], block_size=256)
        else:
            m = torch.zeros(n, dtype=dt[mom])
            v = torch.zeros(n, dtype=dt[mom])
        if c.get("ema"):
            kw.update(ema_params=[p32.clone()], ema_decay=0.999)
        steps = [torch.zeros(1)]
        lr = torch.full((1,), 1e-3)
        inv = kw["inv_scale"]

        def step():
            inv.fill_(2.0 if float(inv) == 0.5 else 0.5)  # keeps the grads' scale
            adam([p], [g], [m], [v], masters, steps, lr, 0.9, 0.999, 1e-8, 1e-2, True, False,
                 **kw)

        for _ in range(2):
            step()
        ts = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
        del p, g, m, v, masters, kw
    print(json.dumps(out))


def _package_with(so_dir, tmp):
    """A copy of the mpext package with the .so found in so_dir: so_dir's own package when it
    is one (another checkout's mpext/, whose ops this checkout's Python may not match), else
    this checkout's."""
    sos = glob.glob(os.path.join(so_dir, "_C*.so"))
    if len(sos) != 1:
        sys.exit("bench_engine_ab: expected one _C*.so in %s, found %r" % (so_dir, sos))
    dst = os.path.join(tmp, "mpext")
    src = so_dir if os.path.exists(os.path.join(so_dir, "__init__.py")) else \
        os.path.join(ROOT, "mpext")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copy(sos[0], dst)
    return tmp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=False)
    ap.add_argument("--new", default=os.path.join(ROOT, "mpext"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--numel", type=int, default=16 << 20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default=None, help="MPEXT_CPU_ISA for both builds")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if not args.old:
        ap.error("--old is required")
    env = dict(os.environ)
    if args.isa:
        env["MPEXT_CPU_ISA"] = args.isa
    worker = [sys.executable, os.path.abspath(__file__), "--worker",
              "--samples", str(args.samples), "--numel", str(args.numel),
              "--threads", str(args.threads), "--modes", args.modes]
    times = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as t_old, tempfile.TemporaryDirectory() as t_new:
        roots = {"old": _package_with(args.old, t_old), "new": _package_with(args.new, t_new)}
        for r in range(args.rounds):
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                e = dict(env, PYTHONPATH=roots[which] + os.pathsep + ROOT)
                res = subprocess.run(worker, env=e, cwd=tempfile.gettempdir(),
                                     stdout=subprocess.PIPE, check=True, universal_newlines=True)
                times[which].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print("round %d/%d done" % (r + 1, args.rounds), file=sys.stderr)
    print("| mode | old ms | new ms | new/old (median of %d rounds) | min | max |" % args.rounds)
    print("|---|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        old = [t[mode] for t in times["old"]]
        new = [t[mode] for t in times["new"]]
        ratios = sorted(b / a for a, b in zip(old, new))
        print("| %s | %.2f | %.2f | %.3f | %.3f | %.3f |"
              % (mode, 1e3 * statistics.median(old), 1e3 * statistics.median(new),
                 statistics.median(ratios), ratios[0], ratios[-1]))


if __name__ == "__main__":
    main()
