"""What a satlab checkpoint carries besides the weights, and loading a model back from one.

Every Lightning checkpoint gets a ``satlab`` entry: the resolved config (YAML) and the tokenizer, so a checkpoint
alone is enough to evaluate or generate. Every file is scanned before it is loaded, and loaded with
``weights_only=True`` (:mod:`satlab.training.checkpoint_scan`).

A checkpoint is either one file (``torch.save``: DDP, one device) or a sharded directory (``train.strategy`` fsdp or
model_parallel): ``torch.distributed.checkpoint`` shards (``__<rank>_0.distcp``), their index ``.metadata`` (written
by rank 0 last, once every rank has written its shards) and Lightning's ``meta.pt`` with everything but the weights
and optimizer states (the step, loops, callbacks and the ``satlab`` entry). The weights sit under ``state_dict``
(model_parallel, FSDP2) or ``model`` (Lightning's FSDP). See docs/checkpoints.md.
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
from satlab.training.checkpoint_scan import (
    KEY,
    NotSatlabCheckpoint,
    cannot_read,
    inspect_checkpoint_file,
    inspect_shard_index,
    load_checkpoint_file,
)


def satlab_entry(cfg: ExperimentConfig, tokenizer: TextTokenizer) -> dict:
    return {"config": to_yaml(cfg), "tokenizer": tokenizer.to_dict()}


@dataclass
class LoadedCheckpoint:
    model: DecoderLM
    tokenizer: TextTokenizer
    cfg: ExperimentConfig
    step: int
    path: Path


SHARDED_META = "meta.pt"
"""Lightning's file of the non-tensor state in a sharded checkpoint directory (``_METADATA_FILENAME``)."""
SHARD_INDEX = ".metadata"
"""``torch.distributed.checkpoint``'s index of the shards, written last by the coordinating rank."""
SHARDED_BY = {"state_dict": "model_parallel", "model": "fsdp"}
"""Where a sharded checkpoint keeps the weights, and the ``train.strategy`` that writes (and can resume) it."""


def looks_sharded(path: Path) -> bool:
    """Whether ``path`` is a directory that a sharded save wrote into, complete or not."""
    return path.is_dir() and ((path / SHARDED_META).exists() or (path / SHARD_INDEX).exists()
                              or any(path.glob("*.distcp")))


def sharded_problem(path: Path) -> str | None:
    """None for a complete sharded checkpoint directory, else why it is not one. Complete means both files that
    come last are there: the shard index (after every rank wrote its shards) and ``meta.pt`` (after the index)."""
    missing = [name for name in (SHARD_INDEX, SHARDED_META) if not (path / name).is_file()]
    if missing:
        return (f"it is an incomplete sharded checkpoint (no {' and no '.join(missing)}; a save that was cut off "
                "leaves it so)")
    return None


def sharded_weights_key(path: Path) -> str:
    """The top-level key of the weights in a sharded checkpoint (see SHARDED_BY), once its index is read and every
    shard file it names is there and long enough (a removal or copy cut off midway leaves the index behind)."""
    from torch.distributed.checkpoint import FileSystemReader

    if problem := inspect_shard_index(path / SHARD_INDEX):  # before read_metadata unpickles it
        raise NotSatlabCheckpoint(problem)
    metadata = FileSystemReader(path).read_metadata()
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            raise ValueError(f"its shard {name} is " + ("missing" if size is None else f"cut short ({size} < {end} "
                                                                                        "bytes)"))
    tops = {data[0] for data in (metadata.planner_data or {}).values() if data}
    for key in SHARDED_BY:
        if key in tops:
            return key
    raise ValueError(f"its shards hold no model weights (top-level keys: {sorted(tops)})")


def read_checkpoint_meta(path: Path) -> dict:
    """Everything of a checkpoint but (for a sharded one) its weights and optimizer states: the step, the
    ``satlab`` entry, Lightning's loop and callback states. Raises NotSatlabCheckpoint for a file (or ``meta.pt``
    or shard index) that the scan refuses, before anything is unpickled; what torch raises on an unreadable one; and
    ValueError for an incomplete directory or one without model weights."""
    if path.is_dir():
        if problem := sharded_problem(path):
            raise ValueError(problem)
        if problem := inspect_checkpoint_file(path / SHARDED_META):  # before the shard index is unpickled
            raise NotSatlabCheckpoint(f"its {SHARDED_META} {problem.removeprefix('it ')}")
        sharded_weights_key(path)
        return load_checkpoint_file(path / SHARDED_META)
    state = load_checkpoint_file(path, mmap=True)
    if "state_dict" not in state:
        raise ValueError("it lacks the model state")
    return state


def load_sharded_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of a sharded checkpoint, read in this one process with no process group.
    Only the weights are read, not the optimizer states (twice their size)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    key = sharded_weights_key(path)  # scans the shard index, which _load_state_dict unpickles
    state: dict = {}
    # The planner builds the state dict from the index (no model needed) and `keys` keeps it to the weights; this
    # is torch's own dcp_to_torch_save (format_utils) minus the optimizer states. The public `load` only fills the
    # keys its state dict already has, hence the underscore, as in Lightning's _load_distributed_checkpoint.
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys={key}),
                     no_dist=True)
    return state[key]


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint file or sharded checkpoint directory, or a run directory (its ``checkpoints/last.ckpt``)."""
    path = Path(path)
    for candidate in (path, path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if candidate.is_file() or looks_sharded(candidate):
            return candidate
    raise ConfigError(f"no checkpoint at '{path}': give a .ckpt file, a sharded checkpoint directory or a run "
                      "directory such as runs/default (which holds checkpoints/last.ckpt)")


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """The model (eval mode), tokenizer and config saved in a satlab checkpoint, a file or a sharded directory."""
    path = resolve_checkpoint_path(path)
    try:
        state = read_checkpoint_meta(path)
        weights = load_sharded_weights(path) if path.is_dir() else state["state_dict"]
    except NotSatlabCheckpoint as error:
        raise ConfigError(cannot_read(path, error)) from None
    except Exception as error:  # truncated or corrupt files raise many different errors
        raise ConfigError(cannot_read(path, error)) from error
    if KEY not in state:
        raise ConfigError(f"'{path}' is not a satlab checkpoint (it has no '{KEY}' entry with config and tokenizer)")
    cfg = config_from_yaml(state[KEY]["config"])
    tokenizer = TextTokenizer.from_dict(state[KEY]["tokenizer"])
    model = build_model(cfg.model)
    weights = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    model.load_state_dict(weights)
    return LoadedCheckpoint(model.to(device).eval(), tokenizer, cfg, int(state.get("global_step", 0)), path)
