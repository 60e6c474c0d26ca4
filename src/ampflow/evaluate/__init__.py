"""Evaluation of trained latents: how well the modalities align and how well cell types separate.

* :mod:`.foscttm`: FOSCTTM between the paired RNA and Hi-C latents;
* :mod:`.clusters`: checks on the trainer's ``embeddings.h5ad`` and Leiden ARI/NMI of
  the joint latent against cell labels;
* :mod:`.groups`: held-out and training cells scored apart (``obs["split"]``);
* :mod:`.controls`: the shuffled-pairing control of FOSCTTM;
* :mod:`.baselines`: RNA-only and Hi-C-only PCA baselines from the data folder;
* :mod:`.spread`: how many dimensions a latent spreads cells over;
* :mod:`.scores`: every latent and baseline scored per group, and the headline;
* :mod:`.umap`: the three-panel UMAP figure;
* :mod:`.run`: :func:`~.run.main_evaluate`, which scores one file and writes
  ``scores.json`` and ``umap.png`` (``ampflow evaluate``).

Nothing is imported here, so that ``import ampflow.evaluate.foscttm`` does not pull
in scanpy or matplotlib.
"""
