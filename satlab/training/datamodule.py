"""The LightningDataModule: prepares the data once, then serves resumable training batches and fixed validation
windows."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from satlab.config.derived import Schedule
from satlab.config.schema import ExperimentConfig
from satlab.data import TrainBatches, ValidationWindows, prepare_data


class LMDataModule(L.LightningDataModule):
    """Tokenizes and packs the data at construction (rank 0 of a single process, or every rank reading the same
    content-hashed cache), so the model can be sized from the tokenizer before the Trainer exists.

    The training stream starts at ``global_step × tokens_per_step`` tokens: a resumed run continues exactly where the
    checkpoint was taken, whatever the number of workers.
    """

    def __init__(self, cfg: ExperimentConfig, progress: bool = True):
        super().__init__()
        self.cfg = cfg
        self.data = prepare_data(cfg.data, progress=progress)
        self.schedule: Schedule | None = None
        self.start_token = 0

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    @property
    def tokenizer(self):
        return self.data.tokenizer

    def set_schedule(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def provenance(self) -> dict[str, str]:
        """Data facts for the run's params: source, tokenizer, token counts (and the Python version of pystdlib)."""
        meta = self.data.meta
        facts = {"data.tokenizer_fingerprint": self.data.tokenizer.fingerprint,
                 "data.vocab_size_actual": self.data.vocab_size}
        for split, count in meta.get("tokens", {}).items():
            facts[f"data.tokens_{split}"] = count
        for key in ("source", "python_version"):
            if key in meta:
                facts[f"data.{key}"] = str(meta[key])
        for source, share in meta.get("mix", {}).get("share", {}).items():
            facts[f"data.mix_share_{source}"] = round(float(share), 5)
        return facts

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        self.start_token = trainer.global_step * self.schedule.tokens_per_step if trainer else 0
        batches = TrainBatches(
            self.data, self.cfg.data.seq_len, self.cfg.train.micro_batch_size, self.cfg.train.seed,
            rank=trainer.global_rank if trainer else 0, world_size=trainer.world_size if trainer else 1,
            start_token=self.start_token,
        )
        return DataLoader(batches, batch_size=None, num_workers=self.cfg.data.num_workers,
                          persistent_workers=self.cfg.data.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        windows = ValidationWindows(self.data, self.cfg.data.seq_len, self.cfg.train.val_tokens)
        return DataLoader(windows, batch_size=self.cfg.train.micro_batch_size, shuffle=False)

    def state_dict(self) -> dict:
        return {"start_token": self.start_token, "tokenizer": self.data.tokenizer.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        self.start_token = state.get("start_token", 0)
