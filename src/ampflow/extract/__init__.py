"""Protein / DNA language-model features: FASTA -> chunks -> GPU worker pool -> h5ad.

``chunks`` splits and cleans the input, ``pool`` and ``worker`` run one model per GPU
(or N CPU workers) over the chunks, ``markers`` makes every chunk resumable, ``models``
and ``dnabert`` load ESM-2 and DNABERT-S, ``merge`` writes the AnnData, ``telemetry``
samples the GPUs, ``run.extract_fasta`` ties one job together.
"""
