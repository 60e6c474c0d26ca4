# FASTA -> protein / DNA language-model features (ESM-2, DNABERT-S). One `extract` job
# per model runs over all the model's inputs: one queue, one worker per GPU, each loading
# the model once; it puts every sequence's vectors into the content-addressed cache
# (results/{dataset}/extract/cache, or extract.cache), so a re-run, a changed input or
# a second input sharing sequences computes only what the cache lacks. Its work folder
# results/{dataset}/extract/work/{model}/ (splits, queue) is beside the declared outputs
# and not among them: Snakemake deletes a failed job's outputs. Then one light
# `extract_outputs` job per (input, model) writes that input's files from the cache;
# each rebuilds its outputs in full from disk (the progress from the shards' markers),
# so a re-run that finds everything cached writes them all again, and no later rule
# reads a log.


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
        fasta=lambda wc: [
            EXTRACT_INPUTS[n]["fasta"]
            for n in extract_model_inputs(EXTRACT_INPUTS, wc.model)
        ],
        model=lambda wc: extract_model_input(EXTRACT_MODELS, wc.model),
    output:
        record=f"{RESULTS}/extract/{{model}}.job.json",
    log:
        f"{LOGS}/extract.{{model}}.log",
    benchmark:
        f"{LOGS}/extract.{{model}}.benchmark.tsv"
    wildcard_constraints:
        model=alternatives(EXTRACT_MODELS),
    conda:
        "../../envs/extract.yaml"
    threads: EXTRACT_SETTINGS.job_threads
    resources:
        # the GPU partition and CPUs per GPU of config "cluster"
        **EXTRACT_SETTINGS.gpu_job_resources(CLUSTER),
        # a counter locally (Snakemake sets no CUDA_VISIBLE_DEVICES); --gpus=N on SLURM.
        # The job starts one worker per GPU it sees, up to extract.gpus.
        gpu=EXTRACT_SETTINGS.gpus if EXTRACT_SETTINGS.uses_gpus else 0,
        mem_mb=16000,
        runtime=1440,
    params:
        inputs=lambda wc: extract_input_args(EXTRACT_INPUTS, wc.model),
        work=lambda wc: f"{RESULTS}/extract/work/{wc.model}",
        cache=EXTRACT_SETTINGS.cache or f"{RESULTS}/extract/cache",
        model=lambda wc: shell_json(EXTRACT["models"][wc.model]),
        folder=lambda wc: extract_folder_arg(EXTRACT_MODELS, wc.model),
        settings=extract_settings_arg(EXTRACT),
    shell:
        "ampflow extract {params.inputs} --model-name {wildcards.model} --model {params.model}"
        " {params.folder} --settings {params.settings} --work {params.work}"
        " --cache {params.cache} --record {output.record} > {log} 2>&1"


rule extract_outputs:
    input:
        record=rules.extract.output.record,
    output:
        h5ad=f"{RESULTS}/extract/{{name}}.{{model}}.h5ad",
        report=f"{RESULTS}/extract/{{name}}.{{model}}.report.tsv",
        telemetry=f"{RESULTS}/extract/{{name}}.{{model}}.telemetry.jsonl",
        progress=f"{RESULTS}/extract/{{name}}.{{model}}.progress.jsonl",
    log:
        f"{LOGS}/extract_outputs.{{name}}.{{model}}.log",
    wildcard_constraints:
        name=alternatives(EXTRACT_INPUTS),
        model=alternatives(EXTRACT_MODELS),
    conda:
        "../../envs/extract.yaml"
    resources:
        mem_mb=4000,
    shell:
        "ampflow extract-outputs --record {input.record} --name {wildcards.name}"
        " --out {output.h5ad} --report {output.report} --telemetry {output.telemetry}"
        " --progress {output.progress} > {log} 2>&1"


# Rows per window of an input under too_long: window, and per-token vectors of a model
# with per_token: true (all_outputs asks for them only then)
rule extract_windows:
    input:
        record=rules.extract.output.record,
    output:
        f"{RESULTS}/extract/{{name}}.{{model}}.windows.h5ad",
    log:
        f"{LOGS}/extract_windows.{{name}}.{{model}}.log",
    wildcard_constraints:
        name=alternatives(EXTRACT_INPUTS),
        model=alternatives(EXTRACT_MODELS),
    conda:
        "../../envs/extract.yaml"
    resources:
        mem_mb=4000,
    shell:
        "ampflow extract-outputs --record {input.record} --name {wildcards.name}"
        " --windows {output} > {log} 2>&1"


rule extract_tokens:
    input:
        record=rules.extract.output.record,
    output:
        f"{RESULTS}/extract/{{name}}.{{model}}.tokens.h5",
    log:
        f"{LOGS}/extract_tokens.{{name}}.{{model}}.log",
    wildcard_constraints:
        name=alternatives(EXTRACT_INPUTS),
        model=alternatives(EXTRACT_MODELS),
    conda:
        "../../envs/extract.yaml"
    resources:
        mem_mb=4000,
    shell:
        "ampflow extract-outputs --record {input.record} --name {wildcards.name}"
        " --tokens {output} > {log} 2>&1"


rule report_extraction:
    input:
        progress=rules.extract_outputs.output.progress,
        telemetry=rules.extract_outputs.output.telemetry,
        records=rules.extract_outputs.output.report,
    output:
        throughput=report(
            f"{REPORT}/extract/{{name}}.{{model}}/throughput.png",
            caption="../report/extraction_throughput.rst",
            category="5. Feature extraction",
            subcategory="{name}.{model}",
            labels={"input": "{name}", "model": "{model}", "figure": "sequences/s"},
        ),
        gpus=report(
            f"{REPORT}/extract/{{name}}.{{model}}/gpus.png",
            caption="../report/extraction_gpus.rst",
            category="5. Feature extraction",
            subcategory="{name}.{model}",
            labels={
                "input": "{name}",
                "model": "{model}",
                "figure": "GPU utilisation and memory",
            },
        ),
        records=report(
            f"{REPORT}/extract/{{name}}.{{model}}/records.html",
            caption="../report/extraction_records.rst",
            category="5. Feature extraction",
            subcategory="{name}.{model}",
            labels={
                "input": "{name}",
                "model": "{model}",
                "figure": "skipped and truncated records",
            },
        ),
    log:
        f"{LOGS}/report_extraction.{{name}}.{{model}}.log",
    wildcard_constraints:
        name=alternatives(EXTRACT_INPUTS),
        model=alternatives(EXTRACT_MODELS),
    conda:
        "../../envs/ampflow.yaml"
    params:
        out=lambda wc: f"{REPORT}/extract/{wc.name}.{wc.model}",
    shell:
        "ampflow report-extraction --progress {input.progress} --telemetry {input.telemetry}"
        " --records {input.records} --out-dir {params.out} --name {wildcards.name}.{wildcards.model} > {log} 2>&1"
