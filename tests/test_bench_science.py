"""The science benchmark's figure: what it draws is the rows' numbers, per dataset, with
the shuffled-label percentiles as the chance band."""

from __future__ import annotations

from conftest import load_script
from PIL import Image

ROWS = [
    {"dataset": "lee", "split": 0, "method": "bandnorm", "heldout_ari": 0.5, "all_ari": 0.6, "heldout_shuffled_p95": 0.05, "all_shuffled_p95": 0.02},
    {"dataset": "lee", "split": 1, "method": "bandnorm", "heldout_ari": 0.7, "all_ari": 0.4, "heldout_shuffled_p95": 0.07, "all_shuffled_p95": 0.03},
    {
        "dataset": "lee",
        "split": 0,
        "method": "bandnorm_shuffled_labels",
        "heldout_ari": 0.0,
        "all_ari": 0.0,
        "heldout_shuffled_p95": 0.05,
        "all_shuffled_p95": 0.02,
    },
    {
        "dataset": "lee",
        "split": 0,
        "train_seed": 0,
        "method": "model",
        "heldout_ari": 0.8,
        "all_ari": 0.5,
        "heldout_shuffled_p95": 0.06,
        "all_shuffled_p95": 0.02,
    },
    {"dataset": "lobo", "batch": "b1", "ari": 0.6, "shuffled_p95": 0.05, "bandnorm_on_batch": 0.5},
    {"dataset": "hires", "group": "heldout", "method": "rna_latent", "ari": 0.7, "shuffled_p95": 0.04, "leiden_ari": 0.7},
    {"dataset": "hires", "group": "train", "method": "rna_latent", "ari": 0.9, "shuffled_p95": 0.03, "leiden_ari": 0.9},
    {"dataset": "hires", "method": "negative_control", "passed": True},
]


def test_figure_draws_each_datasets_runs_and_chance(tmp_path):
    bench = load_script("bench_science")
    panels = {title: (dict(bars), chance) for title, bars, chance in bench.figure_bars(ROWS)}
    assert list(panels) == ["Lee 2019, held-out cells", "Lee 2019, all cells", "Lee 2019, each batch new to the model", "HiRES brain RNA, held-out cells"]
    bars, chance = panels["Lee 2019, held-out cells"]
    assert bars == {"bandnorm": [0.5, 0.7], "model": [0.8]} and max(chance) == 0.07
    assert panels["Lee 2019, all cells"][0]["bandnorm"] == [0.6, 0.4]
    assert panels["HiRES brain RNA, held-out cells"][0] == {"rna_latent": [0.7]}  # training cells are not drawn
    bench.write_figure(ROWS, tmp_path / "f.png")
    assert Image.open(tmp_path / "f.png").size[0] > 4 * Image.open(tmp_path / "f.png").size[1] / 2
