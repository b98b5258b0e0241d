"""Studies: sweeps (an Optuna search over experiment configs) and ablations (a grid of cells, seeds included), run by
one engine (:func:`satlab.studies.engine.run_study`) from specs (:mod:`satlab.studies.spec`)."""
