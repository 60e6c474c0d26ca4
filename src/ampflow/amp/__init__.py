"""AMP: profile the data and model, model a step's memory and time, decide the plan.

* :mod:`.profile`: shapes, strata and graph size read from the data folder's metadata
  (``profile.json``);
* :mod:`.memory`: what a training step holds at its peak: the shapes it is predicted from
  (:mod:`.memory.shapes`), the per-part terms (:mod:`.memory.terms`), the prediction
  (:mod:`.memory.predict`) and a CUDA device's overheads (:mod:`.memory.cuda`);
* :mod:`.cost`: what a step costs in time: the cost model (:mod:`.cost.model`) and its
  calibration on the training device (:mod:`.cost.calibrate`);
* :mod:`.decide`: the decisions: bottleneck signals (:mod:`.decide.signals`), the strategy
  registry (:mod:`.decide.strategies`), the CPU figures (:mod:`.decide.cpu`) and
  :func:`~.decide.diagnose.diagnose`, which makes the plan from the others.
"""
