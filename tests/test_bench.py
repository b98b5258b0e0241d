"""The bench's ratios: paired per round, with a 95 % interval that is the t-interval of the log ratios."""

from __future__ import annotations

import json
import math
import platform

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from scipy import stats

from satlab.bench.throughput import PairedRatio
from satlab.cli.main import main
from satlab.training.machine import cpu_caches, cpu_model


def test_a_paired_ratio_is_the_geometric_mean_with_the_t_interval_of_the_log_ratios():
    ratios = [0.97, 1.01, 0.99, 0.95, 1.00, 0.98]
    paired = PairedRatio("transformer", ratios)
    logs = np.log(ratios)
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs))
    assert paired.mean == pytest.approx(math.exp(logs.mean()))
    assert (paired.low, paired.high) == (pytest.approx(math.exp(low)), pytest.approx(math.exp(high)))
    assert paired.half_width == pytest.approx((math.exp(high) - math.exp(low)) / 2 / math.exp(logs.mean()))
    assert PairedRatio("transformer", [1.0]).half_width == math.inf  # one round bounds nothing


@pytest.mark.slow  # make test-full
def test_the_bench_goes_on_until_the_interval_is_narrow_enough_or_says_it_is_not(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--archs", "transformer,satformer", "--batch", "2", "--seq-len", "32", "--warmup", "1",
            "--no-overhead", "--no-mlflow", "--out", str(out)]
    assert main([*args, "--rounds", "2", "--max-rounds", "4", "--ci-target", "1e-9"]) == 0
    report = json.loads(out.read_text())
    ratio = report["results"][1]["ratio"]
    assert ratio["rounds"] == 4 and ratio["low"] <= ratio["mean"] <= ratio["high"]
    assert report["results"][0]["ratio"] is None and report["ci"]["reached"] is False
    printed = capsys.readouterr().out
    assert "not the ± 1e-07 % asked for" in printed
    host = report["host"]  # what the machine was, measured before and after the rounds
    assert f"{host['threads']} threads" in printed and host["device"] in printed
    assert len(host["memory_gbps"]) == 2 and min(host["memory_gbps"]) > 0 and host["matmul_gflops"] > 0
    # the machine as satlab.training.machine reads it, on x86 or ARM (its parsing is tested in test_tracking)
    assert host["device"] == cpu_model() and host["caches"] == cpu_caches()
    assert main([*args, "--rounds", "3", "--ci-target", "0"]) == 0  # off: exactly the rounds asked for
    assert json.loads(out.read_text())["results"][1]["ratio"]["rounds"] == 3
    assert main([*args, "--ci-target", "-1"]) == 2


def test_the_lightning_overhead_is_a_paired_ratio_that_goes_on_until_its_interval_is_narrow_enough():
    from satlab.bench.overhead import lightning_overhead

    small = dict(size="tiny", batch=2, seq_len=16, steps=3, warmup=1, rounds=2)
    narrow = lightning_overhead(**small, ci_target=1e-9, max_rounds=3)  # a target no machine reaches: up to the cap
    assert narrow["rounds"] == 3 and narrow["low"] <= narrow["ratio"] <= narrow["high"]
    assert narrow["half_width"] > 1e-9 and narrow["bare_step_s"] > 0 and narrow["lightning_step_s"] > 0
    assert lightning_overhead(**small)["rounds"] == 2  # no target: exactly the rounds asked for


def _result(arch: str, step: float, reference_step: float, mem: float, depth_rounds: int = 3):
    from satlab.bench.throughput import BenchResult

    ratio = None if arch == "transformer" else PairedRatio("transformer", [reference_step / step] * depth_rounds)
    return BenchResult(arch, 1, 1, [step], 0.0, mem, 1.0, None, ratio)


def test_depth_overheads_grow_twofold_per_doubling_for_a_quadratic_term_and_stay_for_a_per_layer_one():
    from satlab.bench.depth import overheads

    sweep = {}
    for depth in (6, 12, 24):
        backbone = 1.0 * depth  # O(L) time per step
        sweep[depth] = [_result("transformer", backbone, backbone, 1.0),
                        _result("denseformer", backbone + 0.01 * depth ** 2, backbone, 1.1),  # + O(L²)
                        _result("hyperconnections", 1.5 * backbone, backbone, 1.2)]  # + O(L)
    table = overheads(sweep)
    assert table["denseformer"]["time"] == pytest.approx({6: 0.06, 12: 0.12, 24: 0.24})
    assert table["denseformer"]["growth_per_doubling"] == pytest.approx(2.0)
    assert table["hyperconnections"]["growth_per_doubling"] == pytest.approx(1.0)
    assert table["hyperconnections"]["memory"][12] == pytest.approx(0.2)


def test_the_depth_sweep_writes_its_ratios_by_depth_a_plot_and_an_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "bench.json"
    assert main(["bench", "--archs", "transformer,denseformer", "--depths", "2,1", "--batch", "2", "--seq-len", "16",
                 "--warmup", "1", "--rounds", "2", "--ci-target", "0", "--no-overhead", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["depth_sweep"]) == ["1", "2"]
    assert [r["arch"] for r in report["depth_sweep"]["2"]] == ["transformer", "denseformer"]
    assert set(report["overheads"]["denseformer"]["time"]) == {"1", "2"}
    image = plt.imread(tmp_path / "bench_depth.png")  # a PNG that decodes to a drawn figure, not a blank canvas
    assert image.shape[0] >= 300 and image.shape[1] >= 400 and image[..., :3].std() > 0.05
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")  # not the process-wide URI other tests set
    run, = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "bench/denseformer/ratio_mean")]
    assert sorted(steps) == [1, 2]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"bench.json", "bench_depth.png"}
    assert run.data.tags["device"] == report["host"]["device"]  # the machine, as every run's provenance tag says it
    assert run.data.metrics["bench/host/memory_gbps_after"] > 0


