"""Issue 39's inputs: search spaces and axes checked against their settings' types, every echoed value cut to a
readable length (and YAML aliases that would expand a file to gigabytes refused), did-you-mean by meaning, and name
rules that say which characters are valid. Each is a usage error (exit 2) that writes nothing."""

from __future__ import annotations

import pytest
from test_bad_inputs import assert_nothing_written, assert_refused_study, isolated, run_cli

from satlab.config.errors import ECHO_CHARS, MAX_PROBLEM_CHARS, ConfigError, did_you_mean, shown
from satlab.config.loader import load_experiment

SPACE_CASES = [
    ("numeric range over a text setting", ["space.data.text_field.low=1", "space.data.text_field.high=2"],
     ["space data.text_field is a numeric range", "takes a text", "choices"]),
    ("log range over a text setting", ["space.data.source.low=1", "space.data.source.high=2",
                                       "space.data.source.log=true"], ["data.source takes a text"]),
    ("numeric range over a switch", ["space.train.compile.low=0", "space.train.compile.high=1"],
     ["train.compile takes true or false"]),
    ("float range over an integer setting", ["space.model.n_layers.low=2", "space.model.n_layers.high=4"],
     ["float range", "model.n_layers takes an integer", "type: int"]),
    ("numbers as choices of a text setting", ["space.data.text_field.choices=[1,2]"],
     ["data.text_field takes a text, got 1"]),
    ("a fraction among integer choices", ["space.train.keep_last_k.choices=[1,2.5]"],
     ["train.keep_last_k takes an integer, got 2.5"]),
    ("a number among switch choices", ["space.train.deterministic.choices=[true,1]"],
     ["train.deterministic takes true or false, got 1"]),
]


@pytest.mark.parametrize("case", SPACE_CASES, ids=[c[0] for c in SPACE_CASES])
def test_a_search_space_that_does_not_fit_its_setting_is_refused(case, tmp_path, capsys):
    assert_refused_study("sweep", "lr_tiny", case, tmp_path, capsys)


AXIS_CASES = [
    ("numbers on a text axis", ["axes.data.text_field=[1,2]"], ["axis data.text_field", "takes a text, got 1"]),
    ("text on an integer axis", ["axes.train.micro_batch_size=[4,many]"], ["takes an integer, got 'many'"]),
    ("a number on a switch axis", ["axes.train.compile=[false,0]"], ["takes true or false, got 0"]),
]


@pytest.mark.parametrize("case", AXIS_CASES, ids=[c[0] for c in AXIS_CASES])
def test_an_axis_whose_values_do_not_fit_its_setting_is_refused(case, tmp_path, capsys):
    assert_refused_study("ablate", "arch_tiny", case, tmp_path, capsys)


def test_a_space_that_fits_its_settings_is_accepted():
    from satlab.studies.loader import load_sweep

    spec = load_sweep("lr_tiny", ["space.model.n_layers.type=int", "space.model.n_layers.low=2",
                                  "space.model.n_layers.high=4", "space.data.text_field.choices=[text,body]",
                                  "space.optim.weight_decay.low=0", "space.optim.weight_decay.high=1"])
    assert spec.space["model.n_layers"].type == "int"


def _spec(tmp_path, name: str, body: str):
    path = tmp_path / "in" / f"{name}.yml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: {name}\nbase: tiny/transformer\n{body}")
    return path


def test_a_long_value_aliased_many_times_is_echoed_cut_to_a_readable_length(tmp_path, capsys):
    long = "y" * 100_000  # three aliases: 300 kB when expanded, under the alias limit
    spec = _spec(tmp_path, "alias", f"axes:\n  data.text_field: [&s '{long}', *s, *s]\n  train.seed: [0]\n")
    code, err = run_cli(["ablate", str(spec), f"out_dir={tmp_path / 'studies'}"], tmp_path, capsys)
    assert code == 2
    assert "repeats a value" in err and "(100,002 characters)" in err and "(300,012 characters)" in err
    assert len(err) < 1500, len(err)
    assert_nothing_written(tmp_path, {spec})


