"""README.md: every shell command meant to be run works as written on the demo.

The commands run once per session (fixture ``readme_run`` in conftest.py: ``make demo``
first, in a fresh copy of the repository); see ``readme_commands.py`` for the rules.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import REPO
from readme_commands import SHELL, parse_blocks, split_output

README = (REPO / "README.md").read_text()


def test_every_block_has_a_language_and_every_skip_a_reason():
    blocks = parse_blocks(README)
    assert blocks, "README has no code blocks"
    for b in blocks:
        assert b.language, f"README line {b.line}: give the code block a language (bash, text, yaml...)"
        if b.skip is not None:
            assert b.skip.strip(), f"README line {b.line}: say why the block is not run"
    runnable = "\n".join(b.text for b in blocks if b.runnable)
    # the commands the README promises to users
    for cmd in ("make demo", "source .venv/bin/activate", "--report results/demo/report.zip", "snakemake --unlock", "--forcerun", "--configfile"):
        assert cmd in runnable, f"no runnable README block contains {cmd!r}"
    skipped = [b for b in blocks if b.language in SHELL and b.skip]
    assert any("slurm-gpu" in b.text for b in skipped), "the SLURM commands are shown (and not run)"


@pytest.mark.parametrize("doc", ["README.md", "profiles/README.md"])
def test_recovery_block_cancels_this_folders_jobs_first(doc, tmp_path):
    """The SLURM recovery block, as written, against stand-in ``squeue`` and ``scancel``:
    it cancels the jobs whose working directory is this folder (a space in its name, a
    sibling with a longer name beside it), none of the user's others, waits until they
    have left the queue, and only then unlocks and runs again."""
    import os
    import subprocess

    block = next(b for b in parse_blocks((REPO / doc).read_text()) if b.language in SHELL and "scancel" in b.text)
    assert doc != "README.md" or block.skip, "the SLURM block is not run with the demo"
    lines = block.text.splitlines()
    first_snakemake = next(i for i, ln in enumerate(lines) if ln.startswith("snakemake"))
    assert "--unlock" in lines[first_snakemake] and "slurm-gpu" in lines[first_snakemake + 1]
    assert any("scancel" in ln for ln in lines[:first_snakemake])
    wf, sibling = tmp_path / "my wf", tmp_path / "my wf2"
    for d in (wf, sibling):
        d.mkdir()
    queue, cancelled, bin_ = tmp_path / "queue", tmp_path / "cancelled", tmp_path / "bin"
    queue.write_text(f"101 {wf}\n102 {sibling}\n103 {wf}\n104 /elsewhere\n")
    bin_.mkdir()
    # squeue: the queue as "%i %Z" lines, for --me only; scancel: records and removes ids
    (bin_ / "squeue").write_text(f'#!/bin/bash\n[[ " $* " == *" --me "* && " $* " == *" %i %Z "* ]] || exit 9\ncat "{queue}"\n')
    (bin_ / "scancel").write_text(
        f'#!/bin/bash\necho "$@" >> "{cancelled}"\nfor id in "$@"; do grep -v "^$id " "{queue}" > "{queue}.new" || true; '
        f'mv "{queue}.new" "{queue}"; done\n'
    )  # fmt: skip
    for f in ("squeue", "scancel"):
        (bin_ / f).chmod(0o755)
    script = "set -euo pipefail\n" + "\n".join(lines[:first_snakemake]) + "\necho unlocked-after\n"
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-c", script], cwd=wf, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert cancelled.read_text().split() == ["101", "103"]
    assert queue.read_text() == f"102 {sibling}\n104 /elsewhere\n"
    assert r.stdout.strip() == "unlocked-after"


def test_parse_blocks_markers():
    text = "a\n\n<!-- not run: needs SLURM -->\n```bash\nsbatch x\n```\n\n```text\nnot shell\n```\n```bash\necho hi\n```\n"
    blocks = parse_blocks(text)
    assert [(b.language, b.skip, b.runnable) for b in blocks] == [("bash", "needs SLURM", False), ("text", None, False), ("bash", None, True)]
    assert blocks[2].line == 11


@pytest.mark.slow
def test_readme_commands_run_as_written(readme_run):
    dest, proc, blocks = readme_run
    outputs = split_output(proc.stdout)
    failed = max(outputs, default=None)  # the block that was running when the script stopped
    assert proc.returncode == 0, f"README block at line {failed} failed:\n{outputs.get(failed, proc.stdout)[-6000:]}"
    ran = [b.line for b in blocks if b.runnable]
    assert sorted(outputs) == ran, "every runnable block ran"
    assert (dest / "results/demo/report.zip").is_file()
    assert (dest / "results/demo/report/report.html").is_file(), "the README's unzip command"
    assert (dest / "scratch/train/training.png").is_file()


@pytest.mark.slow
def test_make_demo_ends_with_the_summary(readme_run):
    dest, proc, blocks = readme_run
    demo = next(b for b in blocks if b.runnable and "make demo" in b.text)
    # without the shell's trace of the commands (set -x)
    out = [ln for ln in split_output(proc.stdout)[demo.line].rstrip().splitlines() if not ln.startswith("+ ")]
    # the last lines of `make demo`: the summary table, one line per configuration (the
    # workflow run printed it too, at its end)
    headers = [i for i, ln in enumerate(out) if re.match(r"configuration\s+ARI\s+NMI\s+FOSCTTM\s+strategies\s+mesh", ln)]
    assert len(headers) == 2, "printed by the workflow run (onsuccess) and at the end of make demo"
    header = headers[-1]
    end = out.index("", header)  # the plan table ends at a blank line; the scores by method follow
    rows = [ln.split() for ln in out[header + 2 : end]]
    assert [r[0] for r in rows] == ["500kb_s10", "250kb_s12"]
    by_method = "\n".join(out[end:])
    assert by_method.lstrip().startswith("Scores by method") and "held-out ARI" in by_method
    for method in ("joint latent", "RNA latent", "Hi-C latent", "RNA-only baseline", "Hi-C-only baseline", "shuffled pairing"):
        assert by_method.count(method) == 2, method  # once per configuration
    assert out[header - 1].startswith("Summary (results/demo/figures/summary.tsv)")
    for r in rows:
        ari, nmi, foscttm = map(float, r[1:4])
        assert 0 <= ari <= 1 and 0 <= nmi <= 1 and 0 <= foscttm <= 1
    # the light configuration: data parallel, its attention in one block (the fastest
    # that fits: no S3, no chunk); the heavy one shards (tp 2), also in one block
    assert re.search(r"\sS1\s+dp 2 x tp 1\s+-\s", out[header + 2]), out[header + 2]
    assert "S5" in out[header + 3] and "tp 2" in out[header + 3] and "S3" not in out[header + 3]
    assert "Report: results/demo/report.zip" in "\n".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", ["500kb_s10", "250kb_s12"])
def test_make_demo_scores_a_joint_that_beats_each_modality(readme_run, cfg):
    """The demo can fail. Two of its cell types differ only in expression and two only in
    chromatin, so each modality alone, perfectly clustered, scores ARI 5/7; the referees are
    the truth the demo was built with (the cell types) and chance for the control. On the
    held-out cells: the RNA and Hi-C latents between 0.4 and 0.8, the joint embedding at
    least 0.05 above both, and shuffled pairings at chance, 0.5 +- 3 / sqrt(12 n)."""
    dest = readme_run[0]
    scores = json.loads((dest / f"results/demo/eval/{cfg}/scores.json").read_text())
    held = scores["groups"]["heldout"]
    ari = {m: held["methods"][m]["ari"] for m in ("joint", "rna_latent", "hic_latent")}
    assert 0.4 <= ari["rna_latent"] <= 0.8 and 0.4 <= ari["hic_latent"] <= 0.8, ari
    control = held["shuffled_control"]["foscttm"]
    assert abs(control - 0.5) <= 3 / math.sqrt(12 * held["n_cells"]), (control, held["n_cells"])
    assert ari["joint"] >= max(ari["rna_latent"], ari["hic_latent"]) + 0.05, ari


@pytest.mark.slow
def test_new_cells_recipe_embeds_without_training(readme_run):
    """The README's new-cells recipe, as run on the demo: its dry run's job table lists
    embed jobs and no training (Snakemake's own table is the referee), and the run writes
    one row per new cell that passed the embed side's QC, for every configuration."""
    import anndata as ad
    import pandas as pd

    dest, proc, blocks = readme_run
    block = next(b for b in blocks if b.runnable and "config/new-cells.yaml" in b.text)
    out = split_output(proc.stdout)[block.line]
    dry = out[: out.index("snakemake --profile profiles/local --configfile config/demo.yaml config/new-cells.yaml\n")]
    table = re.search(r"Job stats:\n(.*?)\n\n", dry, re.S)
    assert table, dry[-3000:]
    jobs = {ln.split()[0] for ln in table.group(1).splitlines()[2:] if ln.strip() and not ln.startswith("total")}
    assert "train" not in jobs and "embed_cells" in jobs and all(j.startswith("embed") or j == "all" for j in jobs), jobs
    qc = pd.read_csv(dest / "results/demo/embed/cells/new/qc/cells.tsv", sep="\t", index_col="cell_id")
    sheet = pd.read_csv(dest / "resources/demo-new/five.tsv", sep="\t", index_col="cell_id")
    # the RNA file's other cells are reported and left out; of the 5, those passing QC embed
    assert len(sheet) == 5 and set(qc.index[qc["pass"]]) <= set(sheet.index) and qc["pass"].any()
    for cfg in ("500kb_s10", "250kb_s12"):
        emb = ad.read_h5ad(dest / f"results/demo/embed/{cfg}/new/embeddings.h5ad")
        assert list(emb.obs_names) == list(qc.index[qc["pass"]]), cfg
