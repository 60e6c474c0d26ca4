"""What the workflow's rules (``workflow/rules/*.smk``) call while Snakemake parses them:
the config's checks beyond its schema (:mod:`.inputs`), the command-line arguments of the
rules' shell commands (:mod:`.args`) and the run's folders and default target
(:mod:`.targets`). Snakemake-free, so each is tested as a function; the jobs' sizing
policy is the contract's (:class:`ampflow.contract.allocation.JobSizing`).
"""
