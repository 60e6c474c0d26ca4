"""``ampflow <command>``: argument parsing only; each command calls library functions.

Bad input (:class:`~ampflow.io.errors.InputError`) is printed as one line without a
traceback and exits with status 2; programming errors keep their tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .io.errors import InputError

log = logging.getLogger("ampflow")


def _setup_logging(logfile: str | None, verbose: bool) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if logfile:
        Path(logfile).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(logfile, mode="a"))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def _add_naming(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chromosome names and columns")
    g.add_argument("--strip-prefix", default="", help="prefix removed from input chromosome names, e.g. mm10_")
    g.add_argument(
        "--chr-prefix",
        default="auto",
        choices=["auto", "keep", "add", "drop"],
        help="add or drop 'chr' after stripping (auto: whichever the genome knows)",
    )
    g.add_argument("--pairs-columns", default=None, help="1-based 'chrom1,pos1,chrom2,pos2' (default: header or inferred)")
    g.add_argument("--chromosomes", default=None, help="comma-separated chromosomes to keep (default: all in --chromsizes)")


def _chroms(arg):
    return [c for c in arg.split(",") if c] if arg else None


# ---------------------------------------------------------------- commands
def cmd_demo_data(a):
    from .demo import write_demo

    paths = write_demo(a.outdir, n_cells=a.cells, seed=a.seed, scale=a.scale, n_genes=a.genes)
    log.info("demo data: %s", {k: str(v) for k, v in paths.items()})


def cmd_bin_pairs(a):
    from .io.atomic import atomic_path
    from .io.genome import ChromNamer, read_chromsizes
    from .io.pairs import read_pairs
    from .prepare.binning import bin_contacts, write_cool

    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    namer = ChromNamer(tuple(sizes), a.strip_prefix, a.chr_prefix)
    contacts = read_pairs(a.pairs, namer, sizes, columns=a.pairs_columns)
    pixels = bin_contacts(contacts, sizes, a.resolution)
    with atomic_path(a.out) as tmp:
        write_cool(tmp, sizes, a.resolution, pixels, metadata={"source": str(a.pairs), **contacts.stats})
    log.info("%s: %s -> %s (%d pixels)", a.pairs, contacts.stats, a.out, len(pixels))


def cmd_bin_cells(a):
    from .io.atomic import atomic_path
    from .io.genome import read_chromsizes
    from .io.sheet import read_sheet
    from .prepare.cells import ParseOptions, bin_cells, write_scool

    sheet = read_sheet(a.sheet)
    sizes = read_chromsizes(a.chromsizes)
    keep = _chroms(a.chromosomes)
    if keep:
        read_chromsizes(a.chromsizes, keep)  # validates the names
    if len(a.resolutions) != len(a.out_scool):
        raise InputError("give one --out-scool per --resolutions entry", key="out_scool", value=a.out_scool)
    opts = ParseOptions(
        chromsizes=tuple(sizes.items()),
        keep=tuple(keep) if keep else None,
        strip_prefix=a.strip_prefix,
        chr_prefix=a.chr_prefix,
        columns=a.pairs_columns,
        resolutions=tuple(sorted(set(a.resolutions))),
    )
    stats = bin_cells(sheet, opts, a.cache_dir, threads=a.threads)
    for res, out in zip(a.resolutions, a.out_scool):
        write_scool(out, list(sheet["cell_id"]), a.cache_dir, opts, res)
        log.info("wrote %s (%d cells at %d bp)", out, len(sheet), res)
    with atomic_path(a.stats) as tmp:
        stats.to_csv(tmp, sep="\t")


def cmd_load_rna(a):
    from .io.atomic import atomic_path
    from .io.rna import read_rna, round_counts
    from .prepare.qc import rna_stats

    adata = read_rna(a.rna)
    adata.X, report = round_counts(adata.X, a.rounding)
    log.info(
        "%s: %d genes x %d cells; rounded %d fractional of %d nonzero counts (%s): total %.1f -> %.0f",
        a.rna,
        adata.n_vars,
        adata.n_obs,
        report["fractional_entries"],
        report["nonzero_entries"],
        report["mode"],
        report["total_before"],
        report["total_after"],
    )
    adata.uns["ampflow"] = {"rounding": report, "source": str(a.rna)}
    with atomic_path(a.out) as tmp:
        adata.write_h5ad(tmp, compression="gzip")
    with atomic_path(a.stats) as tmp:
        rna_stats(adata).to_csv(tmp, sep="\t")


def cmd_qc_cells(a):
    import pandas as pd

    from .io.atomic import atomic_path
    from .io.sheet import read_sheet
    from .prepare.qc import QCThresholds, qc_table

    sheet = read_sheet(a.sheet, check_files=False)
    contacts = pd.read_csv(a.contacts, sep="\t", index_col="cell_id", dtype={"cell_id": str})
    rna = pd.read_csv(a.rna_stats, sep="\t", index_col="cell_id", dtype={"cell_id": str})
    th = QCThresholds(a.min_contacts, a.min_cis_fraction, a.min_umis, a.min_genes)
    table = qc_table(contacts, rna, th, rna_path=a.rna_stats)
    meta = sheet.drop(columns=["cell_id", "pairs"])
    table = table.join(meta, how="left")
    with atomic_path(a.out) as tmp:
        table.to_csv(tmp, sep="\t")


def cmd_pseudobulk(a):
    from .prepare.pseudobulk import write_mcool
    from .prepare.qc import passing_cells, read_qc

    cells = passing_cells(read_qc(a.qc))
    if not cells:
        raise InputError("no cell passes QC; nothing to pool", path=a.qc)
    scools = {}
    for spec in a.scool:
        res, _, path = spec.partition("=")
        scools[int(res)] = path
    report = write_mcool(a.out, scools, cells, balance=not a.no_balance, extra=a.extra_resolutions)
    log.info("pseudobulk of %d cells: %s", len(cells), json.dumps(report))


def _qc_obs(qc_path, cells):
    from .prepare.qc import read_qc

    qc = read_qc(qc_path)
    drop = ["pass", "reason", "in_pairs", "in_rna", "matched"]
    return qc.loc[cells].drop(columns=[c for c in drop if c in qc.columns])


def cmd_strata(a):
    from .io.atomic import atomic_path
    from .io.genome import read_chromsizes
    from .prepare.qc import passing_cells, read_qc
    from .prepare.strata import build_strata

    cells = [c for c in passing_cells(read_qc(a.qc))]
    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    adata = build_strata(a.scool, cells, list(sizes), a.strata, a.min_cells, a.min_count, obs=_qc_obs(a.qc, cells))
    with atomic_path(a.out) as tmp:
        adata.write_h5ad(tmp, compression="gzip")


def cmd_rna_data(a):
    import anndata as ad

    from .io.annotation import read_genes
    from .io.atomic import atomic_path
    from .io.genome import ChromNamer, read_chromsizes
    from .prepare.qc import passing_cells, read_qc
    from .prepare.rna import build_rna

    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    genes = read_genes(a.genes, ChromNamer(tuple(sizes), a.strip_prefix, a.chr_prefix), sizes)
    if genes.attrs.get("dropped"):
        log.info("%s: %d genes off the analysed chromosomes dropped", a.genes, genes.attrs["dropped"])
    cells = passing_cells(read_qc(a.qc))
    counts = ad.read_h5ad(a.counts)
    adata = build_rna(counts, cells, genes, a.n_top_genes, obs=_qc_obs(a.qc, cells))
    with atomic_path(a.out) as tmp:
        adata.write_h5ad(tmp, compression="gzip")


def cmd_graph(a):
    import anndata as ad

    from .io.genome import read_chromsizes
    from .prepare.graph import build_graph, write_graph

    sizes = read_chromsizes(a.chromsizes, _chroms(a.chromosomes))
    rna = ad.read_h5ad(a.rna, backed="r")
    hic = ad.read_h5ad(a.hic, backed="r")
    res = int(hic.uns["ampflow"]["resolution"])
    nodes, edges = build_graph(rna.var, hic.var, a.mcool, res, sizes, a.promoter_upstream, a.contact_quantile)
    meta = {
        "resolution": res,
        "n_nodes": int(len(nodes)),
        "n_genes": int((nodes["kind"] == "gene").sum()),
        "n_anchors": int((nodes["kind"] == "anchor").sum()),
        "n_edges": int(len(edges)),
        "edges_by_kind": {str(k): int(v) for k, v in edges["kind"].value_counts().sort_index().items()},
        "promoter_upstream": a.promoter_upstream,
        "contact_quantile": a.contact_quantile,
    }
    write_graph(a.out, nodes, edges, meta)


def apply_plan(model_cfg, plan: dict):
    """The model settings the plan prescribes (S3 chunk size, S4); the sharding (S1, S2,
    S5) is applied to the built model by :func:`ampflow.parallel.parallelize.parallelize`."""
    import dataclasses

    names = [s["name"] for s in plan.get("strategies", [])]
    chunk = int(plan.get("chunk_size") or 0)
    cfg = dataclasses.replace(model_cfg, chunk=chunk, key_first=bool(plan.get("key_first")))
    mesh = plan.get("mesh") or {}
    log.info(
        "plan: %s; mesh dp %s x tp %s; chunk %s, key-first %s",
        ", ".join(names) or "no strategy", mesh.get("dp", 1), mesh.get("tp", 1), chunk or "-", cfg.key_first,
    )  # fmt: skip
    return cfg


def plan_processes(plan: dict | None) -> int:
    """How many processes train a plan: its mesh's dp x tp."""
    mesh = (plan or {}).get("mesh") or {}
    return int(mesh.get("dp", 1)) * int(mesh.get("tp", 1))


