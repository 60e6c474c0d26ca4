"""Commands that turn results into the report's pages, figures and tables."""

from __future__ import annotations

import logging

from ..base.errors import InputError

log = logging.getLogger("ampflow")


def cmd_report_qc(a):
    from ..prepare.qc import QCThresholds
    from ..report.qc import qc_report

    th = QCThresholds(a.min_contacts, a.min_cis_fraction, a.min_umis, a.min_genes)
    qc_report(a.qc, a.scool, a.out_dir, th, label_key=a.label_key or None, dataset=a.dataset)


def cmd_report_plan(a):
    from ..report.plan import plan_report

    plan_report(a.plan, a.out, name=a.name)


def cmd_report_memory(a):
    from ..report.plan import memory_report

    memory_report(a.plan, a.profile, a.metrics, a.out, name=a.name)


def cmd_report_training(a):
    from ..report.training import training_report

    training_report(a.metrics, a.out, name=a.name)


def cmd_report_summary(a):
    from ..report.summary import summary_report

    lists = {"--plans": a.plans, "--scores": a.scores, "--metrics": a.metrics}
    for flag, values in lists.items():
        if len(values) != len(a.names):
            raise InputError(f"give one {flag} entry per --names entry ({len(a.names)})", key=flag, value=values)
    configs = {n: {"plan": p, "scores": s, "metrics": m} for n, p, s, m in zip(a.names, a.plans, a.scores, a.metrics)}
    summary_report(configs, a.out_dir, dataset=a.dataset)


def cmd_report_extraction(a):
    from ..report.extraction import extraction_report

    if not (a.progress or a.telemetry or a.records):
        raise InputError("give at least one of --progress, --telemetry, --records", key="report-extraction")
    extraction_report(a.out_dir, progress=a.progress, telemetry=a.telemetry, records=a.records, name=a.name)


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
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
    s.add_argument("--progress", default=None, help="{name}.{model}.progress.jsonl (one row per finished chunk, from the markers)")
    s.add_argument("--telemetry", default=None, help="{name}.{model}.telemetry.jsonl (NVML samples per GPU)")
    s.add_argument("--records", default=None, help="{name}.{model}.report.tsv (records skipped, truncated or changed)")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--name", default="")
    s.set_defaults(func=cmd_report_extraction)
