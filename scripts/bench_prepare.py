#!/usr/bin/env python
"""Benchmark the prepare stage: pairs binning speed and workflow planning time.

Run by ``make bench``. Every figure printed is measured in this run:

(a) contacts/s of ``ampflow bin-pairs`` versus ``cooler cload pairs`` on the same
    ``.pairs.gz`` and resolution, both run as subprocesses and timed wall-clock
    (interpreter start-up and imports included, as a user would see them). The two
    coolers are checked to hold identical bins and pixels before any rate is
    reported. Headline: the ratio ours / cooler (goal >= 2) on a bulk-size file
    (default 20 M contacts), where throughput rather than start-up decides; the
    same ratio on the single real cell as it is (135 k contacts, dominated by the
    ~0.5 s both tools spend starting Python) is printed beside it.
(b) the same contacts/s versus plain decompression of the same file
    (``zcat FILE > /dev/null``), as a ratio.
(c) seconds of ``snakemake -n`` on a 10,000-cell sheet (goal < 30 s), in a
    scratch copy of ``workflow/`` and ``config/`` with a tiny demo dataset whose
    pairs files are symlinked 10,000 times.

Input for (a)/(b): the HiRES cell GSM6998595 (``shared/data/hires``, found at
``/work/shared/data`` or ``../shared/data`` next to the repository, or via
``--data-dir``) with one 4DN header and its body repeated until the file holds
about ``--contacts`` contacts. Without that file a synthetic cell from
:mod:`ampflow.demo` on full-size mm10 chromosomes is repeated instead.

Examples::

    python scripts/bench_prepare.py
    python scripts/bench_prepare.py --contacts 1000000 --repeats 5 --stat median
    python scripts/bench_prepare.py --skip-snakemake --keep
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIRES_CELL = "hires/GSM6998595_GasaE751001.pairs.gz"
MM10_SIZES = "annotation/mm10.chrom.sizes"
SYNTH_CONTACTS = 135_000  # size of the synthetic base cell, like the real one
BIN_GOAL = 2.0  # ours / cooler
DRYRUN_GOAL = 30.0  # seconds


# ------------------------------------------------------------------ helpers
def tool(name: str) -> str:
    """Path of a console script: next to this interpreter first, then on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        sys.exit(f"bench: '{name}' not found (run `make install` first)")
    return found