@pytest.mark.parametrize(("device", "gpus", "message"), [
    ("tpu", 0, "--device takes auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("cuda:x", 2, "--device takes auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ("cuda", 0, "sees no CUDA GPU here; use auto or cpu"),
    ("cuda:7", 2, "--device cuda:7: torch sees 2 CUDA GPU(s), cuda:0 to cuda:1"),
])
def test_a_device_that_is_not_there_is_refused_with_what_is_valid(device, gpus, message, tmp_path, capsys,
                                                                  monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main(["bench", "--device", device, "--no-mlflow", "--out", str(tmp_path / "b.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_compare_pairs_each_architecture_with_itself_at_the_first_value(tmp_path, capsys, monkeypatch):
    """--compare parametrization=sp,completep: per architecture one model per value, each ratio against the same
    architecture at the first value, and the models are built and optimised as the parametrisation says."""
    out = tmp_path / "bench.json"
    monkeypatch.chdir(tmp_path)  # its MLflow run goes to ./mlruns (the labels must be valid metric names)
    assert main(["bench", "--archs", "transformer,satformer", "--batch", "2", "--seq-len", "16", "--warmup", "1",
                 "--rounds", "2", "--ci-target", "0", "--no-overhead", "--out", str(out),
                 "--compare", "model.parametrization=sp,completep"]) == 0
    results = {r["arch"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["transformer parametrization:sp", "transformer parametrization:completep",
                             "satformer parametrization:sp", "satformer parametrization:completep"]
    assert results["satformer parametrization:completep"]["ratio"]["reference"] == "satformer parametrization:sp"
    assert results["transformer parametrization:completep"]["ratio"]["rounds"] == 2
    assert results["transformer parametrization:sp"]["ratio"] is None
    printed = capsys.readouterr().out
    assert "vs its first value" in printed and "in experiment 'bench'" in printed


def test_the_bench_optimises_with_the_trainings_own_groups():
    from satlab.bench.throughput import _Runner

    def groups(parametrization: str) -> list[float]:
        runner = _Runner("transformer", "tiny", 1, 8, torch.device("cpu"), torch.float32, False, 0,
                         {"parametrization": parametrization, "d_model": 256, "n_heads": 8})
        return sorted({g["lr"] for g in runner.optimizer.param_groups})

    assert groups("sp") == [1e-4]
    assert len(groups("completep")) > 1 and min(groups("completep")) == pytest.approx(1e-4 / 2)  # hidden: x 1/m_w


@pytest.mark.parametrize(("compare", "message"), [
    ("parametrisation=sp,mup", "did you mean"), ("parametrization=sp", "two or more distinct values"),
    ("parametrization=sp,sp", "two or more distinct values")])
def test_a_bad_compare_is_refused_with_what_is_valid(compare, message, tmp_path, capsys):
    assert main(["bench", "--compare", compare, "--no-mlflow", "--out", str(tmp_path / "b.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("depths", ["6,x", "0,12", ","])
def test_bad_depths_are_refused_with_what_is_valid(depths, tmp_path, capsys):
    assert main(["bench", "--depths", depths, "--no-mlflow", "--out", str(tmp_path / "b.json")]) == 2
    assert "--depths takes comma-separated integers >= 1, e.g. 6,12,24" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()



_STEPS = """
import resource, sys, torch
from satlab.training.perf import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def step():  # a 64 MB activation and its product, freed at the end of the step
    return float((torch.ones(2**24) * 2)[-1])
for _ in range(10):  # warm-up: the heap grows to what a step needs
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow  # make test-full
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory sets glibc's mallopt; elsewhere "
                                                               "it is a no-op and the allocator decides")
@pytest.mark.process
def test_freed_memory_stays_in_the_process_so_the_next_step_does_not_fault_its_pages_in_again():
    """By default glibc hands each freed 64 MB block back to the OS and faults its 16,384 pages in again at the next
    step; kept, a step after warm-up reuses the heap (its growth may still end during the measured steps)."""
    import subprocess
    import sys

    runs = {mode: subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                                 check=True).stdout.split() for mode in ("keep", "default")}
    assert runs["keep"][0] == "True"
    assert int(runs["default"][1]) >= 5 * 2 * 16_384
    assert int(runs["keep"][1]) < int(runs["default"][1]) / 3


@pytest.mark.slow  # make test-full
def test_the_data_bench_measures_each_process_count_and_extrapolates_to_the_presets(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "data.json"
    assert main(["bench", "--data", "--documents", "300", "--procs", "2,1", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["num_proc"] for r in report["runs"]] == [1, 2] and report["identical"]
    assert report["runs"][0]["speedup"] == 1 and all(r["tokens_per_s"] > 0 and r["peak_gb"] > 0.05
                                                     for r in report["runs"])
    presets = report["extrapolation"]["presets"]
    assert list(presets) == ["small", "medium", "large", "xl"] and presets["small"]["tokens"] == 6_600_000_000
    hours = presets["xl"]["hours"]
    assert hours["8"] > hours["32"] >= hours["64"] > 0  # more cores, less time, until the one reader is the limit
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run, = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "bench/data/tokens_per_s")) == [1, 2]


@pytest.mark.parametrize("args", [["--procs", "0"], ["--procs", "one"], ["--documents", "10"], ["--repeats", "0"]])
def test_bad_data_bench_settings_are_refused(args, tmp_path, capsys):
    assert main(["bench", "--data", *args, "--no-mlflow", "--out", str(tmp_path / "d.json")]) == 2
    assert not (tmp_path / "d.json").exists()
    assert args[0] in capsys.readouterr().err
