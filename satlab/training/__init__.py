"""Training: the LightningModule, data module, callbacks, MLflow logger and the run that ties them together."""
