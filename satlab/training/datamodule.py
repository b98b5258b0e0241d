"""The LightningDataModule: prepares the data once, then serves resumable training batches and fixed validation
windows."""

from __future__ import annotations

import json

import lightning as L
from torch.utils.data import DataLoader

from satlab.config.derived import Schedule
from satlab.config.schema import ExperimentConfig
from satlab.data import TrainBatches, ValidationWindows
from satlab.data.handoff import prepare_once
from satlab.data.mqar import MQARBatches, MQARHeldOut, MQARTask


class LMDataModule(L.LightningDataModule):
    """Tokenizes and packs the data at construction, so the model can be sized from the tokenizer before the Trainer
    exists: in a multi-process job one process prepares (global rank 0, or local rank 0 of each node with
    ``data.prepare_per_node``) and the others wait for its files (:func:`satlab.data.handoff.prepare_once`). A
    synthetic source (``synthetic:mqar``) has nothing to prepare: its task generates every batch from the seed.

    The training stream starts at ``global_step × tokens_per_step`` tokens: a resumed run continues exactly where the
    checkpoint was taken, whatever the number of workers.
    """

    def __init__(self, cfg: ExperimentConfig, progress: bool = True):
        super().__init__()
        self.cfg = cfg
        self.task = MQARTask(cfg.data.mqar, cfg.data.seq_len) if cfg.data.synthetic_task == "mqar" else None
        self.data = None if self.task is not None else prepare_once(cfg.data, progress=progress)
        self.schedule: Schedule | None = None
        self.start_token = 0

    @property
    def tokenizer(self):
        return self.task.tokenizer if self.task is not None else self.data.tokenizer

    def set_schedule(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def provenance(self) -> dict[str, str]:
        """Data facts for the run's params: source, tokenizer, token counts (and the Python version of pystdlib)."""
        if self.task is not None:
            return self.task.provenance()
        meta = self.data.meta
        facts = {"data.tokenizer_fingerprint": self.data.tokenizer.fingerprint,
                 "data.vocab_size_actual": self.data.vocab_size}
        for split, count in meta.get("tokens", {}).items():
            facts[f"data.tokens_{split}"] = count
        source = meta.get("source")
        if isinstance(source, dict):  # the source's identity (hashes, rules) is in the cache; the run shows its name
            facts["data.source"] = source.get("description") or source.get("name") or json.dumps(source)
        elif source is not None:
            facts["data.source"] = str(source)
        if "python_version" in meta:
            facts["data.python_version"] = str(meta["python_version"])
        for source, share in meta.get("mix", {}).get("share", {}).items():
            facts[f"data.mix_share_{source}"] = round(float(share), 5)
        return facts

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        self.start_token = trainer.global_step * self.schedule.tokens_per_step if trainer else 0
        if self.task is not None:
            batches = MQARBatches(self.task, self.cfg.train.micro_batch_size, self.cfg.train.seed,
                                  rank=trainer.global_rank if trainer else 0,
                                  world_size=trainer.world_size if trainer else 1, start_token=self.start_token)
            return DataLoader(batches, batch_size=None, num_workers=self.cfg.data.num_workers,
                              persistent_workers=self.cfg.data.num_workers > 0)
        batches = TrainBatches(
            self.data, self.cfg.data.seq_len, self.cfg.train.micro_batch_size, self.cfg.train.seed,
            rank=trainer.global_rank if trainer else 0, world_size=trainer.world_size if trainer else 1,
            start_token=self.start_token,
        )
        return DataLoader(batches, batch_size=None, num_workers=self.cfg.data.num_workers,
                          persistent_workers=self.cfg.data.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        if self.task is not None:
            windows = MQARHeldOut(self.task)
        else:
            windows = ValidationWindows(self.data, self.cfg.data.seq_len, self.cfg.train.val_tokens)
        return DataLoader(windows, batch_size=self.cfg.train.micro_batch_size, shuffle=False)

    def state_dict(self) -> dict:
        return {"start_token": self.start_token, "tokenizer": self.tokenizer.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        self.start_token = state.get("start_token", 0)
