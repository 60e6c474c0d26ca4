# Figures and tables for `snakemake --report results/{dataset}/report.zip`; captions in
# workflow/report/. The summary table is also printed at the end of every run (onsuccess).


rule report_qc:
    input:
        qc=rules.qc_cells.output[0],
        scool=f"{RESULTS}/binned/{FINEST}.scool",
    output:
        contacts=report(
            f"{REPORT}/qc/contacts.png",
            caption="../report/qc_contacts.rst",
            category="1. Quality control",
            subcategory="Hi-C",
            labels={"figure": "contacts per cell and cis fraction"},
        ),
        decay=report(
            f"{REPORT}/qc/distance_decay.png",
            caption="../report/qc_distance_decay.rst",
            category="1. Quality control",
            subcategory="Hi-C",
            labels={"figure": "contact-distance decay P(s) by cell type"},
        ),
        rna=report(
            f"{REPORT}/qc/rna.png",
            caption="../report/qc_rna.rst",
            category="1. Quality control",
            subcategory="RNA",
            labels={"figure": "UMIs and genes per cell"},
        ),
        failed=report(
            f"{REPORT}/qc/failed_cells.html",
            caption="../report/qc_failed.rst",
            category="1. Quality control",
            subcategory="Cells",
            labels={"figure": "cells failing QC and why"},
        ),
    log:
        f"{LOGS}/report_qc.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        out=lambda wc, output: Path(output.contacts).parent,
        label=config["evaluate"]["label_key"],
        dataset=DATASET,
        qc=qc_args(config["qc"]),
    shell:
        "ampflow report-qc --qc {input.qc} --scool {input.scool} --out-dir {params.out}"
        " --label-key {params.label} --dataset {params.dataset} {params.qc} > {log} 2>&1"


rule report_plan:
    input:
        rules.diagnose.output[0],
    output:
        report(
            f"{REPORT}/{{cfg}}/plan.html",
            caption="../report/amp_plan.rst",
            category="2. AMP plans",
            subcategory="{cfg}",
            labels={"configuration": "{cfg}", "figure": "plan"},
        ),
    log:
        f"{LOGS}/report_plan.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    shell:
        "ampflow report-plan --plan {input} --out {output} --name {wildcards.cfg} > {log} 2>&1"


rule report_memory:
    input:
        plan=rules.diagnose.output[0],
        profile=rules.profile.output[0],
        metrics=rules.train.output.metrics,
    output:
        report(
            f"{REPORT}/{{cfg}}/memory.png",
            caption="../report/amp_memory.rst",
            category="2. AMP plans",
            subcategory="{cfg}",
            labels={"configuration": "{cfg}", "figure": "memory per stratum and rank"},
        ),
    log:
        f"{LOGS}/report_memory.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    shell:
        "ampflow report-memory --plan {input.plan} --profile {input.profile}"
        " --metrics {input.metrics} --out {output} --name {wildcards.cfg} > {log} 2>&1"


rule report_training:
    input:
        rules.train.output.metrics,
    output:
        report(
            f"{REPORT}/{{cfg}}/training.png",
            caption="../report/training.rst",
            category="3. Training",
            subcategory="{cfg}",
            labels={"configuration": "{cfg}", "figure": "loss terms and cells/s"},
        ),
    log:
        f"{LOGS}/report_training.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    shell:
        "ampflow report-training --metrics {input} --out {output} --name {wildcards.cfg} > {log} 2>&1"


rule report_summary:
    input:
        plans=expand(rules.diagnose.output[0], cfg=TRAIN_CONFIGS),
        scores=expand(rules.evaluate.output.scores, cfg=TRAIN_CONFIGS),
        metrics=expand(rules.train.output.metrics, cfg=TRAIN_CONFIGS),
    output:
        table=f"{REPORT}/summary.tsv",
        text=f"{REPORT}/summary.txt",
        html=report(
            f"{REPORT}/summary.html",
            caption="../report/summary.rst",
            category="4. Evaluation",
            subcategory="All configurations",
            labels={"configuration": "all", "figure": "summary table"},
        ),
        scores=report(
            f"{REPORT}/scores.png",
            caption="../report/scores.rst",
            category="4. Evaluation",
            subcategory="All configurations",
            labels={"configuration": "all", "figure": "ARI, NMI, FOSCTTM"},
        ),
    log:
        f"{LOGS}/report_summary.log",
    conda:
        "../../envs/ampflow.yaml"
    params:
        names=" ".join(TRAIN_CONFIGS),
        out=lambda wc, output: Path(output.table).parent,
        dataset=DATASET,
    shell:
        "ampflow report-summary --names {params.names} --plans {input.plans}"
        " --scores {input.scores} --metrics {input.metrics} --out-dir {params.out}"
        " --dataset {params.dataset} > {log} 2>&1"
