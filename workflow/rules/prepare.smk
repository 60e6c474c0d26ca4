# Raw pairs + RNA counts -> QC table, held-out split, binned coolers, strata files,
# guidance graph. Held-out cells stay in the data files but nothing is fitted on them
# (HVGs, the strata feature filter, the pseudobulk behind the graph's contact edges).


# One job per block of cells (config prepare.block_cells), so that a cluster spreads
# the binning over nodes and a grown sheet re-bins only the blocks whose rows changed:
# the block's rows are a parameter (their digest), not the sheet file, which every
# block would otherwise depend on.
rule bin_block:
    input:
        pairs=lambda wc: block_sheet(wc.block)["pairs"].tolist(),
        chromsizes=INPUTS["chromsizes"],
    output:
        scool=[f"{RESULTS}/binned/blocks/{{block}}/{res}.scool" for res in RESOLUTIONS],
        stats=f"{RESULTS}/binned/blocks/{{block}}/contacts.tsv",
    log:
        f"{LOGS}/bin_block/{{block}}.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: config["threads"]
    resources:
        mem_mb=lambda wc, input, threads: bin_block_mem_mb(input.pairs, threads),
        runtime=need_runtime("bin_block"),
    params:
        sheet=INPUTS["cells"],
        block_cells=BLOCK_CELLS,
        digest=lambda wc: block_digest(
            block_sheet(wc.block)["cell_id"], block_sheet(wc.block)["pairs"]
        ),
        resolutions=" ".join(str(bp) for bp in RESOLUTIONS.values()),
        naming=naming_args(config["genome"], config["pairs"]),
    shell:
        "ampflow bin-block --sheet {params.sheet} --block {wildcards.block}"
        " --block-cells {params.block_cells} --digest {params.digest}"
        " --chromsizes {input.chromsizes} --resolutions {params.resolutions}"
        " --out-scool {output.scool} --stats {output.stats} --threads {threads}"
        " {params.naming} > {log} 2>&1"


# The blocks' cells into one .scool per resolution (compressed chunks copied as they
# are) and their contact counts into the QC input
rule gather_blocks:
    input:
        scool=[
            f"{PATHS.block_folder(b)}/{res}.scool"
            for b in BLOCKS
            for res in RESOLUTIONS
        ],
        stats=[f"{PATHS.block_folder(b)}/contacts.tsv" for b in BLOCKS],
    output:
        scool=[f"{RESULTS}/binned/{res}.scool" for res in RESOLUTIONS],
        stats=f"{RESULTS}/qc/contacts.tsv",
    log:
        f"{LOGS}/gather_blocks.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: 1
    resources:
        mem_mb=need_mem_mb("gather_blocks"),
        runtime=need_runtime("gather_blocks"),
    params:
        # the blocks' folders, in block order: those of their contact tables
        blocks=lambda wc, input: " ".join(os.path.dirname(p) for p in input.stats),
        labels=" ".join(RESOLUTIONS),
    shell:
        "ampflow gather-blocks --blocks {params.blocks} --resolutions {params.labels}"
        " --out-scool {output.scool} --stats {output.stats} > {log} 2>&1"


# RNA rules exist only for datasets with an RNA matrix (see HAS_RNA)
if HAS_RNA:

    rule load_rna:
        input:
            INPUTS["rna"],
        output:
            counts=f"{RESULTS}/rna/counts.h5ad",
            stats=f"{RESULTS}/qc/rna.tsv",
        log:
            f"{LOGS}/load_rna.log",
        conda:
            "../../envs/ampflow.yaml"
        resources:
            mem_mb=need_mem_mb("load_rna"),
            runtime=need_runtime("load_rna"),
        params:
            rounding=config["rna"]["rounding"],
        shell:
            "ampflow load-rna {input} --out {output.counts} --stats {output.stats}"
            " --rounding {params.rounding} > {log} 2>&1"


rule qc_cells:
    input:
        sheet=INPUTS["cells"],
        contacts=rules.gather_blocks.output.stats,
        rna=f"{RESULTS}/qc/rna.tsv" if HAS_RNA else [],
    output:
        f"{RESULTS}/qc/cells.tsv",
    log:
        f"{LOGS}/qc_cells.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=need_mem_mb("qc_cells"),
        runtime=need_runtime("qc_cells"),
    params:
        qc=qc_args(config["qc"]),
        # without RNA, cells pass on their contacts alone
        rna=rna_arg("--rna-stats", f"{RESULTS}/qc/rna.tsv"),
    shell:
        "ampflow qc-cells --sheet {input.sheet} --contacts {input.contacts}"
        " {params.rna} {params.qc} --out {output} > {log} 2>&1"


rule split_cells:
    input:
        rules.qc_cells.output[0],
    output:
        f"{RESULTS}/qc/split.tsv",
    log:
        f"{LOGS}/split_cells.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: 1
    resources:
        mem_mb=need_mem_mb("split_cells"),
        runtime=need_runtime("split_cells"),
    params:
        holdout=config["evaluate"]["holdout"],
        seed=config["evaluate"]["seed"],
        label=label_arg(config["evaluate"]["label_key"], CELLS.columns, logger.info),
    shell:
        "ampflow split-cells --qc {input} --holdout {params.holdout} {params.label}"
        " --seed {params.seed} --out {output} > {log} 2>&1"


