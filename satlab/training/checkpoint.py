"""What a satlab checkpoint carries besides the weights, and loading a model back from one.

Every Lightning checkpoint gets a ``satlab`` entry: the resolved config (YAML) and the tokenizer, so a checkpoint
alone is enough to evaluate or generate. It is loaded with ``weights_only=True``: only tensors and plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from satlab.config.display import config_from_yaml, to_yaml
from satlab.config.errors import ConfigError
from satlab.config.schema import ExperimentConfig
from satlab.data.tokenizer import TextTokenizer
from satlab.models import DecoderLM, build_model

KEY = "satlab"


def satlab_entry(cfg: ExperimentConfig, tokenizer: TextTokenizer) -> dict:
    return {"config": to_yaml(cfg), "tokenizer": tokenizer.to_dict()}


@dataclass
class LoadedCheckpoint:
    model: DecoderLM
    tokenizer: TextTokenizer
    cfg: ExperimentConfig
    step: int
    path: Path


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint file, or a run directory (its ``checkpoints/last.ckpt``)."""
    path = Path(path)
    for candidate in (path, path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no checkpoint at '{path}': give a .ckpt file or a run directory such as runs/default "
                      "(which holds checkpoints/last.ckpt)")


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """The model (eval mode), tokenizer and config saved in a satlab checkpoint."""
    path = resolve_checkpoint_path(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # truncated or corrupt files raise many different errors
        raise ConfigError(f"checkpoint '{path}' cannot be read ({type(error).__name__}: {error})") from error
    if KEY not in state:
        raise ConfigError(f"'{path}' is not a satlab checkpoint (it has no '{KEY}' entry with config and tokenizer)")
    cfg = config_from_yaml(state[KEY]["config"])
    tokenizer = TextTokenizer.from_dict(state[KEY]["tokenizer"])
    model = build_model(cfg.model)
    weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(weights)
    return LoadedCheckpoint(model.to(device).eval(), tokenizer, cfg, int(state.get("global_step", 0)), path)
