# FASTA -> protein / DNA language-model features (ESM-2, DNABERT-S), one job per
# (input, model). Chunks, per-chunk outputs and .done markers live in the work folder
# results/{dataset}/extract/{name}/{model}/, beside the declared outputs and not among
# them: Snakemake deletes a failed job's outputs, and a re-run skips finished chunks.
# Every declared output is rebuilt in full by every run, from the work folder (the
# progress from the chunks' markers): a re-run that finds all chunks done, as after a
# crash, writes them all again, and no later rule reads the job's log.


rule tiny_model:
    output:
        directory("resources/models/{model}"),
    log:
        f"{LOGS}/tiny_model.{{model}}.log",
    wildcard_constraints:
        # only models marked tiny: never write into a folder a real model is expected in
        model=alternatives(m for m, spec in EXTRACT_MODELS.items() if spec.tiny),
    conda:
        "../../envs/extract.yaml"
    params:
        kind=lambda wc: EXTRACT_MODELS[wc.model].kind,
    shell:
        "ampflow tiny-model --kind {params.kind} --seed 0 --out {output} > {log} 2>&1"


rule extract:
    input:
        fasta=lambda wc: EXTRACT_INPUTS[wc.name]["fasta"],
        model=extract_model_input,
    output:
        h5ad=f"{RESULTS}/extract/{{name}}.{{model}}.h5ad",
        report=f"{RESULTS}/extract/{{name}}.{{model}}.report.tsv",
        telemetry=f"{RESULTS}/extract/{{name}}.{{model}}.telemetry.jsonl",
        progress=f"{RESULTS}/extract/{{name}}.{{model}}.progress.jsonl",
    log:
        f"{LOGS}/extract.{{name}}.{{model}}.log",
    benchmark:
        f"{LOGS}/extract.{{name}}.{{model}}.benchmark.tsv"
    conda:
        "../../envs/extract.yaml"
    threads: extract_threads()
    resources:
        # the GPU partition and CPUs per GPU of config "cluster"
        **extract_gpu_resources(),
        # a counter locally (Snakemake sets no CUDA_VISIBLE_DEVICES); --gpus=N on SLURM.
        # The job starts one worker per GPU it sees, up to extract.gpus.
        gpu=EXTRACT_SETTINGS.gpus if extract_uses_gpus() else 0,
        mem_mb=16000,
        runtime=1440,
    params:
        work=lambda wc: f"{RESULTS}/extract/{wc.name}/{wc.model}",
        model=extract_model_arg,
        folder=extract_folder_arg,
        settings=extract_settings_arg(),
    shell:
        "ampflow extract {input.fasta} --model-name {wildcards.model} --model {params.model}"
        " {params.folder} --settings {params.settings} --work {params.work}"
        " --out {output.h5ad} --report {output.report} --telemetry {output.telemetry}"
        " --progress {output.progress}"
        " > {log} 2>&1"
