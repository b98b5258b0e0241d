"""The experiment config: presets, layering, validation messages, the derived schedule and display helpers."""

from __future__ import annotations

import dataclasses
import io
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from satlab.config.derived import Schedule, derive_schedule
from satlab.config.display import config_from_yaml, flatten, print_config, to_yaml
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.config.model import ModelConfig, resolve_model_config
from satlab.config.resolve import default_experiments_dir, list_experiments
from satlab.config.schema import ExperimentConfig
from satlab.models import ARCHITECTURES, build_model


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


@pytest.mark.parametrize("name", list_experiments())
def test_every_preset_resolves_and_builds(name: str) -> None:
    cfg = load_experiment(name)
    assert cfg.model.d_model is not None and cfg.model.max_seq_len >= cfg.data.seq_len
    model = build_model(cfg.model, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert derive_schedule(cfg).max_steps >= 1


def test_default_and_tiny_presets() -> None:
    names = list_experiments()
    assert "default" in names
    assert {f"tiny/{arch}" for arch in list(ARCHITECTURES)} <= set(names)
    default = load_experiment()
    assert (default.model.arch, default.model.size, default.data.source) == ("satformer", "tiny", "shakespeare")
    assert (default.data.tokenizer.kind, default.data.tokenizer.vocab_size, default.data.seq_len) == ("bpe", 4096, 256)
    assert default.train.precision == "32-true"
    for arch in list(ARCHITECTURES):
        cfg = load_experiment(f"tiny/{arch}")
        assert cfg.model.arch == arch and cfg.name == f"tiny-{arch}"
        assert dataclasses.replace(cfg, name=default.name, description=default.description,
                                   model=dataclasses.replace(cfg.model, arch="satformer")) == default


def test_found_from_another_cwd_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_experiment("tiny/transformer").model.arch == "transformer"
    write(tmp_path / "mine" / "solo.yaml", "name: solo\n")
    monkeypatch.setenv("SATLAB_EXPERIMENTS_DIR", str(tmp_path / "mine"))
    assert default_experiments_dir() == tmp_path / "mine"
    assert list_experiments() == ["solo"]
    assert load_experiment("solo").name == "solo"


def test_yaml_typo_says_did_you_mean_and_where(tmp_path: Path) -> None:
    path = write(tmp_path / "typo.yaml", "base: default\noptim:\n  lrr: 1.0e-3\n")
    with pytest.raises(ConfigError) as excinfo:
        load_experiment(path)
    message = problems_of(excinfo)
    assert "unknown key 'optim.lrr'" in message and "did you mean 'lr'" in message and "typo.yaml" in message


def test_override_typo_says_did_you_mean_and_which() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_experiment("default", ["model.acrh=transformer"])
    message = problems_of(excinfo)
    assert "override 'model.acrh=transformer'" in message and "did you mean 'arch'" in message


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "base: default\ntrain:\n  micro_batch_size: lots\n  stratgy: ddp\n")
    overrides = [
        "optim.lr=-1",
        "train.precision=fp32",
        "data.seq_len=2048",
        "optim.betas=[0.9,1.5]",
        "model.arch=gpt",
        "data.tokenizer.kind=wordpiece",
        "train.max_tokens",
        "data.val_fraction=1.0",
    ]
    with pytest.raises(ConfigError) as excinfo:
        load_experiment(path, overrides)
    message = problems_of(excinfo)
    expected = [
        "bad.yaml: train.micro_batch_size",
        "expected int",
        "did you mean 'strategy'",
        "optim.lr must be in (0, 10]",
        "unknown train.precision 'fp32'; valid: 16-mixed, 32-true",
        "data.seq_len=2048 exceeds model.max_seq_len=1024",
        "optim.betas",
        "architecture (model.arch) 'gpt'",
        "data.tokenizer.kind 'wordpiece'",
        "malformed override 'train.max_tokens'",
        "data.val_fraction must be in [0, 0.999]",
        "train.global_batch_tokens=8192 is not a multiple",
    ]
    assert [e for e in expected if e not in message] == []
    assert len(excinfo.value.problems) >= len(expected) - 1


def test_precedence_override_preset_base_defaults(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "optim:\n  lr: 1.0e-3\ntrain:\n  seed: 1\n  max_time_minutes: 5\n")
    write(tmp_path / "group" / "child.yaml", "base: ../base\noptim:\n  lr: 2.0e-3\ntrain:\n  seed: 2\n")
    write(tmp_path / "grandchild.yaml", "base: group/child\ntrain:\n  seed: 3\n")
    cfg = load_experiment("grandchild", ["train.seed=4", "optim.warmup_tokens=1e4"], experiments_dir=tmp_path)
    defaults = ExperimentConfig()
    assert cfg.train.seed == 4  # override > preset
    assert cfg.optim.lr == 2e-3  # nearer preset > its base
    assert cfg.train.max_time_minutes == 5  # base > defaults
    assert cfg.train.max_tokens == defaults.train.max_tokens
    assert cfg.optim.warmup_tokens == 10_000 and isinstance(cfg.optim.warmup_tokens, int)