RDZV_PORT = 29500


def torchrun_command(n: int, argv: list[str], env=os.environ) -> list[str]:
    """The torchrun command that runs ``ampflow <argv>`` in a world of ``n`` processes.

    One node: ``--standalone``. Inside a SLURM job step that srun started with one task
    on each of several nodes (the train rule under ``mpi: srun``, ``nodes = tasks = N``):
    this task's node runs ``n / N`` processes and the nodes meet through a c10d
    rendezvous on the allocation's first node, keyed by the job id.
    """
    head = [sys.executable, "-m", "torch.distributed.run"]
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or 1)
    if nodes <= 1:
        return [*head, "--standalone", f"--nproc-per-node={n}", "-m", "ampflow.cli", *argv]
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 0)
    if tasks != nodes:
        raise InputError(f"multi-node training needs one task per node (srun with tasks = nodes = {nodes})", key="SLURM_STEP_NUM_TASKS", value=tasks)
    if n % nodes:
        raise InputError(f"the plan's {n} processes do not divide over {nodes} nodes", key="mesh", value=n)
    import subprocess

    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True)
    first = hosts.stdout.split()[0]
    port = int(env.get("AMPFLOW_RDZV_PORT") or RDZV_PORT)
    return [*head, f"--nnodes={nodes}", f"--nproc-per-node={n // nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={first}:{port}", f"--rdzv-id={env.get('SLURM_JOB_ID', 'ampflow')}",
            "-m", "ampflow.cli", *argv]  # fmt: skip


