"""The registry is the one place an architecture is defined: one registered at run time (a toy, below) is at once
in `satlab archs`, config validation, the bench, the ablation report and the parity tests' conditions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import pytest
import torch
from torch import Tensor, nn

import satlab.config.archs
import satlab.models.archs
from satlab.cli.archs import archs_table
from satlab.config.archs import ARCH_SPECS, ArchSpec, declare
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.console import console
from satlab.models import ARCHITECTURES, Architecture, build_model, count_params, register
from satlab.models.parametrization import SCALAR
from satlab.models.streams import DepthContext, ResidualStream
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import spec_from_dict
from satlab.studies.runs import CELL_TAG, PARENT_TAG, create_parent_run


class ScaledResidual(ResidualStream):
    """x <- x + s·(block(x) - x): the residual branch scaled by a learned scalar (1 at the start)."""

    param_classes = {"scale": SCALAR}  # what model.parametrization derives its rules from (an undeclared one fails)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scale = nn.Parameter(torch.ones(()))

    def init_weights(self) -> None:
        nn.init.ones_(self.scale)

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        for i in range(len(ctx.blocks)):
            x = x + self.scale * (ctx.block(i, x) - x)
        return x


@pytest.fixture
def toy():
    """Declared (what it is) and registered (its depth loop), as the two modules of an architecture do."""
    declared, registered = dict(ARCH_SPECS), dict(ARCHITECTURES)
    declare(ArchSpec("toy", "Toy", "the residual branch times a learned scalar", extra_params=lambda cfg: 1,
                     exact_start={}))
    yield register("toy", stream=ScaledResidual)
    for registry, before in ((ARCH_SPECS, declared), (ARCHITECTURES, registered)):
        registry.clear()
        registry.update(before)


def test_every_declared_architecture_is_implemented_and_nothing_else_is() -> None:
    """An architecture is its declaration (satlab/config/archs/<name>.py, read without torch) and its implementation
    (satlab/models/archs/<name>.py), in the same order; an implementation of something not declared is refused."""
    assert list(ARCHITECTURES) == list(ARCH_SPECS)
    for name, arch in ARCHITECTURES.items():
        declared = {f.name: getattr(arch, f.name) for f in dataclasses.fields(ArchSpec)}
        assert isinstance(arch, Architecture) and ArchSpec(**declared) == ARCH_SPECS[name]

    def modules(package) -> set[str]:
        return {p.stem for p in Path(package.__file__).parent.glob("*.py")} - {"__init__"}

    assert modules(satlab.config.archs) == modules(satlab.models.archs)
    with pytest.raises(ConfigError, match="cannot implement architecture 'toy': it is not declared"):
        register("toy", stream=ScaledResidual)


def test_a_toy_registered_at_run_time_builds_validates_and_lists(toy):
    cfg = load_experiment("tiny/transformer", ["model.arch=toy"])
    model = build_model(cfg.model)
    reference = build_model(dict(arch="transformer"))
    assert count_params(model) == count_params(reference) + 1
    assert model.load_state_dict(reference.state_dict(), strict=False).missing_keys == ["stream.scale"]
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    assert torch.allclose(model(idx).logits, reference(idx).logits, atol=1e-6)  # its declared exact start
    with pytest.raises(ConfigError, match="did you mean 'toy'"):
        load_experiment("tiny/transformer", ["model.arch=toyy"])
    out = console()
    with out.capture() as captured:
        out.print(archs_table("tiny"))
    assert "toy" in captured.get()


def test_a_toy_is_benchmarked_next_to_the_transformer(toy, tmp_path):
    from satlab.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--archs", "transformer,toy", "--batch", "2", "--seq-len", "32", "--rounds", "2",
                 "--warmup", "1", "--max-rounds", "2", "--no-overhead", "--no-mlflow", "--out", str(out)]) == 0
    assert [r["arch"] for r in json.loads(out.read_text())["results"]] == ["transformer", "toy"]


def test_a_toy_appears_in_the_ablation_report_under_its_label(toy, tmp_path):
    from satlab.studies.ablation_report import write_report

    spec = spec_from_dict(AblationSpec, {"name": "toy", "base": "tiny/transformer", "out_dir": str(tmp_path / "out"),
                                         "axes": {"model.arch": ["transformer", "satformer", "toy"],
                                                  "train.seed": [0, 1]}})
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_parent_run(client, spec, str(tmp_path / "artifacts"))
    experiment = client.get_run(parent).info.experiment_id
    for cell in spec.cells():
        run = client.create_run(experiment, tags={PARENT_TAG: parent, CELL_TAG: cell.key})
        loss = {"transformer": 3.0, "satformer": 2.9, "toy": 3.5}[dict(cell.values)["model.arch"]] + 0.01 * cell.seed
        client.log_metric(run.info.run_id, "val/loss", loss, step=10)
        client.log_metric(run.info.run_id, "zero_shot/offline_retrieval_avg", 4 - loss, step=10)
        client.set_terminated(run.info.run_id)
    files = write_report(spec, client, parent)
    rows = {row[0]: row for row in json.loads(files["summary"].read_text())["table"][1:]}
    assert set(rows) == {"transformer (baseline)", "satformer", "toy"} and rows["toy"][3].startswith("3.5050")
    # the retrieval claim ranks every architecture with numbers, under the registry's labels
    assert "Ranking: SATFormer, Transformer, Toy." in Path(files["markdown"]).read_text()
