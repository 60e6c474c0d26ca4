"""Figures and tables for the Snakemake report (``snakemake --report results/{dataset}/report.zip``).

One module per figure family, each a set of functions that read the workflow's own
outputs and write a PNG or a self-contained HTML page:

* :mod:`.qc`: contacts per cell, cis fraction, contact-distance decay P(s) per cell
  type, RNA UMIs and genes per cell, the cells that failed and why;
* :mod:`.plan`: one configuration's AMP plan as a page, and per-stratum memory,
  predicted against measured, per rank;
* :mod:`.training`: loss terms and cells/s per step, per stage;
* :mod:`.summary`: scores and plans of every configuration in one table and figure;
* :mod:`.extraction`: throughput, per-GPU utilisation and memory timelines and the
  skipped/truncated records of the FASTA feature extraction.

The ``ampflow report-*`` commands are thin wrappers over these; captions live in
``workflow/report/*.rst``.
"""