def _launch(a, n: int) -> int:
    """Run this very command under ``torchrun`` with ``n`` processes (see
    :func:`torchrun_command`); its exit status."""
    import subprocess

    cmd = torchrun_command(n, [x for x in a.argv if x != "--launch"])
    log.info("launching %d processes: %s", n, " ".join(cmd))
    res = subprocess.run(cmd)
    if res.returncode != 0:
        log.error("torchrun exited with status %d (a rank failed or was killed); running the same command again resumes from the last checkpoint", res.returncode)
    return res.returncode


def cmd_train(a):
    from .model.config import ModelConfig
    from .train.config import TrainConfig
    from .train.data import load_paired
    from .train.trainer import Trainer

    from .parallel.mesh import init_distributed, launched_world

    model_cfg = ModelConfig.from_dict(json.loads(a.model) if a.model else {})
    train_cfg = TrainConfig.from_dict(json.loads(a.train) if a.train else {})
    plan = _read_json(a.plan, "plan") if a.plan else None
    if a.launch and launched_world() == 1 and (n := plan_processes(plan)) > 1:
        return _launch(a, n)
    if plan is not None:
        model_cfg = apply_plan(model_cfg, plan)
    world = init_distributed(train_cfg.device)
    try:
        if world > 1:
            import torch.distributed as dist

            if dist.get_rank() > 0:  # rank 0 speaks for the group
                logging.getLogger().setLevel(logging.WARNING)
        data = load_paired(a.data)
        log.info("training %s: %d cells, %d genes, %d Hi-C features in %d strata", a.name or a.out, data.n_cells, data.rna.shape[1], data.hic.shape[1], data.n_strata)
        Trainer(data, model_cfg, train_cfg, a.out, name=a.name, stop_after=a.stop_after, plan=plan).fit()
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def cmd_evaluate(a):
    from .train.evaluate import main_evaluate

    scores = main_evaluate(a.embeddings, a.out_dir, label_key=a.label_key, seed=a.seed)
    log.info("scores: %s", json.dumps(scores, sort_keys=True))


