# AMP: profile the data (metadata only) -> diagnose a plan -> train with it -> evaluate.
rule profile:
    input:
        rna=rna_data,
        hic=f"{RESULTS}/data/{{cfg}}/hic.h5ad",
        graph=f"{RESULTS}/data/{{cfg}}/graph",
    output:
        f"{RESULTS}/amp/{{cfg}}/profile.json",
    log:
        f"{LOGS}/profile.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    params:
        data=lambda wc: f"{RESULTS}/data/{wc.cfg}",
        model=shell_json(config["model"]),
        train=shell_json(config["train"]),
    shell:
        "ampflow profile {params.data} --model {params.model} --train {params.train}"
        " --out {output} > {log} 2>&1"


rule diagnose:
    input:
        profile=rules.profile.output[0],
        devices=rules.devices.output.devices,
        calibration=rules.devices.output.calibration,
    output:
        f"{RESULTS}/amp/{{cfg}}/plan.json",
    log:
        f"{LOGS}/diagnose.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    params:
        devices=config["amp"]["devices"],
        memory=config["amp"]["device_memory_gb"],
        fraction=config["amp"]["budget_fraction"],
        ratio=config["amp"]["dimensionality_ratio"],
        train=shell_json(config["train"]),
    shell:
        "ampflow diagnose {input.profile} --devices {params.devices}"
        " --device-memory {params.memory} --devices-file {input.devices} --train {params.train}"
        " --budget-fraction {params.fraction} --dimensionality-ratio {params.ratio}"
        " --calibration {input.calibration} --out {output} > {log} 2>&1"


rule train:
    input:
        rna=rna_data,
        hic=f"{RESULTS}/data/{{cfg}}/hic.h5ad",
        graph=f"{RESULTS}/data/{{cfg}}/graph",
        plan=rules.diagnose.output[0],
        # a path, not rules.split_cells.output: a rule reference lets Snakemake reach
        # the prepare chain past --allowed-rules
        split=f"{RESULTS}/qc/split.tsv",
    output:
        model=f"{RESULTS}/train/{{cfg}}/model.pt",
        embeddings=f"{RESULTS}/train/{{cfg}}/embeddings.h5ad",
        metrics=f"{RESULTS}/train/{{cfg}}/metrics.jsonl",
        config=f"{RESULTS}/train/{{cfg}}/config.yaml",
    log:
        f"{LOGS}/train.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    # the cores the plan divides among its processes (devices.json records them)
    threads: train_cores()
    # the allocation is the plan's (contract/allocation.py): GPUs, nodes, tasks, CPUs and
    # memory from plan.json and config "cluster"; <TBD> in a dry run before the plan exists
    resources:
        # a GPU plan's partition; none for a CPU plan (the profile's default applies)
        **SIZING.gpu_partition(SIZING.train_resource("slurm_partition")),
        gpu=SIZING.train_resource("gpu", 0),
        nodes=SIZING.train_resource("nodes"),
        tasks=SIZING.train_resource("tasks"),
        mpi=SIZING.train_resource("mpi"),
        cpus_per_gpu=SIZING.train_resource("cpus_per_gpu"),
        cpus_per_task=SIZING.train_resource("cpus_per_task"),
        slurm_extra=SIZING.train_resource("slurm_extra"),
        mem_mb=SIZING.train_resource("mem_mb"),
        runtime=720,
    params:
        data=lambda wc: f"{RESULTS}/data/{wc.cfg}",
        # checkpoints live beside the declared outputs, not among them: Snakemake
        # deletes a failed job's outputs, and a re-run resumes from the checkpoints
        out=lambda wc: f"{RESULTS}/train/{wc.cfg}",
        model=shell_json(config["model"]),
        train=shell_json(config["train"]),
    # --launch: a plan of dp x tp > 1 processes trains under torchrun (--standalone on
    # one node; across the nodes of a SLURM job, one torchrun per node through the job's
    # own srun, c10d rendezvous on the first node); one process per GPU, gloo on CPU,
    # NCCL on GPUs. A one-device plan trains in this process. Held-out cells (--split)
    # are in no batch; embeddings.h5ad holds every cell.
    shell:
        "ampflow train --launch --data {params.data} --out {params.out} --name {wildcards.cfg}"
        " --model {params.model} --train {params.train} --plan {input.plan}"
        " --split {input.split} > {log} 2>&1"


rule evaluate:
    input:
        embeddings=rules.train.output.embeddings,
        # the RNA-only and Hi-C-only baselines are built from the same data folder
        # (a Hi-C-only dataset: the Hi-C baseline alone)
        rna=rna_data,
        hic=f"{RESULTS}/data/{{cfg}}/hic.h5ad",
    output:
        scores=f"{RESULTS}/eval/{{cfg}}/scores.json",
        umap=report(
            f"{RESULTS}/eval/{{cfg}}/umap.png",
            caption="../report/umap.rst",
            category="4. Evaluation",
            subcategory="{cfg}",
            labels={
                "configuration": "{cfg}",
                "figure": "UMAP by cell type and modality",
            },
        ),
    log:
        f"{LOGS}/evaluate.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        out=lambda wc: f"{RESULTS}/eval/{wc.cfg}",
        data=lambda wc: f"{RESULTS}/data/{wc.cfg}",
        label=config["evaluate"]["label_key"],
        batch=shlex.quote(config["model"].get("batch_key") or ""),
        seed=config["train"]["seed"],
    shell:
        "ampflow evaluate --embeddings {input.embeddings} --data {params.data} --out-dir {params.out}"
        " --label-key {params.label} --batch-key {params.batch} --seed {params.seed} > {log} 2>&1"
