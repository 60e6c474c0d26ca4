"""Commands that train a configuration, evaluate its embeddings and embed cells with it."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("ampflow")


def cmd_train(a):
    from ..contract.config import ModelConfig, TrainConfig
    from ..contract.plan import Plan
    from ..train.launch import run_training

    model_cfg = ModelConfig.from_dict(json.loads(a.model) if a.model else {})
    train_cfg = TrainConfig.from_dict(json.loads(a.train) if a.train else {})
    plan = Plan.read(a.plan) if a.plan else None
    relaunch = [x for x in a.argv if x != "--launch"] if a.launch else None
    return run_training(a.data, a.out, model_cfg, train_cfg, plan, name=a.name, relaunch_argv=relaunch, split=a.split)


def cmd_evaluate(a):
    from ..evaluate.run import main_evaluate

    scores = main_evaluate(a.embeddings, a.out_dir, label_key=a.label_key, seed=a.seed, data=a.data, batch_key=a.batch_key or None)
    log.info("scores: %s", json.dumps(scores, sort_keys=True))


def cmd_embed(a):
    from ..evaluate.embed import embed_cells, embed_paths

    rna, hic = embed_paths(a.data, a.rna, a.hic)
    report = embed_cells(a.model, rna, hic, a.out, batch_size=a.batch_size, device=a.device, threads=a.threads)
    log.info("embedded: %s", json.dumps(report, sort_keys=True))


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
    s = sub.add_parser("train", help="train the paired model on one configuration's data folder")
    s.add_argument("--data", required=True, help="data/{cfg} folder: rna.h5ad, hic.h5ad, graph/")
    s.add_argument("--out", required=True, help="train/{cfg} folder")
    s.add_argument("--name", default="", help="configuration name recorded in the outputs")
    s.add_argument("--model", default="", help="model settings as JSON (config section 'model')")
    s.add_argument("--train", default="", help="training settings as JSON (config section 'train')")
    s.add_argument(
        "--plan", default=None, help="plan.json from `ampflow diagnose`: its chunk size and key-first decode apply in any world; its mesh under torchrun"
    )
    s.add_argument(
        "--launch", action="store_true",
        help="for a plan of more than one process (dp x tp > 1) start the plan's world of processes with torchrun; "
        "without it (or under torchrun) train in this process",
    )  # fmt: skip
    s.add_argument("--split", default=None, help="qc/split.tsv: its held-out cells are not trained on (the data files' obs['split'] must agree)")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser(
        "evaluate",
        help="score embeddings (Leiden ARI/NMI of each latent and of RNA-only and Hi-C-only baselines, "
        "FOSCTTM and a shuffled-pairing control; held-out and training cells apart) and plot a UMAP",
    )
    s.add_argument("--embeddings", required=True)
    s.add_argument("--data", default=None, help="data/{cfg} folder (rna.h5ad, hic.h5ad) for the baselines; without it they are left out")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--label-key", default="cell_type")
    s.add_argument("--batch-key", default="batch", help="obs column with the cells' batches, scored against the k-means clusters too ('' for none)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser(
        "embed",
        help="encode cells (new ones included) with a trained model.pt, without retraining: genes and Hi-C features "
        "are mapped onto the model's by name (missing ones are zeros, extra ones dropped; both reported)",
    )
    s.add_argument("--model", required=True, help="model.pt from `ampflow train`")
    s.add_argument("--data", default=None, help="a data folder holding rna.h5ad and hic.h5ad (hic.h5ad alone for a Hi-C-only model)")
    s.add_argument("--rna", default=None, help="rna.h5ad to embed (instead of the data folder's); not needed by a Hi-C-only model")
    s.add_argument("--hic", default=None, help="hic.h5ad to embed (instead of the data folder's)")
    s.add_argument("--out", required=True, help="embeddings.h5ad to write (obsm X_rna, X_hic, X_joint; a Hi-C-only model: X_hic, X_joint)")
    s.add_argument(
        "--batch-size", type=int, default=1024,
        help="rows of every forward pass, a smaller last batch padded with empty cells (training's 1024: its vectors bit for bit)",
    )  # fmt: skip
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the count the model trained with)")
    s.set_defaults(func=cmd_embed)