def _settings(json_text, path, section):
    """A config section from --SECTION JSON or from a YAML/JSON file's SECTION key (or the whole file)."""
    import yaml

    if json_text:
        return json.loads(json_text)
    if path:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        return doc.get(section, doc if section == "model" else {})
    return {}


def cmd_profile(a):
    from .amp.profile import main_profile

    model = _settings(a.model, a.model_config, "model")
    train = _settings(a.train, a.model_config, "train")
    main_profile(a.data_dir, model, train, a.out)
    log.info("profile of %s written to %s", a.data_dir, a.out)


def _device_memory(arg: str, devices_file: str | None = None) -> int:
    """Bytes per device: a number of GB, or 'auto' = the least free memory among the
    GPUs in ``devices_file`` (written by `ampflow devices` on a GPU node) or seen here."""
    if arg != "auto":
        try:
            gb = float(arg)
        except ValueError:
            raise InputError("must be a number of GB or 'auto'", key="device_memory", value=arg) from None
        return int(gb * 2**30)
    from .devices import probe_devices

    info = json.loads(Path(devices_file).read_text()) if devices_file else probe_devices()
    free = [d["memory_free"] for d in info["devices"] if "memory_free" in d]
    if not free:
        raise InputError("'auto' needs visible NVIDIA GPUs (NVML); give the memory per device in GB", key="device_memory", value=info.get("nvml"))
    return min(free)


def _read_json(path, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} does not exist", path=path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON: {e.msg}", path=path, line=e.lineno) from None


def cmd_diagnose(a):
    from .amp.diagnose import diagnose, dumps
    from .io.atomic import write_text_atomic

    profile = _read_json(a.profile, "profile")
    settings = {"dimensionality_ratio": a.dimensionality_ratio}
    plan = diagnose(profile, a.devices, _device_memory(a.device_memory, a.devices_file), a.budget_fraction, settings=settings)
    write_text_atomic(a.out, dumps(plan))
    names = ", ".join(f"{s['id']} {s['name']}" for s in plan["strategies"]) or "none"
    log.info("plan: %s; mesh dp %d x tp %d; fits=%s -> %s", names, plan["mesh"]["dp"], plan["mesh"]["tp"], plan["fits"], a.out)


def cmd_plan_explain(a):
    from .amp.diagnose import explain

    sys.stdout.write(explain(_read_json(a.plan, "plan")))


def cmd_devices(a):
    from .io.atomic import write_text_atomic
    from .devices import probe_devices

    info = probe_devices()
    write_text_atomic(a.out, json.dumps(info, indent=2, sort_keys=True) + "\n")
    log.info("devices: %s", json.dumps(info))


def cmd_extract(a):
    import os
    import signal

    from .extract.config import ExtractSettings, ModelSpec
    from .extract.run import extract_fasta

    # SIGTERM (Snakemake, SLURM) unwinds like an exception: the workers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = ModelSpec.from_dict(json.loads(a.model))
    settings = ExtractSettings.from_dict(json.loads(a.settings) if a.settings else {})
    delay = float(os.environ.get("AMPFLOW_EXTRACT_CHUNK_DELAY", a.chunk_delay))
    extract_fasta(
        a.fasta, spec, a.model_name, a.work, a.out, a.report, a.telemetry,
        settings=settings, model_folder=a.model_folder, delay=delay,
    )  # fmt: skip


