"""Real labelled cortex cells (Lee et al. 2019, snm3C-seq, chr1 at 1 Mb; see the README
of ../shared/data/schic/lee2019_pfc_chr1) through the Hi-C-only model with the template's
model and training settings: the latent of cells the model never trained on separates the
four cell types far above chance, and does not sort the cells by sequencing batch.

Referees: the published cell types (never seen by the model); the shuffled-label control
(the 95th percentile of the same clusters' ARI against 200 permuted labellings); the
BandNorm-style baseline fitted on the same training cells, printed beside (its comparison
over several splits is ``scripts/bench_science.py``'s, not a test's: at 35 held-out cells
one split's ARI moves by 0.1 with the split).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import load_script

from ampflow.evaluate.baselines import bandnorm_baseline
from ampflow.evaluate.clusters import kmeans_scores
from ampflow.io.h5ad import read_h5ad

pytestmark = pytest.mark.slow


def test_held_out_cortex_cells_keep_their_type_and_not_their_batch(shared_data, tmp_path):
    src = shared_data / "schic" / "lee2019_pfc_chr1"
    if not (src / "cells.tsv").is_file():
        pytest.skip(f"{src} not present")
    bench = load_script("bench_science")
    data_dir = bench.prepare(src, tmp_path / "lee", 1_000_000, 10)
    hic = read_h5ad(data_dir / "hic.h5ad")
    sheet = pd.read_csv(src / "cells.tsv", sep="\t").set_index("cell_id").loc[hic.obs_names]
    held = bench.holdout(hic.n_obs, 0)
    template = yaml.safe_load((bench.REPO / "config" / "config.yaml").read_text())
    train = {**template["train"], "threads": 2, "device": "cpu", "checkpoint_every": 100_000}
    z, seconds, steps, lines = bench.train_and_embed(data_dir, held, template["model"], train, tmp_path / "run")
    types = pd.Series(sheet["cell_type"].to_numpy()[held])
    latent = kmeans_scores(z[held], types, seed=0)
    batch = kmeans_scores(z[held], pd.Series(sheet["batch"].to_numpy()[held]), seed=0)
    base = kmeans_scores(bandnorm_baseline(hic, ~held)[0][held], types, seed=0)
    print(
        f"\nLee 2019, {held.sum()} held-out of {hic.n_obs} cells: latent k-means ARI {latent['ari']:.3f} "
        f"(shuffled 95th percentile {latent['ari_shuffled_p95']:.3f}; BandNorm baseline {base['ari']:.3f}), "
        f"ARI against batch {batch['ari']:.3f}; {steps} steps in {seconds:.0f} s; {' / '.join(lines)}"
    )
    assert latent["ari"] > 3 * latent["ari_shuffled_p95"]
    assert batch["ari"] <= 0.2
    assert any("restored" in ln for ln in lines), "early stopping keeps a best epoch"
    assert np.isfinite(z).all()
