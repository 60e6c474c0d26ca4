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

(d) with ``--cells N1,N2``, instead of (a)-(c): every prepare stage of the workflow
    at HiRES size. A dataset per size from ``ampflow demo-data`` on the real mm10
    genome (``--contacts`` per cell, real genes; reused from ``--data-dir`` when
    there), a workflow config for it (configs 1mb_s10, 500kb_s20, 100kb_s30), then
    ``snakemake <target files> --cores C`` stage by stage, in a scratch copy of this
    repository's ``workflow/`` and ``config/``. Stages are named by the files they make
    (``qc/contacts.tsv`` + ``binned/*.scool``, ``rna/counts.h5ad``, ``qc/cells.tsv``,
    ``qc/split.tsv``, ``binned/pseudobulk.mcool``, then per config ``hic.h5ad``,
    ``rna.h5ad``, ``graph``), not by rule names. Per stage: wall seconds, CPU seconds
    of the whole process tree (the kernel's count of waited-for children), peak RSS of
    the tree sampled every ``--sample-interval`` s (Snakemake's own process and its
    jobs apart; RSS sums count pages shared by forked workers once per process, an
    upper bound), the largest single process's kernel peak (VmHWM), and disk added
    under ``results/<dataset>/``. With two sizes: growth per cell of each figure, next
    to the aims (0.5 MB/cell of job memory; 30 min for all stages at 1,000 cells) and,
    for binning, next to a floor measured in the same run: ``zcat`` of every pairs file.

Input for (a)/(b): the HiRES cell GSM6998595 (``shared/data/hires``, found at
``/work/shared/data`` or ``../shared/data`` next to the repository, or via
``--data-dir``) with one 4DN header and its body repeated until the file holds
about ``--contacts`` contacts. Without that file a synthetic cell from
:mod:`ampflow.demo` on full-size mm10 chromosomes is repeated instead.

Examples::

    python scripts/bench_prepare.py
    python scripts/bench_prepare.py --contacts 1000000 --repeats 5 --stat median
    python scripts/bench_prepare.py --skip-snakemake --keep
    python scripts/bench_prepare.py --cells 100,300 --contacts 150000 --genome mm10 --json-out bench.json
    python scripts/bench_prepare.py --cells 20,40 --contacts 5000 --genes 2000    # a quick check
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIRES_CELL = "hires/GSM6998595_GasaE751001.pairs.gz"
MM10_SIZES = "annotation/mm10.chrom.sizes"
SYNTH_CONTACTS = 135_000  # size of the synthetic base cell, like the real one
BIN_GOAL = 2.0  # ours / cooler
DRYRUN_GOAL = 30.0  # seconds
RSS_AIM = 0.5  # MB of job memory per cell, any stage
WALL_AIM = 30 * 60.0  # seconds for all prepare stages at AIM_CELLS
AIM_CELLS = 1000
#: Configurations of the stage benchmark: (resolution, strata)
STAGE_CONFIGS = ((1_000_000, 10), (500_000, 20), (100_000, 30))
MB = 1e6


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
    if (
        len(ba) != len(bb)
        or not (ba["chrom"].astype(str).to_numpy() == bb["chrom"].astype(str).to_numpy()).all()
        or not (ba[["start", "end"]].to_numpy() == bb[["start", "end"]].to_numpy()).all()
    ):
        sys.exit("bench: the two coolers have different bin tables")
    pa, pb = a.pixels()[:], b.pixels()[:]
    cols = ["bin1_id", "bin2_id", "count"]
    same = len(pa) == len(pb) and np.array_equal(pa[cols].to_numpy(np.int64), pb[cols].to_numpy(np.int64))
    if not same:
        sys.exit(
            f"bench: pixels differ: ours {len(pa)} pixels / {int(pa['count'].sum())} contacts, cooler {len(pb)} pixels / {int(pb['count'].sum())} contacts"
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
    for i in range(args.dryrun_cells):
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

    print(f"  dir   : {wd} ({args.dryrun_cells:,} cells symlinked to {len(demo)} demo pairs files)")
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
    print(f"  {args.dryrun_cells:,} cells : {t_big:7.3f} s ({args.stat}; runs: {fmt_times(big)}), {jobs} jobs planned")
    print(
        f"  {len(demo):,} cells{' ' * (len(f'{args.dryrun_cells:,}') - len(str(len(demo))))} : "
        f"{t_small:7.3f} s ({args.stat}; runs: {fmt_times(small)})  baseline"
    )
    print(f"  (c) snakemake -n on {args.dryrun_cells:,} cells = {t_big:.2f} s   (goal < {DRYRUN_GOAL:g} s)")
    return {"t": t_big, "t_small": t_small, "jobs": jobs}


# ------------------------------------------------------------------ (d) stages
@dataclass
class Sample:
    """Peaks seen by :class:`TreeSampler` (bytes) and the root's own CPU seconds."""

    tree: int = 0  # RSS summed over the root and every descendant, at its highest
    root: int = 0  # the root process alone (Snakemake itself), at its highest
    jobs: int = 0  # the descendants alone (the jobs), at their highest
    hwm: int = 0  # the largest kernel peak (VmHWM) of any one process seen
    pss_jobs: int = 0  # the descendants' proportional set size summed (shared pages split), at its highest
    root_cpu: float = 0.0
    samples: int = 0


def _proc_kb(pid: int, file: str, key: str) -> int:
    """Bytes of one ``key: N kB`` line of ``/proc/PID/file``, 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/{file}") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _hwm(pid: int) -> int:
    """The kernel's peak RSS of one process (VmHWM)."""
    return _proc_kb(pid, "status", "VmHWM:")


def _pss(pid: int) -> int:
    """The process's proportional set size (pages shared with others split among them)."""
    return _proc_kb(pid, "smaps_rollup", "Pss:")


class TreeSampler(threading.Thread):
    """Every ``interval`` seconds, sum the RSS of process ``pid`` and all its descendants.

    Peaks shorter than the interval can be missed by the sum; the largest VmHWM seen
    (each process's own kernel peak, read at every sample) catches them for the largest
    single process.
    """

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        import psutil  # a dependency of Snakemake

        self.root = psutil.Process(pid)
        self.psutil = psutil
        self.interval = interval
        self.peak = Sample()
        self._halt = threading.Event()

    def sample(self) -> None:
        psutil, peak = self.psutil, self.peak
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        root = jobs = pss = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            if p.pid == self.root.pid:
                root = rss
                try:
                    t = p.cpu_times()
                    peak.root_cpu = t.user + t.system
                except psutil.Error:
                    pass
            else:
                jobs += rss
                pss += _pss(p.pid)
            peak.hwm = max(peak.hwm, _hwm(p.pid))
        peak.tree = max(peak.tree, root + jobs)
        peak.root = max(peak.root, root)
        peak.jobs = max(peak.jobs, jobs)
        peak.pss_jobs = max(peak.pss_jobs, pss)
        peak.samples += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> Sample:
        self._halt.set()
        self.join()
        return self.peak


def disk_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (allocated blocks, as ``du``), 0 if absent."""
    path = Path(path)
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass
class Measure:
    """One stage at one size."""

    wall: float
    cpu: float  # the whole tree: kernel rusage of waited-for children
    rss_tree: int
    rss_root: int
    rss_jobs: int
    hwm: int
    pss_jobs: int
    root_cpu: float
    disk: int  # bytes added under the watched folder
    samples: int
    log: str = ""


def measure(cmd, *, cwd, watch: Path, log: Path, interval: float = 0.1, env=None) -> Measure:
    """Run ``cmd`` to completion under a :class:`TreeSampler`; fail loudly with the log's
    tail on a non-zero exit."""
    before = disk_bytes(watch)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        sampler = TreeSampler(proc.pid, interval)
        sampler.start()
        rc = proc.wait()
    wall = time.perf_counter() - t0
    peak = sampler.stop()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if rc != 0:
        tail = Path(log).read_text(errors="replace")[-3000:]
        sys.exit(f"bench: failed (exit {rc}):\n  {' '.join(map(str, cmd))}\n  log {log}:\n{tail}")
    return Measure(wall, cpu, peak.tree, peak.root, peak.jobs, peak.hwm, peak.pss_jobs, peak.root_cpu, disk_bytes(watch) - before, peak.samples, str(log))


def stage_targets(ds: str) -> list[tuple[str, list[str]]]:
    """The prepare stages in order, each as (name, the target files that make it)."""
    from ampflow.io.genome import resolution_label

    r = f"results/{ds}"
    cfgs = [f"{resolution_label(res)}_s{k}" for res, k in STAGE_CONFIGS]
    labels = list(dict.fromkeys(resolution_label(res) for res, _ in STAGE_CONFIGS))
    stages = [
        ("binning", [f"{r}/qc/contacts.tsv"] + [f"{r}/binned/{lab}.scool" for lab in labels]),
        ("rna counts", [f"{r}/rna/counts.h5ad"]),
        ("qc cells", [f"{r}/qc/cells.tsv"]),
        ("split", [f"{r}/qc/split.tsv"]),
        ("pseudobulk", [f"{r}/binned/pseudobulk.mcool"]),
    ]
    stages += [(f"strata {c}", [f"{r}/data/{c}/hic.h5ad"]) for c in cfgs]
    stages += [(f"rna data {c}", [f"{r}/data/{c}/rna.h5ad"]) for c in cfgs]
    stages += [(f"graph {c}", [f"{r}/data/{c}/graph"]) for c in cfgs]
    return stages


def find_annotation(explicit: str | None) -> tuple[Path, Path]:
    """mm10 sizes and gene BED: ``--annotation-dir`` or the shared data folder."""
    from ampflow.demo import GENOMES

    names = GENOMES["mm10"]
    cands = [Path(explicit)] if explicit else [Path("/work/shared/data/annotation"), REPO.parent / "shared" / "data" / "annotation"]
    for d in cands:
        if all((d / n).is_file() for n in names):
            return d / names[0], d / names[1]
    sys.exit(f"bench: no {' and '.join(names)} in {' or '.join(map(str, cands))} (give --annotation-dir)")


def stage_env() -> dict:
    """This repository's package first on the path of Snakemake and of its jobs."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO / "src")
    return env


def make_dataset(n: int, folder: Path, args, env) -> float | None:
    """Write (or reuse) the dataset of ``n`` cells in ``folder``; seconds taken, None if reused."""
    if (folder / "cells.tsv").is_file():
        return None
    sizes, bed = find_annotation(args.annotation_dir)
    cmd = [tool("ampflow"), "demo-data", str(folder), "--cells", str(n), "--contacts", str(args.contacts),
           "--chromsizes", str(sizes), "--genes-bed", str(bed), "--genes", str(args.genes), "--biotype", args.biotype,
           "--workers", str(args.cores), "--seed", str(args.seed)]  # fmt: skip
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{p.stderr.decode(errors='replace')[-3000:]}")
    return time.perf_counter() - t0


def write_stage_config(wd: Path, ds: str, data: Path, cores: int) -> Path:
    """The demo's config/config.yaml with this dataset, the three configurations and no
    extraction; written over the scratch copy's config/config.yaml (so that nothing of
    the demo's is merged in) and returned."""
    import yaml

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["dataset"] = ds
    cfg["inputs"] = {k: str(data / f) for k, f in (("cells", "cells.tsv"), ("rna", "rna.tsv.gz"), ("genes", "genes.bed"), ("chromsizes", "chrom.sizes"))}
    cfg["configs"] = [{"resolution": res, "strata": k} for res, k in STAGE_CONFIGS]
    cfg["extract"] = {**cfg.get("extract", {}), "inputs": {}}
    cfg["threads"] = cores
    path = wd / "config" / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def zcat_floor(sheet: Path, cwd: Path) -> tuple[float, int]:
    """Seconds of decompressing every pairs file of the sheet to /dev/null (one ``zcat``
    over all of them), and their compressed bytes."""
    import pandas as pd

    files = [str((cwd / p) if not Path(p).is_absolute() else p) for p in pd.read_csv(sheet, sep="\t")["pairs"]]
    zcat = shutil.which("zcat") or tool("gzip")
    cmd = [zcat] + ([] if zcat.endswith("zcat") else ["-dc"])
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as null:
        for i in range(0, len(files), 500):  # argument-list sized batches
            subprocess.run(cmd + files[i : i + 500], stdout=null, check=True)
    return time.perf_counter() - t0, sum(os.path.getsize(f) for f in files)


def subfolder_disk(folder: Path) -> dict[str, int]:
    """Bytes on disk of every entry (hidden ones included) of ``folder``."""
    return {p.name: disk_bytes(p) for p in sorted(Path(folder).iterdir())} if Path(folder).is_dir() else {}


def bench_stages(args, tmp: Path) -> dict:
    env = stage_env()
    wd = Path(args.workdir) if args.workdir else tmp / "workflow_dir"
    wd.mkdir(parents=True, exist_ok=True)
    for part in ("workflow", "config", "envs"):  # envs: rules name their conda files
        if not (REPO / part).exists():
            continue
        if (wd / part).exists():
            shutil.rmtree(wd / part)
        shutil.copytree(REPO / part, wd / part, ignore=shutil.ignore_patterns(".snakemake", "__pycache__"))
    (wd / "bench_logs").mkdir(exist_ok=True)
    data_root = Path(args.data_dir) if args.data_dir else wd / "resources"
    snake = tool("snakemake")
    print(f"  workdir : {wd}  (copy of {REPO / 'workflow'}, PYTHONPATH={REPO / 'src'})")
    print(f"  data    : {data_root}/bench_<N>  ({args.contacts:,} contacts/cell median, mm10 chr1-19+X, {args.genes:,} genes of biotype {args.biotype})")
    print(f"  run     : snakemake <targets> --configfile config/config.yaml --cores {args.cores}; RSS sampled every {args.sample_interval} s")
    out: dict = {"cells": args.cells, "contacts": args.contacts, "cores": args.cores, "sizes": {}}
    for n in args.cells:
        ds = f"bench_{n}"
        data = data_root / ds
        gen = make_dataset(n, data, args, env)
        results = wd / "results" / ds
        if results.exists():  # a kept workdir: measure from scratch
            shutil.rmtree(results)
        shutil.rmtree(wd / "logs" / ds, ignore_errors=True)
        cfg = write_stage_config(wd, ds, data.resolve(), args.cores)
        zcat_s, pairs_bytes = zcat_floor(data / "cells.tsv", wd)
        gen_txt = "reused" if gen is None else f"written in {gen:.1f} s"
        load0 = os.getloadavg()[0]
        print(f"\n[d] {n:,} cells: {data} ({gen_txt}; pairs {pairs_bytes / MB:,.0f} MB gzip); floor zcat of all pairs files {zcat_s:.2f} s;"
              f" load average {load0:.1f}")  # fmt: skip
        rows = {}
        for name, targets in stage_targets(ds):
            cmd = [snake, *targets, "--configfile", str(cfg), "--cores", str(args.cores)]
            log = wd / "bench_logs" / f"{ds}.{name.replace(' ', '_')}.log"
            m = measure(cmd, cwd=wd, watch=results, log=log, interval=args.sample_interval, env=env)
            rows[name] = m
            print(f"  {name:<20} wall {m.wall:7.1f} s  cpu {m.cpu:7.1f} s  peak RSS jobs {m.rss_jobs / MB:8.1f} MB (PSS {m.pss_jobs / MB:8.1f})"
                  f" snakemake {m.rss_root / MB:6.1f} MB, tree {m.rss_tree / MB:8.1f} MB, largest process {m.hwm / MB:8.1f} MB"
                  f"  disk +{m.disk / MB:8.1f} MB")  # fmt: skip
        # Snakemake alone on this dataset: every target exists, nothing to do
        every = [t for _, ts in stage_targets(ds) for t in ts]
        base = measure([snake, *every, "--configfile", str(cfg), "--cores", str(args.cores)], cwd=wd, watch=results,
                       log=wd / "bench_logs" / f"{ds}.nothing_to_do.log", interval=args.sample_interval, env=env)  # fmt: skip
        print(f"  {'(nothing to do)':<20} wall {base.wall:7.1f} s  cpu {base.cpu:7.1f} s  snakemake alone {base.rss_root / MB:6.1f} MB")
        binned = subfolder_disk(results / "binned")
        print(f"  results/{ds}/binned/: " + ", ".join(f"{k} {v / MB:.1f} MB ({v / n / 1e3:.1f} kB/cell)" for k, v in binned.items()))
        out["sizes"][n] = {
            "stages": {k: asdict(v) for k, v in rows.items()},
            "nothing_to_do": asdict(base),
            "zcat_s": zcat_s,
            "pairs_bytes": pairs_bytes,
            "generate_s": gen,
            "binned_disk": binned,
            "results_disk": disk_bytes(results),
            "load_average": [load0, os.getloadavg()[0]],
        }
        print(f"  load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (walls stretch with other users' load; CPU seconds do not)")
    summarise_stages(out, args)
    return out


def summarise_stages(out: dict, args) -> None:
    sizes = sorted(out["sizes"])
    big = sizes[-1]
    small = sizes[0] if len(sizes) > 1 else None
    stages = list(out["sizes"][big]["stages"])
    print(f"\nsummary: prepare stages, {args.contacts:,} contacts/cell, {args.cores} cores"
          + (f"; growth per cell between {small:,} and {big:,} cells" if small else ""))  # fmt: skip
    head = ["stage"]
    for n in sizes:
        head += [f"wall@{n}", f"cpu@{n}", f"RSS jobs@{n}", f"PSS@{n}"]
    if small:
        head += ["RSS MB/cell", f"vs aim {RSS_AIM:g}", "PSS MB/cell", "s/cell"]
    head += [f"disk@{big}"]
    table = [head]
    growth = {}
    for name in stages + ["TOTAL"]:
        row = [name]
        for n in sizes:
            st = out["sizes"][n]["stages"]
            if name == "TOTAL":
                row += [f"{sum(m['wall'] for m in st.values()):.1f}", f"{sum(m['cpu'] for m in st.values()):.1f}",
                        f"{max(m['rss_jobs'] for m in st.values()) / MB:.0f} (max)", f"{max(m['pss_jobs'] for m in st.values()) / MB:.0f} (max)"]  # fmt: skip
            else:
                m = st[name]
                row += [f"{m['wall']:.1f}", f"{m['cpu']:.1f}", f"{m['rss_jobs'] / MB:.0f}", f"{m['pss_jobs'] / MB:.0f}"]
        if small:
            a, b = out["sizes"][small]["stages"], out["sizes"][big]["stages"]
            if name == "TOTAL":
                wa, wb = sum(m["wall"] for m in a.values()), sum(m["wall"] for m in b.values())
                ra, rb = max(m["rss_jobs"] for m in a.values()), max(m["rss_jobs"] for m in b.values())
                pa, pb = max(m["pss_jobs"] for m in a.values()), max(m["pss_jobs"] for m in b.values())
            else:
                wa, wb, ra, rb = a[name]["wall"], b[name]["wall"], a[name]["rss_jobs"], b[name]["rss_jobs"]
                pa, pb = a[name]["pss_jobs"], b[name]["pss_jobs"]
            per_cell = (rb - ra) / MB / (big - small)
            pss_cell = (pb - pa) / MB / (big - small)
            s_cell = (wb - wa) / (big - small)
            growth[name] = {"rss_mb_per_cell": per_cell, "pss_mb_per_cell": pss_cell, "wall_s_per_cell": s_cell, "wall_small": wa, "wall_big": wb}
            row += [f"{per_cell:.3f}", f"{per_cell / RSS_AIM:.2f}x", f"{pss_cell:.3f}", f"{s_cell:.3f}"]
        row.append("-" if name == "TOTAL" else f"{out['sizes'][big]['stages'][name]['disk'] / MB:.0f} MB")
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        print("  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print("  (RSS jobs: peak over the stage of the summed RSS of Snakemake's descendants; PSS: the same with pages"
          " shared between processes split among them; MB = 1e6 bytes)")  # fmt: skip
    for n in sizes:
        s = out["sizes"][n]
        b = s["stages"]["binning"]
        base = s["nothing_to_do"]
        print(f"  {n:,} cells: binning {b['wall']:.1f} s vs floor zcat of all pairs {s['zcat_s']:.2f} s -> {b['wall'] / s['zcat_s']:.1f}x the floor;"
              f" snakemake alone (nothing to do) {base['wall']:.1f} s, {base['rss_root'] / MB:.0f} MB")  # fmt: skip
        print("    binned/ per cell: " + ", ".join(f"{k} {v / n / 1e3:.1f} kB" for k, v in s["binned_disk"].items())
              + f"; results/ in all {s['results_disk'] / n / 1e3:.1f} kB/cell")  # fmt: skip
    if small:
        g = growth["TOTAL"]
        at_aim = g["wall_small"] + (AIM_CELLS - small) * g["wall_s_per_cell"]
        worst = max((v["rss_mb_per_cell"], k) for k, v in growth.items() if k != "TOTAL")
        print(
            f"  total wall at {AIM_CELLS:,} cells (linear from the two sizes): {at_aim / 60:.1f} min vs aim {WALL_AIM / 60:.0f} min -> {at_aim / WALL_AIM:.2f}x"
        )
        ca = sum(m["cpu"] for m in out["sizes"][small]["stages"].values())
        cb = sum(m["cpu"] for m in out["sizes"][big]["stages"].values())
        cpu_aim = ca + (AIM_CELLS - small) * (cb - ca) / (big - small)
        print(f"  total CPU at {AIM_CELLS:,} cells (linear): {cpu_aim / 60:.1f} min; over {args.cores} cores at best {cpu_aim / args.cores / 60:.1f} min"
              f" vs aim {WALL_AIM / 60:.0f} min -> {cpu_aim / args.cores / WALL_AIM:.2f}x")  # fmt: skip
        out["total_cpu_at_aim_cells_s"] = cpu_aim
        print(f"  largest growth of job memory: {worst[1]} {worst[0]:.3f} MB/cell vs aim {RSS_AIM:g} MB/cell -> {worst[0] / RSS_AIM:.2f}x")
        out["growth"] = growth
        out["total_wall_at_aim_cells_s"] = at_aim


# ------------------------------------------------------------------ main
def cell_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cell counts like 300,1000, got {text!r}") from None
    if not counts or counts[0] < 8:
        raise argparse.ArgumentTypeError("each cell count must be >= 8 (the demo's smallest dataset)")
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cells",
        type=cell_counts,
        default=None,
        help="stage benchmark (d) at these dataset sizes, e.g. 300,1000 (two or more: growth per cell); without it (a)-(c)",
    )
    p.add_argument(
        "--contacts",
        type=int,
        default=None,
        help="(a) contacts in the bulk-size pairs file (default: 20,000,000); (d) median contacts per cell (default: 150,000)",
    )
    p.add_argument("--resolution", type=int, default=500_000, help="bin size in bp (default: 500000)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per command, after one warm-up (default: 3)")
    p.add_argument(
        "--stat", choices=["median", "best"], default="best", help="how repeats are summarised: best (least disturbed by other load, default) or median"
    )
    p.add_argument("--dryrun-cells", type=int, default=10_000, help="(c) rows of the cell sheet for snakemake -n (default: 10000)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="(a) shared data folder with hires/ and annotation/ (default: auto); "
        "(d) folder of the datasets bench_<N>/, reused when present, else written there (default: inside the workdir)",
    )
    p.add_argument("--synthetic", action="store_true", help="use a synthetic cell even when the HiRES cell is available")
    p.add_argument("--gzip-level", type=int, default=6, help="gzip level of the benchmark pairs file (default: 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic cell / dataset (default: 0)")
    p.add_argument("--skip-binning", action="store_true", help="skip (a) and (b)")
    p.add_argument("--skip-snakemake", action="store_true", help="skip (c)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder and print its path")
    p.add_argument("--tmp-dir", default=None, help="where to create the temporary folder (default: system temp)")
    g = p.add_argument_group("(d) stage benchmark")
    g.add_argument("--genome", default="mm10", choices=["mm10"], help="genome of the datasets (default: mm10: chr1-19 and X at full size, real genes)")
    g.add_argument("--annotation-dir", default=None, help="folder with mm10.chrom.sizes and mm10_ensembl96_genes.bed.gz (default: the shared data folder)")
    g.add_argument("--genes", type=int, default=25_000, help="genes of the RNA matrix (default: 25000)")
    g.add_argument("--biotype", default="all", help="biotype of those genes, or all (default: all)")
    g.add_argument("--cores", type=int, default=2, help="snakemake --cores, and processes writing the dataset (default: 2)")
    g.add_argument("--workdir", default=None, help="where the copy of the workflow runs (default: inside the temporary folder)")
    g.add_argument("--sample-interval", type=float, default=0.1, help="seconds between RSS samples (default: 0.1)")
    g.add_argument("--json-out", default=None, help="write every figure of (d) to this JSON file")
    a = p.parse_args(argv)
    if a.contacts is None:
        a.contacts = 150_000 if a.cells else 20_000_000
    if a.repeats < 1 or a.contacts < 1 or a.dryrun_cells < 1 or a.resolution < 1 or a.cores < 1:
        p.error("--repeats, --contacts, --dryrun-cells, --resolution and --cores must be positive")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ampflow-bench-", dir=args.tmp_dir))
    results: dict = {}
    try:
        if args.cells:
            print(
                f"ampflow prepare stages benchmark  (python {sys.version.split()[0]}, {len(os.sched_getaffinity(0))} usable CPUs, "
                f"load average {os.getloadavg()[0]:.1f})"
            )
            results = bench_stages(args, tmp)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))
                print(f"\nwrote {args.json_out}")
            return 0
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
            rows.append((f"(c) snakemake -n, {args.dryrun_cells:,} cells", f"{d['t']:.2f} s", f"{d['jobs']} jobs",
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