def cmd_tiny_model(a):
    from .extract.tiny import write_tiny

    write_tiny(a.kind, a.out, seed=a.seed)
    log.info("tiny %s model (random weights, seed %d) written to %s", a.kind, a.seed, a.out)


def cmd_report_qc(a):
    from .prepare.qc import QCThresholds
    from .report.qc import qc_report

    th = QCThresholds(a.min_contacts, a.min_cis_fraction, a.min_umis, a.min_genes)
    qc_report(a.qc, a.scool, a.out_dir, th, label_key=a.label_key or None, dataset=a.dataset)


def cmd_report_plan(a):
    from .report.plan import plan_report

    plan_report(a.plan, a.out, name=a.name)


def cmd_report_memory(a):
    from .report.plan import memory_report

    memory_report(a.plan, a.profile, a.metrics, a.out, name=a.name)


def cmd_report_training(a):
    from .report.training import training_report

    training_report(a.metrics, a.out, name=a.name)


def cmd_report_summary(a):
    from .report.summary import summary_report

    lists = {"--plans": a.plans, "--scores": a.scores, "--metrics": a.metrics}
    for flag, values in lists.items():
        if len(values) != len(a.names):
            raise InputError(f"give one {flag} entry per --names entry ({len(a.names)})", key=flag, value=values)
    configs = {n: {"plan": p, "scores": s, "metrics": m} for n, p, s, m in zip(a.names, a.plans, a.scores, a.metrics)}
    summary_report(configs, a.out_dir, dataset=a.dataset)


