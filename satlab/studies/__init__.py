"""Studies: sweeps (an Optuna search over experiment configs) and ablations (a grid of cells, seeds included) run by
one engine: an Optuna study in a storage that hosts can share, one child ``satlab train`` process per trial, an
MLflow parent run with a child per trial, and a report. Specs: :mod:`satlab.studies.spec`; running them:
:func:`satlab.studies.engine.run_study`."""
