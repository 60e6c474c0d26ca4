"""Torch-free contracts between the stages: what one stage writes and the next obeys.

* :mod:`.config`: the config sections ``model``, ``train`` and ``evaluate`` as dataclasses, with their
  defaults in one place;
* :mod:`.strategies`: the names of the parallel strategies (S1-S5);
* :mod:`.plan`: the typed :class:`~.plan.Plan` (``plan.json``), read and written only here,
  and its typed sections (:mod:`.plan_sections`);
* :mod:`.profile`: the typed :class:`~.profile.Profile` (``profile.json``), reading and
  writing it and the config it was made with;
* :mod:`.layout`: the data folder's files, the held-out split column and the Hi-C
  feature naming rule;
* :mod:`.allocation`: what a cluster offers and how the workflow sizes its jobs from the
  config and the plan;
* :mod:`.model_shapes` and :mod:`.attention_blocks`: the model's tensor shapes and the
  banded attention's blocks, which the model and the memory and cost models share.

Nothing here imports torch, or anything of ampflow but the foundation (:mod:`ampflow.base`), so the profile and the diagnosis stay
cheap, and every stage can import from here without a circle.
"""
