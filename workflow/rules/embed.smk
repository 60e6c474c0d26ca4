# Embed cells with a trained model without retraining: the training data folder itself
# (rule embed, not in the default target: it repeats train's embeddings.h5ad) and every
# prepared folder of config "embed" (rule embed_cells). Their inputs are the model and
# the cells' files only, so new cells never make train run again.
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
        "../../envs/prepare.yaml"
    threads: config["train"]["threads"]
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
        rna=lambda wc: f"{EMBED_SETS[wc.cells]}/rna.h5ad" if HAS_RNA else [],
        hic=lambda wc: f"{EMBED_SETS[wc.cells]}/hic.h5ad",
    output:
        f"{RESULTS}/embed/{{cfg}}/{{cells}}/embeddings.h5ad",
    log:
        f"{LOGS}/embed.{{cfg}}.{{cells}}.log",
    conda:
        "../../envs/prepare.yaml"
    threads: config["train"]["threads"]
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        # a Hi-C-only model embeds hic.h5ad alone
        rna=lambda wc, input: rna_arg("--rna", input.rna),
    shell:
        "ampflow embed --model {input.model} {params.rna} --hic {input.hic}"
        " --threads {threads} --out {output} > {log} 2>&1"