@pytest.mark.parametrize("body", [
    # one string of 900 kB aliased a thousand times: under 1 MiB on disk, 900 MB once read
    "axes:\n  data.text_field: [&s '" + "x" * 900_000 + "', " + ", ".join(["*s"] * 1000) + "]\n",
    # the billion laughs: nine levels of nine aliases
    "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)) + "axes: {train.seed: *a9}\n",
], ids=["long string aliased", "billion laughs"])
def test_yaml_aliases_that_expand_a_file_past_its_limit_are_refused_unread(body, tmp_path, capsys):
    spec = _spec(tmp_path, "bomb", body)
    code, err = run_cli(["ablate", str(spec), f"out_dir={tmp_path / 'studies'}"], tmp_path, capsys)
    assert code == 2
    assert "its aliases (*name) expand" in err and "at most 4,194,304 characters" in err
    assert len(err) < 600
    assert_nothing_written(tmp_path, {spec})


@pytest.mark.parametrize("value", ["z" * 1_000_000, ["w" * 1000] * 10_000, {"k": "v" * 500_000}, 1.5, "short"])
def test_shown_cuts_any_value_and_says_its_length(value):
    text = shown(value)
    assert len(text) <= ECHO_CHARS + 40
    if len(repr(value)) <= ECHO_CHARS:
        assert text == repr(value)
    else:
        assert text.startswith(repr(value)[:50]) and f"({len(repr(value)):,} characters)" in text


@pytest.mark.parametrize("override", ["model.arch=" + "q" * 50_000, "optim.lr=" + "1" * 9000 + "x",
                                      "optim." + "k" * 9000 + "=1", "name=" + "n" * 9000])
def test_an_error_never_echoes_a_whole_long_override(override, tmp_path, capsys):
    code, err = run_cli(isolated(tmp_path, override), tmp_path, capsys)
    assert code == 2
    assert len(err) < 2000, len(err)
    assert_nothing_written(tmp_path)


def test_a_problem_of_any_length_is_kept_at_its_ends():
    error = ConfigError("start " + "m" * 100_000 + " valid: a, b")
    assert len(str(error)) < MAX_PROBLEM_CHARS + 100
    assert str(error).startswith("start ") and str(error).endswith("valid: a, b")


@pytest.mark.parametrize(("typed", "meant"), [
    ("optim.learning_rate", "optim.lr"), ("optim.wd", "optim.weight_decay"),
    ("train.batch_size", "train.micro_batch_size"), ("model.num_layers", "model.n_layers"),
    ("model.num_heads", "model.n_heads"), ("model.hidden_size", "model.d_model"),
    ("model.ffn_dim", "model.mlp_hidden"), ("data.seq_length", "data.seq_len"), ("optim.epsilon", "optim.eps"),
    ("optim.grad_norm_clip", "optim.grad_clip"), ("train.max_steps", "train.max_tokens"),
    ("optim.lrr", "optim.lr"), ("optimm.lr", "optim"),
])
def test_an_unknown_key_suggests_the_setting_it_means(typed, meant, tmp_path, capsys):
    code, err = run_cli(isolated(tmp_path, f"{typed}=1"), tmp_path, capsys)
    assert code == 2
    assert f"did you mean '{meant.rsplit('.', 1)[-1] if typed.count('.') else meant}'" in err, err


def test_a_sweep_key_suggests_the_setting_it_means_by_its_words():
    from satlab.config.display import flatten

    keys = flatten(load_experiment("default"))
    assert did_you_mean("optim.learning_rate", keys) == " (did you mean 'optim.lr'?)"
    assert did_you_mean("train.n_nodes", keys) == " (did you mean 'train.num_nodes'?)"
    assert did_you_mean("x" * 100_000, keys) == ""


@pytest.mark.parametrize(("name", "refused"), [("café", "'é' (U+00E9)"), ("run 1", "' ' (U+0020)"),
                                               ("数据", "'数' (U+6570) and '据' (U+636E)"), ("a/b", "'/' (U+002F)")])
def test_a_run_name_refused_says_the_rule_is_ascii_and_which_characters_are_not(name, refused, tmp_path, capsys):
    code, err = run_cli(isolated(tmp_path, f"name={name}"), tmp_path, capsys)
    assert code == 2
    assert "letters, digits, '.', '_' and '-' of ASCII only (a-z, A-Z, 0-9" in err and refused in err, err
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("command", ["sweep", "ablate"])
def test_a_study_name_refused_says_the_rule_is_ascii(command, tmp_path, capsys):
    case = ("non-ASCII study name", ["name=études"], ["of ASCII only (a-z, A-Z, 0-9", "'é' (U+00E9) is not allowed"])
    assert_refused_study(command, "lr_tiny" if command == "sweep" else "arch_tiny", case, tmp_path, capsys)