def test_whole_number_strings_and_floats_become_ints() -> None:
    cfg = load_experiment(overrides=["train.max_tokens=1e6", "train.val_tokens='3.2768e4'"])
    assert cfg.train.max_tokens == 1_000_000 and cfg.train.val_tokens == 32_768
    with pytest.raises(ConfigError, match="train.max_tokens"):
        load_experiment(overrides=["train.max_tokens=1.5e0"])


UNDECLARED = {
    # the settings that declare no range or choices on their field, and why
    "name": "a run name: the loader checks its characters (RUN_NAME)",
    "description": "free text",
    "data.source": "a corpus name, file, folder, glob or hub dataset: the data layer resolves it",
    "data.text_field": "free text: the field of a row that holds its text",
    "data.hub_config": "free text: a hub dataset's configuration name",
    "data.hub_split": "free text: a hub dataset's split name",
    "data.cache_dir": "a path",
    "data.mix": "shares by synthetic source: mix_problems checks the names and the shares",
    "data.tokenizer.name": "free text: a hub tokenizer's name",
    "data.mqar.layout": "checked by MQARConfig.problems, for a synthetic:mqar source only",
    "data.mqar.stop_at_acc": "checked by MQARConfig.problems, for a synthetic:mqar source only",
    "optim.betas": "a pair: the loader checks that both are in [0, 1)",
    "train.out_dir": "a path",
    "eval.tasks": "lm-eval task and group names: an open set, which lm-eval resolves",
    "tracking.uri": "a tracking URI: the tracking layer checks it",
    "tracking.artifact_dir": "a path",
    "tracking.experiment": "free text: an MLflow experiment name",
    "tracking.run_name": "free text: the name the MLflow UI shows",
    "tracking.tags": "free text: extra MLflow run tags",
    "model.satformer.last_k": "checked against model.n_layers by SATFormerOptions.problems",
}