rule pseudobulk:
    input:
        scool=rules.gather_blocks.output.scool,
        qc=rules.qc_cells.output[0],
        split=rules.split_cells.output[0],
    output:
        f"{RESULTS}/binned/pseudobulk.mcool",
    log:
        f"{LOGS}/pseudobulk.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: config["threads"]
    resources:
        mem_mb=need_mem_mb("pseudobulk"),
        runtime=need_runtime("pseudobulk"),
    params:
        scools=" ".join(
            f"{bp}={RESULTS}/binned/{res}.scool" for res, bp in RESOLUTIONS.items()
        ),
        balance="" if config["pseudobulk"]["balance"] else "--no-balance",
        extra=" ".join(map(str, config["pseudobulk"]["resolutions"])),
    shell:
        "ampflow pseudobulk --scool {params.scools} --qc {input.qc} --split {input.split}"
        " {params.balance} --extra-resolutions {params.extra} --threads {threads}"
        " --out {output} > {log} 2>&1"


rule strata:
    input:
        scool=lambda wc: f"{RESULTS}/binned/{cfg_resolution(wc)}.scool",
        qc=rules.qc_cells.output[0],
        split=rules.split_cells.output[0],
        chromsizes=INPUTS["chromsizes"],
    output:
        f"{RESULTS}/data/{{cfg}}/hic.h5ad",
    log:
        f"{LOGS}/strata.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=need_mem_mb("strata"),
        runtime=need_runtime("strata"),
    params:
        strata=lambda wc: TRAIN_CONFIGS[wc.cfg]["strata"],
        chroms=chromosomes_arg(config["genome"]["chromosomes"]),
        min_cells=config["hic"]["min_cells"],
        min_count=config["hic"]["min_count"],
    shell:
        "ampflow strata --scool {input.scool} --qc {input.qc}"
        " --chromsizes {input.chromsizes} {params.chroms} --strata {params.strata}"
        " --min-cells {params.min_cells} --min-count {params.min_count}"
        " --split {input.split} --out {output} > {log} 2>&1"


if HAS_RNA:

    rule rna_data:
        input:
            counts=rules.load_rna.output.counts,
            qc=rules.qc_cells.output[0],
            split=rules.split_cells.output[0],
            genes=INPUTS["genes"],
            chromsizes=INPUTS["chromsizes"],
        output:
            f"{RESULTS}/data/{{cfg}}/rna.h5ad",
        log:
            f"{LOGS}/rna_data.{{cfg}}.log",
        conda:
            "../../envs/ampflow.yaml"
        resources:
            mem_mb=need_mem_mb("rna_data"),
            runtime=need_runtime("rna_data"),
        params:
            n_top=config["rna"]["n_top_genes"],
            naming=naming_args(config["genome"], config["pairs"]),
        shell:
            "ampflow rna-data --counts {input.counts} --qc {input.qc}"
            " --genes {input.genes} --chromsizes {input.chromsizes}"
            " --n-top-genes {params.n_top} {params.naming} --split {input.split}"
            " --out {output} > {log} 2>&1"


rule graph:
    input:
        rna=rna_data,
        hic=rules.strata.output[0],
        mcool=rules.pseudobulk.output[0],
        chromsizes=INPUTS["chromsizes"],
    output:
        directory(f"{RESULTS}/data/{{cfg}}/graph"),
    log:
        f"{LOGS}/graph.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=need_mem_mb("graph"),
        runtime=need_runtime("graph"),
    params:
        chroms=chromosomes_arg(config["genome"]["chromosomes"]),
        upstream=config["graph"]["promoter_upstream"],
        quantile=config["graph"]["contact_quantile"],
        # Hi-C only: anchors and their contact edges, no genes
        rna=lambda wc: rna_arg("--rna", rna_data(wc)),
    shell:
        "ampflow graph {params.rna} --hic {input.hic} --mcool {input.mcool}"
        " --chromsizes {input.chromsizes} {params.chroms}"
        " --promoter-upstream {params.upstream} --contact-quantile {params.quantile}"
        " --out {output} > {log} 2>&1"


# What a training allocation sees, and the cost model's constants measured on it (a
# micro-benchmark of the attention kernel with the model's heads, width and window, on
# the training device and threads): the diagnosis chooses the chunk size by them, and on
# CPU the threads per process from the cores it records.
rule devices:
    output:
        devices=f"{RESULTS}/amp/devices.json",
        calibration=f"{RESULTS}/amp/calibration.json",
    log:
        f"{LOGS}/devices.log",
    conda:
        "../../envs/ampflow.yaml"
    # as many cores as a training job: devices.json records them, the plan divides them
    threads: train_cores()
    # one node's share of amp.devices' GPUs (config "cluster"), or none for a CPU run
    resources:
        **SIZING.devices_resources(),
        runtime=10,
    # Only what the measurement depends on (decoder heads, width, window and feed-forward
    # shape; train.device and threads; the processes sharing the cores): Snakemake re-runs
    # a job whose params changed, and a new seed, schedule, learning rate or loss weight
    # re-plans (diagnose takes the whole sections) without timing the machine again.
    params:
        calibration=calibration_args(config["model"], config["train"]),
        processes=config["amp"]["devices"],
    # the calibration times with the threads the plan will give each process
    shell:
        "(ampflow devices --cores {threads} --out {output.devices}"
        " && ampflow calibrate {params.calibration}"
        " --devices-file {output.devices} --processes {params.processes}"
        " --out {output.calibration}) > {log} 2>&1"