def cmd_report_extraction(a):
    from .report.extraction import extraction_report

    if not (a.progress or a.telemetry or a.records):
        raise InputError("give at least one of --progress, --telemetry, --records", key="report-extraction")
    extraction_report(a.out_dir, progress=a.progress, telemetry=a.telemetry, records=a.records, name=a.name)


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampflow", description=__doc__.splitlines()[0])
    p.add_argument("--log", default=None, help="also append log lines to this file")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo-data", help="write a synthetic HiRES-like dataset")
    s.add_argument("outdir")
    s.add_argument("--cells", type=int, default=120)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=0.25, help="chromosome length scale vs mm10")
    s.add_argument("--genes", type=int, default=3000)
    s.set_defaults(func=cmd_demo_data)

    s = sub.add_parser("bin-pairs", help="bin one pairs file into a single-cell cooler")
    s.add_argument("pairs")
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--resolution", type=int, required=True)
    s.add_argument("--out", required=True)
    _add_naming(s)
    s.set_defaults(func=cmd_bin_pairs)

    s = sub.add_parser("bin-cells", help="bin every cell of a sheet into .scool files (cached per cell)")
    s.add_argument("--sheet", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--resolutions", type=int, nargs="+", required=True)
    s.add_argument("--out-scool", nargs="+", required=True, help="one per resolution, same order")
    s.add_argument("--stats", required=True, help="per-cell contact stats TSV")
    s.add_argument("--cache-dir", required=True)
    s.add_argument("--threads", type=int, default=1)
    _add_naming(s)
    s.set_defaults(func=cmd_bin_cells)

    s = sub.add_parser("load-rna", help="read, validate and round an RNA count matrix")
    s.add_argument("rna")
    s.add_argument("--out", required=True)
    s.add_argument("--stats", required=True)
    s.add_argument("--rounding", default="half_up", choices=["half_up", "half_even", "floor", "ceil"])
    s.set_defaults(func=cmd_load_rna)

    s = sub.add_parser("qc-cells", help="per-cell QC table")
    s.add_argument("--sheet", required=True)
    s.add_argument("--contacts", required=True)
    s.add_argument("--rna-stats", required=True)
    s.add_argument("--min-contacts", type=int, default=1000)
    s.add_argument("--min-cis-fraction", type=float, default=0.5)
    s.add_argument("--min-umis", type=int, default=500)
    s.add_argument("--min-genes", type=int, default=200)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_qc_cells)

    s = sub.add_parser("pseudobulk", help="pool passing cells into a multi-resolution .mcool")
    s.add_argument("--scool", nargs="+", required=True, help="RES=PATH entries")
    s.add_argument("--qc", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--no-balance", action="store_true")
    s.add_argument("--extra-resolutions", type=int, nargs="*", default=[], help="coarser zoom levels (multiples of the finest)")
    s.set_defaults(func=cmd_pseudobulk)

    s = sub.add_parser("strata", help="build the strata file (hic.h5ad)")
    s.add_argument("--scool", required=True)
    s.add_argument("--qc", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--chromosomes", default=None)
    s.add_argument("--strata", type=int, required=True)
    s.add_argument("--min-cells", type=int, default=1)
    s.add_argument("--min-count", type=int, default=1)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_strata)

    s = sub.add_parser("rna-data", help="build the RNA model file (rna.h5ad)")
    s.add_argument("--counts", required=True)
    s.add_argument("--qc", required=True)
    s.add_argument("--genes", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--n-top-genes", type=int, default=2000)
    s.add_argument("--out", required=True)
    _add_naming(s)
    s.set_defaults(func=cmd_rna_data)

    s = sub.add_parser("graph", help="build the guidance graph (nodes + edges tables)")
    s.add_argument("--rna", required=True)
    s.add_argument("--hic", required=True)
    s.add_argument("--mcool", required=True)
    s.add_argument("--chromsizes", required=True)
    s.add_argument("--chromosomes", default=None)
    s.add_argument("--promoter-upstream", type=int, default=2000)
    s.add_argument("--contact-quantile", type=float, default=0.9)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_graph)

    s = sub.add_parser("train", help="train the paired model on one configuration's data folder")
    s.add_argument("--data", required=True, help="data/{cfg} folder: rna.h5ad, hic.h5ad, graph/")
    s.add_argument("--out", required=True, help="train/{cfg} folder")
    s.add_argument("--name", default="", help="configuration name recorded in the outputs")
    s.add_argument("--model", default="", help="model settings as JSON (config section 'model')")
    s.add_argument("--train", default="", help="training settings as JSON (config section 'train')")
    s.add_argument("--plan", default=None, help="plan.json from `ampflow diagnose` (chunk size, key-first decode)")
    s.add_argument(
        "--launch", action="store_true",
        help="for a data-parallel plan (world size > 1, tp 1) start the plan's world of processes with torchrun; "
        "without it (or under torchrun) train in this process",
    )  # fmt: skip
    s.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: stop as if killed
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("evaluate", help="score embeddings (Leiden ARI/NMI, FOSCTTM) and plot a UMAP")
    s.add_argument("--embeddings", required=True)
    s.add_argument("--out-dir", required=True)
    s.add_argument("--label-key", default="cell_type")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser("profile", help="profile a data folder from metadata only (AMP step 1)")
    s.add_argument("data_dir")
    s.add_argument("--model-config", default=None, help="YAML/JSON with 'model' (and 'train') sections, or a model dict")
    s.add_argument("--model", default="", help="model settings as JSON (instead of --model-config)")
    s.add_argument("--train", default="", help="training settings as JSON (batch size)")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_profile)

    s = sub.add_parser("diagnose", help="signals -> strategies, mesh, chunk size: plan.json (AMP step 2)")
    s.add_argument("profile")
    s.add_argument("--devices", type=int, required=True)
    s.add_argument("--device-memory", required=True, help="GB per device, or 'auto' (free memory from NVML)")
    s.add_argument("--devices-file", default=None, help="devices.json from `ampflow devices`, for --device-memory auto")
    s.add_argument("--budget-fraction", type=float, default=0.9)
    s.add_argument("--dimensionality-ratio", type=float, default=10.0, help="HIGH_INPUT_DIMENSIONALITY threshold")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_diagnose)

    s = sub.add_parser("plan-explain", help="print a plan as a readable table")
    s.add_argument("plan")
    s.set_defaults(func=cmd_plan_explain)

    s = sub.add_parser("extract", help="embed a FASTA file with ESM-2 or DNABERT-S (chunks, worker pool, resume)")
    s.add_argument("fasta")
    s.add_argument("--model-name", required=True, help="the model's name in the config (recorded in the outputs)")
    s.add_argument("--model", required=True, help="the model's settings as JSON (an entry of extract.models)")
    s.add_argument("--model-folder", default=None, help="model folder when not the model's source (tiny models)")
    s.add_argument("--settings", default="", help="extract settings as JSON (config section 'extract')")
    s.add_argument("--work", required=True, help="work folder: chunks, per-chunk outputs and .done markers")
    s.add_argument("--out", required=True, help="merged .h5ad")
    s.add_argument("--report", required=True, help="TSV of problem records (skipped, truncated, ...)")
    s.add_argument("--telemetry", required=True, help="JSONL of GPU utilisation and memory samples")
    # tests: seconds each worker waits after a chunk, a window to kill the job in
    s.add_argument("--chunk-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_extract)

    s = sub.add_parser("tiny-model", help="write a tiny randomly initialised ESM-2 or DNABERT-S-shaped model folder")
    s.add_argument("--kind", required=True, choices=["esm2", "dnabert_s"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_tiny_model)

    s = sub.add_parser("devices", help="record the visible accelerators (NVML) as JSON")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_devices)

    s = sub.add_parser("report-qc", help="QC figures (contacts, cis fraction, P(s), RNA) and the failed-cells page")
    s.add_argument("--qc", required=True, help="qc/cells.tsv")
    s.add_argument("--scool", required=True, help="a binned .scool (the finest resolution) for P(s)")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--label-key", default="cell_type", help="QC-table column grouping P(s) ('' = none)")
    s.add_argument("--dataset", default="", help="name shown in titles")
    s.add_argument("--min-contacts", type=int, default=1000)
    s.add_argument("--min-cis-fraction", type=float, default=0.5)
    s.add_argument("--min-umis", type=int, default=500)
    s.add_argument("--min-genes", type=int, default=200)
    s.set_defaults(func=cmd_report_qc)

    s = sub.add_parser("report-plan", help="one plan.json as an HTML page")
    s.add_argument("--plan", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="", help="configuration name shown in the title")
    s.set_defaults(func=cmd_report_plan)

    s = sub.add_parser("report-memory", help="per-stratum and per-rank memory: predicted (plan) vs measured (metrics)")
    s.add_argument("--plan", required=True)
    s.add_argument("--profile", required=True)
    s.add_argument("--metrics", required=True, help="train/{cfg}/metrics.jsonl")
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="")
    s.set_defaults(func=cmd_report_memory)

    s = sub.add_parser("report-training", help="loss terms and cells/s per step and stage")
    s.add_argument("--metrics", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="")
    s.set_defaults(func=cmd_report_training)

    s = sub.add_parser("report-summary", help="scores and plans of every configuration: TSV, text, HTML, figure")
    s.add_argument("--names", nargs="+", required=True)
    s.add_argument("--plans", nargs="+", required=True)
    s.add_argument("--scores", nargs="+", required=True)
    s.add_argument("--metrics", nargs="+", required=True)
    s.add_argument("--out-dir", required=True)
    s.add_argument("--dataset", default="")
    s.set_defaults(func=cmd_report_summary)

    s = sub.add_parser("report-extraction", help="extraction throughput, GPU timelines and skipped/truncated records")
    s.add_argument("--progress", default=None, help="the extraction job's log (its 'done X/Y sequences' lines), or a progress JSONL")
    s.add_argument("--telemetry", default=None, help="{name}.{model}.telemetry.jsonl (NVML samples per GPU)")
    s.add_argument("--records", default=None, help="{name}.{model}.report.tsv (records skipped, truncated or changed)")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--name", default="")
    s.set_defaults(func=cmd_report_extraction)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else map(str, argv))
    _setup_logging(args.log, args.verbose)
    try:
        rc = args.func(args)
    except InputError as e:
        log.error("%s", e)
        print(f"ampflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
