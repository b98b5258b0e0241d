"""Gate analysis: statistics on hand-set gates, token categories, plots for every architecture and MLflow logging."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from satlab.data.tokenizer import byte_tokenizer
from satlab.evaluation.gate_logging import log_gate_analysis
from satlab.evaluation.gates import analyze_gates, gate_bounds, occurrence_labels, position_bucket, token_kind
from satlab.evaluation.plots import gate_figures, plot_value_access, save_figures, value_access
from satlab.models import ARCHITECTURES, build_model

SMALL = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=64, vocab_size=258, max_seq_len=128)
TEXT = "The cat sat on the mat, and the dog sat on the log. Then they sat together!"


def make(arch: str = "satformer", **satformer):
    torch.manual_seed(0)
    return build_model({**SMALL, "arch": arch, "satformer": satformer})


def batch() -> torch.Tensor:
    return torch.tensor([byte_tokenizer().encode(TEXT)])


def gate(model, layer: int):
    return model.blocks[layer].attn.value_path


def test_zero_relu_layer_is_dead_and_saturated_at_zero():
    model = make()
    torch.nn.init.zeros_(gate(model, 1).proj.weight)
    report = analyze_gates(model, batch(), byte_tokenizer())
    assert report.layers == [1, 2] and report.heads == 2 and report.channels == 1
    assert report.bounds == (0.0,)
    np.testing.assert_array_equal(report.sparsity[0], [1.0, 1.0])
    assert report.dead[0].all() and report.saturated_at[0] == [0.0, 0.0]
    assert not report.dead[1].any() and report.sparsity[1].max() < 0.99
    scalars = report.scalars()
    assert scalars["val/gates/dead_heads"] == 2 and scalars["val/gates/dead_head_frac"] == 0.5
    assert scalars["val/gates/saturated_frac"] == 0.5 and report.layer_means()[0] == 0.0
    assert not any("layer" in key for key in scalars)  # per layer: the heatmap and gates/layer_means.png
    assert all(re.fullmatch(r"[A-Za-z0-9_/. -]+", key) for key in scalars)


def test_sigmoid_with_large_bias_saturates_at_one():
    model = make(gate_fn="sigmoid", gate_bias=20.0)
    for layer in (1, 2):
        torch.nn.init.zeros_(gate(model, layer).proj.weight)
    report = analyze_gates(model, batch())
    assert report.saturated.all() and report.saturated_at == [[1.0, 1.0], [1.0, 1.0]]
    np.testing.assert_allclose(report.mean, 1.0, atol=1e-6)
    scalars = report.scalars()
    assert scalars["val/gates/saturated_frac"] == 1.0 and scalars["val/gates/sparsity"] == 0.0
    assert scalars["val/gates/dead_heads"] == 0


def test_tanh_saturates_at_minus_one_and_identity_never():
    model = make(gate_fn="tanh", gate_bias=-20.0)
    for layer in (1, 2):
        torch.nn.init.zeros_(gate(model, layer).proj.weight)
    assert analyze_gates(model, batch()).saturated_at == [[-1.0, -1.0], [-1.0, -1.0]]
    report = analyze_gates(make(gate_fn="identity"), batch())
    assert report.bounds == () and not report.saturated.any()
    assert gate_bounds("softmax", 4) == (0.0, 4.0) and gate_bounds("softmax_sigmoid", 1) == (0.0, 1.0)


def test_static_head_gates():
    model = make(gate_granularity="static_head")
    with torch.no_grad():
        gate(model, 1).static.copy_(torch.tensor([[0.0], [0.7]]))
    report = analyze_gates(model, batch())
    np.testing.assert_allclose(report.mean[0], [0.0, 0.7], atol=1e-6)
    np.testing.assert_array_equal(report.sparsity[0], [1.0, 0.0])
    assert report.dead[0].tolist() == [True, False] and report.saturated_at[0] == [0.0, None]
    np.testing.assert_allclose(report.mean[1], [0.5, 0.5], atol=1e-6)  # static_init
    assert report.granularity == "static_head"


def test_token_channel_averages_channels_and_counts_sparsity_over_elements():
    model = make(gate_granularity="token_channel", gate_bias=0.0)
    proj = gate(model, 1).proj
    channels = SMALL["d_model"] // SMALL["n_heads"]
    with torch.no_grad():
        proj.weight.zero_()
        proj.bias.copy_(torch.tensor([1.0, -1.0]).repeat_interleave(channels // 2).repeat(2))
    report = analyze_gates(model, batch())
    assert report.channels == channels
    np.testing.assert_allclose(report.mean[0], [0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(report.sparsity[0], [0.5, 0.5])
    assert not report.dead[0].any() and not report.saturated[0].any()


def test_categories_on_a_crafted_sequence():
    tokenizer = byte_tokenizer()
    idx = torch.tensor([tokenizer.encode("ab, ab"), tokenizer.encode("xy? yy")])
    assert occurrence_labels(idx)[0].tolist() == ["first", "first", "first", "first", "repeated", "repeated"]
    assert occurrence_labels(idx)[1].tolist() == ["first", "first", "first", "first", "repeated", "repeated"]
    report = analyze_gates(make(), idx, tokenizer)
    occurrence, kind = report.categories["occurrence"], report.categories["kind"]
    assert dict(zip(occurrence.values, occurrence.counts, strict=True)) == {"first": 8, "repeated": 4}
    assert dict(zip(kind.values, kind.counts, strict=True)) == {"word": 8, "punct": 2, "space": 2}
    assert occurrence.layer_means.shape == (2, len(report.layers))
    assert "kind" not in analyze_gates(make(), idx).categories  # no tokenizer, no token kinds


def test_token_kind():
    assert token_kind(" the", False) == "word" and token_kind("42", False) == "word"
    assert token_kind(" ", False) == "space" and token_kind("\n", False) == "space"
    assert token_kind(", ", False) == "punct" and token_kind("\ufffd", False) == "other"
    assert token_kind("<|endoftext|>", True) == "other"


def test_position_buckets_cover_all_positions():
    assert [position_bucket(t) for t in (0, 1, 2, 3, 4, 7, 8, 100)] == ["0", "1", "2-3", "2-3", "4-7", "4-7",
                                                                        "8-15", "64-127"]
    idx = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    position = analyze_gates(make(), idx).categories["position"]
    assert position.values == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63"]
    assert position.counts == [3, 3, 6, 12, 24, 48, 24] and sum(position.counts) == idx.numel()


def test_no_gates_gives_none_and_training_mode_is_restored():
    assert analyze_gates(make("transformer"), batch()) is None
    assert analyze_gates(make("resformer"), batch()) is None
    model = make().train()
    analyze_gates(model, batch()[0])  # a single row (T,) works too
    assert model.training
    assert all(p.grad is None for p in model.parameters())


def test_json_round_trips():
    report = analyze_gates(make(), batch(), byte_tokenizer())
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["gate_fn"] == "relu" and data["granularity"] == "token_head" and data["layers"] == [1, 2]
    assert np.array(data["mean"]).shape == (2, 2) and set(data["categories"]) == {"occurrence", "kind", "position"}


EXPECTED_FIGURES = {  # written from each architecture's definition (docs/architectures.md), not from the registry
    "transformer": set(),
    "resformer": {"value_access", "mixing/resformer"},  # static weights on V_1
    "satformer": {"heatmap", "categories", "value_access"},  # gates on V_1
    "denseformer": {"mixing/denseformer"},
    "hyperconnections": {"mixing/hyperconnections"},
    "muddformer": {"mixing/muddformer"},
    "mhc": {"mixing/mhc"},
    "attnres": {"mixing/attnres"},
    "block_attnres": {"mixing/block_attnres"},
    "value_embed": {"heatmap", "categories"},  # gates on a value embedding, not on V_1: no value-access curve
}


def test_every_registered_architecture_has_its_expected_figures_written_down():
    assert set(EXPECTED_FIGURES) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_figures_for_every_architecture(arch, tmp_path):
    model = make(arch)
    figures = gate_figures(analyze_gates(model, batch(), byte_tokenizer()), model)
    assert set(figures) == EXPECTED_FIGURES[arch]
    for path in save_figures(figures, tmp_path, dpi=40):
        image = plt.imread(path)  # a PNG that decodes to a drawn figure, not a blank canvas
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 2, path.name


def test_value_access_compares_static_and_dynamic():
    sat, res = make(), make("resformer")
    curves = {"satformer": value_access(sat, analyze_gates(sat, batch())), "resformer": value_access(res)}
    assert set(curves["satformer"]) == set(curves["resformer"]) == {1, 2}
    assert curves["resformer"][1] == pytest.approx(1.5)  # λ1 at init: L / (L - 1)
    assert value_access(build_model({**SMALL, "arch": "resformer", "resformer": {"mode": "fixed"}})) == {1: 0.5, 2: 0.5}
    assert value_access(make("transformer")) is None
    assert plot_value_access(curves).axes[0].get_legend_handles_labels()[1] == ["satformer", "resformer"]


@pytest.fixture(scope="module")
def mlflow_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.create_experiment("gates", artifact_location=(root / "artifacts").as_uri())
    return client, experiment


def artifact_paths(client: MlflowClient, run_id: str, path: str) -> set[str]:
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


def test_log_gate_analysis_writes_metrics_and_artifacts(mlflow_client, tmp_path):
    client, experiment = mlflow_client
    run_id = client.create_run(experiment).info.run_id
    model = make()
    logged = log_gate_analysis(client, run_id, analyze_gates(model, batch(), byte_tokenizer()), model, step=5)
    metrics = client.get_run(run_id).data.metrics
    for key in ("val/gates/mean", "val/gates/sparsity", "val/gates/saturated_frac", "val/gates/dead_heads"):
        assert metrics[key] == pytest.approx(logged[key])
    assert client.get_metric_history(run_id, "val/gates/mean")[0].step == 5
    assert artifact_paths(client, run_id, "gates") == {
        f"gates/step_5/{name}" for name in ("heatmap.png", "categories.png", "gates.json", "value_access.png")
    }
    saved = json.loads(Path(client.download_artifacts(run_id, "gates/step_5/gates.json", str(tmp_path))).read_text())
    assert saved["layers"] == [1, 2] and saved["gate_fn"] == "relu"


def test_log_gate_analysis_without_gates_logs_only_mixing(mlflow_client):
    client, experiment = mlflow_client
    run_id = client.create_run(experiment).info.run_id
    model = make("denseformer")
    assert log_gate_analysis(client, run_id, analyze_gates(model, batch()), model, step=0) == {}
    assert client.get_run(run_id).data.metrics == {}
    assert artifact_paths(client, run_id, "gates") == {"gates/step_0/mixing/denseformer.png"}