def settings(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """Every leaf setting of a config dataclass, sections (the model's architecture options too) walked into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from settings(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name], f


def leaf_types(hint: Any) -> set[Any]:
    """The plain types a hint is made of: ``{int, NoneType}`` for ``int | None``, ``{str, float}`` for
    ``dict[str, float]``."""
    args = typing.get_args(hint)
    return set().union(*map(leaf_types, args)) if args else {hint}


def test_every_setting_declares_its_range_or_choices() -> None:
    """A number declares its range, a text its choices (field metadata, see satlab.config.structured.field_problems),
    so a new setting cannot be added without them; the exceptions are listed above, each with its reason."""
    undeclared = [key for key, hint, f in settings(ExperimentConfig)
                  if leaf_types(hint) & {int, float, str} and not {"range", "choices"} & set(f.metadata)]
    assert [key for key in undeclared if key not in UNDECLARED] == [], "declare a range or choices on the field"
    assert [key for key in UNDECLARED if key not in undeclared] == [], "no longer an exception: remove from UNDECLARED"


def test_a_size_must_be_an_integer() -> None:
    with pytest.raises(ConfigError, match=re.escape("model.d_model must be an integer in [1, 65,536], got 128.0")):
        resolve_model_config(dataclasses.replace(ModelConfig(), d_model=128.0))


def test_cycle_is_detected(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "base: b\n")
    write(tmp_path / "b.yaml", "base: ./a\n")
    with pytest.raises(ConfigError, match="cycle in 'base:' chain: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_experiment("a", experiments_dir=tmp_path)


def test_unknown_preset_lists_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_experiment("defualt")
    message = str(excinfo.value)
    assert "did you mean 'default'" in message and "recall/mqar" in message and "tiny/<arch>" in message
    assert "paper/small/<arch>" in message and "muddformer" in message and len(message) < 1000  # generated, as folders
    with pytest.raises(ConfigError) as excinfo:  # in a folder of generated presets: that folder's (test_presets)
        load_experiment("tiny/transfomer")
    assert "did you mean 'tiny/transformer'" in str(excinfo.value) and "tiny/muddformer" in str(excinfo.value)
    write(tmp_path / "child.yaml", "base: nowhere\n")
    with pytest.raises(ConfigError, match="unknown preset 'nowhere'"):
        load_experiment("child", experiments_dir=tmp_path)


def small_config(**train: int) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.data.seq_len = 256
    budgets = dict(max_tokens=10_000_000, global_batch_tokens=65_536, micro_batch_size=16, val_every_tokens=1_000_000,
                   ckpt_every_tokens=20_000_000, val_tokens=65_536)
    cfg.train = dataclasses.replace(cfg.train, **{**budgets, **train})
    return cfg


def test_derived_schedule_worked_example() -> None:
    cfg = small_config()
    assert derive_schedule(cfg, world_size=2) == Schedule(
        tokens_per_step=65_536,
        micro_batch_tokens=4096,  # 16 sequences of 256 tokens
        grad_accum_steps=8,  # 65536 / (4096 * 2 ranks)
        max_steps=152,  # 10_000_000 // 65_536 = 152.59
        warmup_steps=2,  # round(0.01 * 152)
        val_every_steps=15,  # 1_000_000 // 65_536
        ckpt_every_steps=150,  # 305 capped at max_steps 152, then the nearest multiple of val_every_steps
        val_batches=16,  # 65_536 // 4096
        eval_every_steps=None,
    )
    assert list(derive_schedule(cfg, world_size=2).as_dict())[:3] == ["tokens_per_step", "micro_batch_tokens",
                                                                      "grad_accum_steps"]
    cfg.optim.warmup_tokens = 300_000
    cfg.eval.every_tokens = 2_000_000
    schedule = derive_schedule(cfg, world_size=1)
    assert (schedule.grad_accum_steps, schedule.warmup_steps, schedule.eval_every_steps) == (16, 5, 30)
    tiny_budget = derive_schedule(small_config(max_tokens=1000))
    assert (tiny_budget.max_steps, tiny_budget.val_every_steps, tiny_budget.warmup_steps) == (1, 1, 0)


@pytest.mark.parametrize(("val_every", "eval_every", "due"), [
    (976, 2441, [2928, 5856, 7808]),  # eval.every_tokens not a multiple of val_every_tokens: the next validation
    (100, 200, [200, 400, 600, 800]),
    (300, 100, [300, 600, 900]),  # evaluations asked more often than validations: at every validation
])
def test_periodic_evaluation_runs_at_the_first_validation_past_each_boundary(val_every, eval_every, due) -> None:
    schedule = dataclasses.replace(derive_schedule(small_config()), val_every_steps=val_every,
                                   eval_every_steps=eval_every)
    validations = range(val_every, 9000 if eval_every > 1000 else 1000, val_every)
    assert [step for step in validations if schedule.eval_due(step)] == due
    assert not dataclasses.replace(schedule, eval_every_steps=None).eval_due(val_every)


def test_derived_schedule_rejects_a_non_divisible_global_batch() -> None:
    with pytest.raises(ConfigError, match="not a multiple of .* = 16\\*256\\*3 = 12288"):
        derive_schedule(small_config(), world_size=3)
    with pytest.raises(ConfigError, match="nearest valid: 8192 or 16384"):
        load_experiment(overrides=["train.global_batch_tokens=10000"])


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_experiment("tiny/hyperconnections", ["optim.betas=[0.8,0.99]", "eval.every_tokens=100000"])
    text = to_yaml(cfg)
    assert config_from_yaml(text) == cfg
    saved = write(tmp_path / "run" / "config.yaml", text)
    assert config_from_yaml(saved) == cfg and config_from_yaml(str(saved)) == cfg
    with pytest.raises(ConfigError, match="did you mean 'seed'"):
        config_from_yaml(text.replace("seed:", "sed:"))


def test_flatten_gives_dotted_scalar_params() -> None:
    flat = flatten(load_experiment())
    assert flat["model.arch"] == "satformer" and flat["model.d_model"] == 128
    assert flat["data.tokenizer.vocab_size"] == 4096 and flat["optim.betas"] == "[0.9, 0.95]"
    assert flat["tracking.uri"] == "null" and flat["train.compile"] is False
    assert all(isinstance(v, str | int | float | bool) for v in flat.values())
    assert load_experiment(overrides=[f"{k}={v}" for k, v in flat.items() if k.startswith("optim.")]).optim == (
        load_experiment().optim
    )


def test_print_config_renders_the_yaml() -> None:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    print_config(load_experiment("tiny/muddformer"), console=console)
    out = console.file.getvalue()
    assert "tiny-muddformer" in out and "arch: muddformer" in out and "global_batch_tokens: 8192" in out


HEAVY = ("torch", "lightning", "mlflow", "optuna", "datasets", "lm_eval", "pandas", "scipy")


@pytest.mark.process
def test_help_and_a_checked_config_import_no_framework() -> None:
    """`satlab --help` builds every command's arguments, and a preset is loaded, checked and printed, without
    importing torch, Lightning, MLflow, Optuna or the data and evaluation libraries (importing Lightning alone
    takes about ten seconds): the configuration sits below the model zoo."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from satlab.cli.main import build_parser\n"
            "from satlab.config.loader import load_experiment\n"
            "from satlab.config.display import print_config\n"
            "from satlab.studies.loader import load_ablation, load_sweep\n"
            "build_parser().parse_args(['train', 'model.arch=mhc'])\n"
            "print_config(load_experiment('paper/small/satformer', ['model.satformer.gate_fn=sigmoid']))\n"
            "load_ablation('arch_tiny'); load_sweep('lr_tiny')\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY []"
