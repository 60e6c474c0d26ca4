# Embed cells with a trained model without retraining: the training data folder itself
# (rule embed, not in the default target: it repeats train's embeddings.h5ad) and every
# set of config "embed" (rule embed_cells). A set is a prepared folder, or raw cells (a
# cell sheet and RNA counts, as inputs.cells / inputs.rna) that the embed_* rules below
# QC, bin and turn into strata and RNA files under embed/cells/{cells}/ with nothing
# fitted on them: the configuration's bins and strata, every candidate feature and every
# gene, mapped onto the model's by name when embedding. Their inputs are the model, the
# set's own files and the config's genome files only, so new cells never make train run
# again.
EMBED_PREP = f"{RESULTS}/embed/cells/{{cells}}"
EMBED_LOGS = f"{LOGS}/embed/{{cells}}"


rule embed:
    input:
        model=rules.train.output.model,
        rna=rna_data,
        hic=f"{RESULTS}/data/{{cfg}}/hic.h5ad",
    output:
        f"{RESULTS}/embed/{{cfg}}/embeddings.h5ad",
    log:
        f"{LOGS}/embed.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: SIZING.embed_threads(train_cores())
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        # a Hi-C-only model embeds hic.h5ad alone
        rna=lambda wc, input: rna_arg("--rna", input.rna),
    shell:
        "ampflow embed --model {input.model} {params.rna} --hic {input.hic}"
        " --threads {threads} --out {output} > {log} 2>&1"


rule embed_cells:
    input:
        model=rules.train.output.model,
        rna=PATHS.embed_input(EMBED_SETS, "rna") if HAS_RNA else [],
        hic=PATHS.embed_input(EMBED_SETS, "hic"),
    output:
        f"{RESULTS}/embed/{{cfg}}/{{cells}}/embeddings.h5ad",
    log:
        f"{LOGS}/embed.{{cfg}}.{{cells}}.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: SIZING.embed_threads(train_cores())
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        # a Hi-C-only model embeds hic.h5ad alone
        rna=lambda wc, input: rna_arg("--rna", input.rna),
    shell:
        "ampflow embed --model {input.model} {params.rna} --hic {input.hic}"
        " --threads {threads} --out {output} > {log} 2>&1"


# ---------------------------------------------------------------- raw cells of a set
# The same commands as the prepare rules, on the set's files, with nothing fitted.
rule embed_bin_cells:
    input:
        sheet=lambda wc: EMBED_SETS[wc.cells]["cells"],
        pairs=lambda wc: EMBED_SHEETS[wc.cells]["pairs"].tolist(),
        chromsizes=INPUTS["chromsizes"],
    output:
        scool=[f"{EMBED_PREP}/binned/{res}.scool" for res in RESOLUTIONS],
        stats=f"{EMBED_PREP}/qc/contacts.tsv",
    log:
        f"{EMBED_LOGS}/bin_cells.log",
    conda:
        "../../envs/ampflow.yaml"
    threads: config["threads"]
    resources:
        mem_mb=lambda wc, threads: 2000 + 1500 * threads,
        runtime=120,
    params:
        resolutions=" ".join(str(bp) for bp in RESOLUTIONS.values()),
        # outside the declared outputs, as bin_cells': a grown sheet bins only its new cells
        cache=lambda wc: f"{RESULTS}/embed/cells/{wc.cells}/binned/.cache",
        naming=naming_args(config["genome"], config["pairs"]),
    shell:
        "ampflow bin-cells --sheet {input.sheet} --chromsizes {input.chromsizes}"
        " --resolutions {params.resolutions} --out-scool {output.scool}"
        " --stats {output.stats} --cache-dir {params.cache} --threads {threads}"
        " {params.naming} > {log} 2>&1"


rule embed_load_rna:
    input:
        lambda wc: EMBED_SETS[wc.cells]["rna"],
    output:
        counts=f"{EMBED_PREP}/rna/counts.h5ad",
        stats=f"{EMBED_PREP}/qc/rna.tsv",
    log:
        f"{EMBED_LOGS}/load_rna.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        rounding=config["rna"]["rounding"],
    shell:
        "ampflow load-rna {input} --out {output.counts} --stats {output.stats}"
        " --rounding {params.rounding} > {log} 2>&1"


rule embed_qc_cells:
    input:
        sheet=lambda wc: EMBED_SETS[wc.cells]["cells"],
        contacts=rules.embed_bin_cells.output.stats,
        rna=rules.embed_load_rna.output.stats if HAS_RNA else [],
    output:
        f"{EMBED_PREP}/qc/cells.tsv",
    log:
        f"{EMBED_LOGS}/qc_cells.log",
    conda:
        "../../envs/ampflow.yaml"
    params:
        qc=qc_args(config["qc"]),
        # without RNA, cells pass on their contacts alone (as rule qc_cells)
        rna=lambda wc, input: rna_arg("--rna-stats", input.rna),
    shell:
        "ampflow qc-cells --sheet {input.sheet} --contacts {input.contacts}"
        " {params.rna} {params.qc} --out {output} > {log} 2>&1"


# every gene: the model picks its own by name (no HVGs chosen on these cells)
rule embed_rna_data:
    input:
        counts=rules.embed_load_rna.output.counts,
        qc=rules.embed_qc_cells.output[0],
    output:
        f"{EMBED_PREP}/rna.h5ad",
    log:
        f"{EMBED_LOGS}/rna_data.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=8000,
        runtime=60,
    shell:
        "ampflow rna-data --counts {input.counts} --qc {input.qc} --all-genes"
        " --out {output} > {log} 2>&1"


# every candidate feature of the configuration's bins and strata (no feature filter
# fitted on these cells): the model picks its own by name
rule embed_strata:
    input:
        scool=lambda wc: f"{RESULTS}/embed/cells/{wc.cells}/binned/{cfg_resolution(wc)}.scool",
        qc=rules.embed_qc_cells.output[0],
        chromsizes=INPUTS["chromsizes"],
    output:
        f"{EMBED_PREP}/{{cfg}}/hic.h5ad",
    log:
        f"{EMBED_LOGS}/strata.{{cfg}}.log",
    conda:
        "../../envs/ampflow.yaml"
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        strata=lambda wc: TRAIN_CONFIGS[wc.cfg]["strata"],
        chroms=chromosomes_arg(config["genome"]["chromosomes"]),
    shell:
        "ampflow strata --scool {input.scool} --qc {input.qc}"
        " --chromsizes {input.chromsizes} {params.chroms} --strata {params.strata}"
        " --min-cells 0 --min-count 0 --out {output} > {log} 2>&1"
