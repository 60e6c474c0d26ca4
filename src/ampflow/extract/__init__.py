"""Protein / DNA language-model features: FASTA -> items -> one queue -> worker pool -> h5ad.

``chunks`` cleans each input into records and items (whole records or windows) and writes
the queue of what the cache lacks, ``pool`` and ``worker`` run one model per GPU (or N CPU
workers) over the chunks, ``batching`` plans batches per device and splits those that run
out of memory, ``cache`` stores every vector by sequence and model (the resume and the
reuse across files), ``markers`` rebuilds the progress from the shards' markers,
``weights``, ``models``, ``dnabert`` and ``esmc`` load ESM-2, DNABERT-S and ESM C,
``merge`` writes each input's AnnData, ``telemetry`` samples the GPUs, ``run`` ties one
model's job together.
"""
