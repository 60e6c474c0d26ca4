"""Torch-free contracts between the stages: what one stage writes and the next obeys.

* :mod:`.config`: the config sections ``model``, ``train`` and ``evaluate`` as dataclasses, with their
  defaults in one place;
* :mod:`.strategies`: the names of the parallel strategies (S1-S5);
* :mod:`.plan`: the typed :class:`~.plan.Plan` (``plan.json``), read and written only here;
* :mod:`.profile`: reading and writing ``profile.json`` and the config it was made with;
* :mod:`.layout`: the data folder's files, the held-out split column and the Hi-C
  feature naming rule.

Nothing here imports torch, or anything of ampflow but the foundation (:mod:`ampflow.base`), so the profile and the diagnosis stay
cheap, and every stage can import from here without a circle.
"""
