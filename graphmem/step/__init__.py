"""One training step as a value and its capture: ``spec`` (StepSpec, the step's description and
``make_spec``), ``measure`` (the only capture of a spec: graphmem/step/measure.py) and ``recapture``
(the same step captured again at another shape, depth or setting)."""