def run(cmd, *, cwd=None, stdout=subprocess.DEVNULL, what=None) -> float:
    """Run ``cmd``, fail loudly on a non-zero exit, return wall seconds."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace")[-3000:]
        sys.exit(f"bench: {what or cmd[0]} failed (exit {p.returncode}):\n  {' '.join(map(str, cmd))}\n{err}")
    return dt


def summarise(times: list[float], stat: str) -> float:
    return min(times) if stat == "best" else statistics.median(times)


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f} M/s"


def fmt_times(times: list[float]) -> str:
    return " ".join(f"{t:.2f}" for t in times)


def find_data_dir(explicit: str | None) -> Path | None:
    candidates = [Path(explicit)] if explicit else [Path("/work/shared/data"), REPO.parent / "shared" / "data"]
    for d in candidates:
        if (d / HIRES_CELL).is_file() and (d / MM10_SIZES).is_file():
            return d
    if explicit:
        sys.exit(f"bench: {explicit} lacks {HIRES_CELL} or {MM10_SIZES}")
    return None


# ------------------------------------------------------------------ input
def synthetic_cell(tmp: Path, seed: int) -> tuple[Path, Path]:
    """One synthetic HiRES-like cell on full-size mm10 chromosomes (ampflow.demo)."""
    import numpy as np

    from ampflow.demo import DemoGenome, simulate_cell, write_pairs
    from ampflow.io.genome import write_chromsizes

    rng = np.random.default_rng(seed)
    genome = DemoGenome(rng, scale=1.0, n_types=1)
    table = simulate_cell(rng, genome, 0, SYNTH_CONTACTS)
    pairs, sizes = tmp / "synthetic_cell.pairs.gz", tmp / "synthetic.chrom.sizes"
    write_pairs(pairs, table, genome.sizes)
    write_chromsizes(sizes, genome.sizes)
    return pairs, sizes


def split_pairs(path: Path) -> tuple[bytes, bytes, int]:
    """(header, body, contacts) of a pairs file; body ends with a newline."""
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    header, body = [], []
    for line in raw.splitlines(keepends=True):
        if line.startswith(b"#") and not body:
            header.append(line)
        elif line.strip():
            body.append(line)
    if body and not body[-1].endswith(b"\n"):
        body[-1] += b"\n"
    return b"".join(header), b"".join(body), len(body)


def build_input(base: Path, out: Path, target: int, level: int) -> tuple[int, int]:
    """Write one header + the base body repeated to reach ~target contacts."""
    header, body, n = split_pairs(base)
    if n == 0:
        sys.exit(f"bench: {base} has no contacts")
    reps = max(1, round(target / n))
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=level) as gz:
        gz.write(header)
        for _ in range(reps):
            gz.write(body)
    return reps, n * reps


# ------------------------------------------------------------------ (a) + (b)
def check_same_pixels(ours: Path, theirs: Path) -> tuple[int, int]:
    """Assert both coolers have the same bins and pixels; return (nnz, sum)."""
    import cooler
    import numpy as np

    a, b = cooler.Cooler(str(ours)), cooler.Cooler(str(theirs))
    if a.binsize != b.binsize or a.chromnames != b.chromnames:
        sys.exit(f"bench: coolers differ in resolution/chromosomes: {a.binsize} {a.chromnames} vs {b.binsize} {b.chromnames}")
    ba, bb = a.bins()[["chrom", "start", "end"]][:], b.bins()[["chrom", "start", "end"]][:]
    if len(ba) != len(bb) or not (ba["chrom"].astype(str).to_numpy() == bb["chrom"].astype(str).to_numpy()).all() or not (
        ba[["start", "end"]].to_numpy() == bb[["start", "end"]].to_numpy()
    ).all():
        sys.exit("bench: the two coolers have different bin tables")
    pa, pb = a.pixels()[:], b.pixels()[:]
    cols = ["bin1_id", "bin2_id", "count"]
    same = len(pa) == len(pb) and np.array_equal(pa[cols].to_numpy(np.int64), pb[cols].to_numpy(np.int64))
    if not same:
        sys.exit(
            f"bench: pixels differ: ours {len(pa)} pixels / {int(pa['count'].sum())} contacts, "
            f"cooler {len(pb)} pixels / {int(pb['count'].sum())} contacts"
        )
    return len(pa), int(pa["count"].sum())


def bench_binning(pairs: Path, sizes: Path, n_contacts: int, args, tmp: Path) -> dict:
    ours_cool, cooler_cool = tmp / "ours.cool", tmp / "cooler.cool"
    ours_cmd = [tool("ampflow"), "bin-pairs", str(pairs), "--chromsizes", str(sizes),
                "--resolution", str(args.resolution), "--out", str(ours_cool)]  # fmt: skip
    # positions are 1-based (4DN), cooler's default; '#' header lines are comments
    # and .gz is decompressed by pandas, inferred from the extension
    cooler_cmd = [tool("cooler"), "cload", "pairs", "-c1", "2", "-p1", "3", "-c2", "4", "-p2", "5",
                  f"{sizes}:{args.resolution}", str(pairs), str(cooler_cool)]  # fmt: skip
    zcat = shutil.which("zcat")
    zcat_cmd = [zcat, str(pairs)] if zcat else [tool("gzip"), "-dc", str(pairs)]

    print(f"  ours  : {' '.join(ours_cmd)}")
    print(f"  cooler: {' '.join(cooler_cmd)}")
    print(f"  zcat  : {' '.join(zcat_cmd)} > /dev/null")

    # warm-up (page cache, .pyc files); its outputs are the ones compared
    run(ours_cmd, what="ampflow bin-pairs")
    run(cooler_cmd, what="cooler cload pairs")
    run(zcat_cmd, what="zcat")
    nnz, total = check_same_pixels(ours_cool, cooler_cool)
    print(f"  check : identical bins and pixels ({nnz:,} pixels, {total:,} contacts binned of {n_contacts:,})")

    times = {"ours": [], "cooler": [], "zcat": []}
    for _ in range(args.repeats):  # interleaved so that drifts hit all three alike
        times["ours"].append(run(ours_cmd, what="ampflow bin-pairs"))
        times["cooler"].append(run(cooler_cmd, what="cooler cload pairs"))
        times["zcat"].append(run(zcat_cmd, what="zcat"))
    t = {k: summarise(v, args.stat) for k, v in times.items()}
    rate = {k: n_contacts / v for k, v in t.items()}
    for k, label in (("ours", "ampflow bin-pairs"), ("cooler", "cooler cload pairs"), ("zcat", "zcat > /dev/null")):
        print(f"  {label:<20} {t[k]:7.3f} s ({args.stat}; runs: {fmt_times(times[k])})  {fmt_rate(rate[k])}")
    out = {
        "t": t,
        "rate": rate,
        "vs_cooler": rate["ours"] / rate["cooler"],
        "vs_zcat": rate["ours"] / rate["zcat"],
    }
    print(f"  (a) ours / cooler = {out['vs_cooler']:.2f}x   (goal >= {BIN_GOAL:g}x)")
    print(f"  (b) ours / zcat   = {out['vs_zcat']:.2f}x   (ours takes {t['ours'] / t['zcat']:.1f}x the time of decompression alone)")
    return out


# ------------------------------------------------------------------ (c)
def bench_dryrun(args, tmp: Path) -> dict:
    import pandas as pd
    import yaml

    wd = tmp / "workflow_dir"
    wd.mkdir()
    shutil.copytree(REPO / "workflow", wd / "workflow", ignore=shutil.ignore_patterns(".snakemake", "__pycache__"))
    shutil.copytree(REPO / "config", wd / "config")
    run([tool("ampflow"), "demo-data", "resources/demo", "--cells", "8", "--seed", "0"], cwd=wd, what="ampflow demo-data")
    demo = pd.read_csv(wd / "resources/demo/cells.tsv", sep="\t", dtype=str, keep_default_na=False)

    links = wd / "resources/bench/pairs"
    links.mkdir(parents=True)
    ids, paths, types = [], [], []
    for i in range(args.cells):
        src = demo.iloc[i % len(demo)]
        cid = f"bench{i:06d}"
        link = links / f"{cid}.pairs.gz"
        link.symlink_to(Path("../../..") / src["pairs"])  # relative to resources/bench/pairs
        ids.append(cid)
        paths.append(f"resources/bench/pairs/{cid}.pairs.gz")
        types.append(src.get("cell_type", ""))
    if not all(Path(wd / p).is_file() for p in paths[: len(demo)]):
        sys.exit("bench: the symlinked pairs files do not resolve")
    sheet = wd / "resources/bench/cells.tsv"
    pd.DataFrame({"cell_id": ids, "pairs": paths, "cell_type": types}).to_csv(sheet, sep="\t", index=False)

    cfg = yaml.safe_load((wd / "config/demo.yaml").read_text())
    cfg["dataset"] = "bench"
    cfg["inputs"]["cells"] = "resources/bench/cells.tsv"
    (wd / "config/bench.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def dryrun(configfile):
        cmd = [tool("snakemake"), "-n", "--cores", "2", "--configfile", configfile]
        out = wd / "dryrun.log"
        with open(out, "wb") as fh:
            dt = run(cmd, cwd=wd, stdout=fh, what="snakemake -n")
        return dt, out.read_text(errors="replace")

    print(f"  dir   : {wd} ({args.cells:,} cells symlinked to {len(demo)} demo pairs files)")
    print("  cmd   : snakemake -n --cores 2 --configfile config/bench.yaml")
    dryrun("config/bench.yaml")  # warm-up: .snakemake/ set-up, .pyc files
    big, small = [], []
    log = ""
    for _ in range(args.repeats):
        dt, log = dryrun("config/bench.yaml")
        big.append(dt)
        small.append(dryrun("config/demo.yaml")[0])
    if "total" not in log or "bench" not in log:
        sys.exit(f"bench: unexpected snakemake -n output:\n{log[-2000:]}")
    jobs = next((ln.split()[-1] for ln in log.splitlines() if ln.startswith("total")), "?")
    t_big, t_small = summarise(big, args.stat), summarise(small, args.stat)
    print(f"  {args.cells:,} cells : {t_big:7.3f} s ({args.stat}; runs: {fmt_times(big)}), {jobs} jobs planned")
    print(f"  {len(demo):,} cells{' ' * (len(f'{args.cells:,}') - len(str(len(demo))))} : {t_small:7.3f} s ({args.stat}; runs: {fmt_times(small)})  baseline")
    print(f"  (c) snakemake -n on {args.cells:,} cells = {t_big:.2f} s   (goal < {DRYRUN_GOAL:g} s)")
    return {"t": t_big, "t_small": t_small, "jobs": jobs}


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contacts", type=int, default=20_000_000, help="approximate contacts in the bulk-size benchmark pairs file (default: 20,000,000)")
    p.add_argument("--resolution", type=int, default=500_000, help="bin size in bp (default: 500000)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per command, after one warm-up (default: 3)")
    p.add_argument("--stat", choices=["median", "best"], default="best", help="how repeats are summarised: best (least disturbed by other load, default) or median")
    p.add_argument("--cells", type=int, default=10_000, help="rows of the cell sheet for snakemake -n (default: 10000)")
    p.add_argument("--data-dir", default=None, help="shared data folder with hires/ and annotation/ (default: auto)")
    p.add_argument("--synthetic", action="store_true", help="use a synthetic cell even when the HiRES cell is available")
    p.add_argument("--gzip-level", type=int, default=6, help="gzip level of the benchmark pairs file (default: 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic cell (default: 0)")
    p.add_argument("--skip-binning", action="store_true", help="skip (a) and (b)")
    p.add_argument("--skip-snakemake", action="store_true", help="skip (c)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder and print its path")
    p.add_argument("--tmp-dir", default=None, help="where to create the temporary folder (default: system temp)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.contacts < 1 or a.cells < 1 or a.resolution < 1:
        p.error("--repeats, --contacts, --cells and --resolution must be positive")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ampflow-bench-", dir=args.tmp_dir))
    results: dict = {}
    try:
        print(f"ampflow prepare benchmark  (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.repeats} timed runs, {args.stat})")
        if not args.skip_binning:
            data = None if args.synthetic else find_data_dir(args.data_dir)
            t0 = time.perf_counter()
            if data is not None:
                base, sizes = data / HIRES_CELL, data / MM10_SIZES
                source = f"HiRES cell {base}"
            else:
                base, sizes = synthetic_cell(tmp, args.seed)
                why = "--synthetic" if args.synthetic else "shared data not found"
                source = f"synthetic cell (ampflow.demo, seed {args.seed}; {why})"
            pairs = tmp / "bench.pairs.gz"
            reps, n_contacts = build_input(base, pairs, args.contacts, args.gzip_level)
            mb = pairs.stat().st_size / 2**20
            print(f"\n[input] {source}")
            print(f"  body repeated {reps}x under one header: {n_contacts:,} contacts, {mb:.1f} MiB gzip "
                  f"(chromsizes {sizes}; built in {time.perf_counter() - t0:.1f} s)")  # fmt: skip
            print(f"\n[a,b] binning at {args.resolution:,} bp, bulk-size file")
            results["bin"] = bench_binning(pairs, sizes, n_contacts, args, tmp)
            results["bin"]["n"] = n_contacts
            n_cell = split_pairs(base)[2]
            print(f"\n[a'] binning at {args.resolution:,} bp, the single cell as it is ({n_cell:,} contacts)")
            results["cell"] = bench_binning(base, sizes, n_cell, args, tmp)
            results["cell"]["n"] = n_cell
        if not args.skip_snakemake:
            print("\n[c] workflow planning")
            results["dry"] = bench_dryrun(args, tmp)

        print("\nsummary" + (f" ({results['bin']['n']:,} contacts, {args.resolution:,} bp)" if "bin" in results else ""))
        rows = []
        if "bin" in results:
            b = results["bin"]
            rows.append(("(a) bin-pairs vs cooler cload pairs", f"{b['vs_cooler']:.2f}x",
                         f"{fmt_rate(b['rate']['ours'])} vs {fmt_rate(b['rate']['cooler'])}", f">= {BIN_GOAL:g}x",
                         b["vs_cooler"] >= BIN_GOAL))  # fmt: skip
            if "cell" in results:
                c = results["cell"]
                rows.append((f"(a') same, one cell ({c['n']:,} contacts)", f"{c['vs_cooler']:.2f}x",
                             f"{fmt_rate(c['rate']['ours'])} vs {fmt_rate(c['rate']['cooler'])}", "-", None))  # fmt: skip
            rows.append(("(b) bin-pairs vs zcat", f"{b['vs_zcat']:.2f}x",
                         f"{fmt_rate(b['rate']['ours'])} vs {fmt_rate(b['rate']['zcat'])}", "-", None))  # fmt: skip
        if "dry" in results:
            d = results["dry"]
            rows.append((f"(c) snakemake -n, {args.cells:,} cells", f"{d['t']:.2f} s", f"{d['jobs']} jobs",
                         f"< {DRYRUN_GOAL:g} s", d["t"] < DRYRUN_GOAL))  # fmt: skip
        head = ("figure", "value", "detail", "goal", "met")
        cells = [head] + [(r[0], r[1], r[2], r[3], "-" if r[4] is None else ("yes" if r[4] else "NO")) for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        for i, c in enumerate(cells):
            print("  " + "  ".join(s.ljust(w) for s, w in zip(c, widths)).rstrip())
            if i == 0:
                print("  " + "  ".join("-" * w for w in widths))
    finally:
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
