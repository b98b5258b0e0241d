"""The command line's one reader of number lists (satlab.cli.numbers): what it keeps, what it refuses and how."""

import pytest

from satlab.cli.numbers import number_list


@pytest.mark.parametrize(("text", "options", "expected"), [
    ("6, 12,24,", {}, [6, 12, 24]),  # blanks between commas ignored, order kept
    ("3,3", {}, [3, 3]),  # repeats allowed unless distinct
    ("0.5,0.75,1", {"kind": float, "low": -4, "high": 4}, [0.5, 0.75, 1.0]),
    ("64,128", {"multiple": 32, "at_least": 2}, [64, 128]),
    ("0,1,2", {"low": 0, "distinct": True}, [0, 1, 2]),
])
def test_a_valid_list_is_read_in_order(text, options, expected):
    problems: list[str] = []
    assert number_list("--x", text, problems, example="1,2", **options) == expected
    assert problems == []


@pytest.mark.parametrize(("text", "options", "rule"), [
    ("6,x", {}, "comma-separated integers >= 1"),
    (",", {}, "comma-separated integers >= 1"),
    ("1.5", {}, "comma-separated integers >= 1"),
    ("0,12", {}, "comma-separated integers >= 1"),
    ("2,5", {"high": 4}, "comma-separated integers from 1 to 4"),
    ("nan", {"kind": float, "low": -4, "high": 4}, "comma-separated numbers from -4 to 4"),
    ("48,64", {"multiple": 32}, "comma-separated integers >= 1, multiples of 32"),
    ("64,64", {"multiple": 32, "at_least": 2}, "at least 2 distinct comma-separated integers >= 1, multiples of 32"),
    ("0,0", {"low": 0, "distinct": True}, "comma-separated integers >= 0, none repeated"),
])
def test_a_bad_list_is_one_problem_saying_what_is_valid(text, options, rule):
    problems: list[str] = []
    assert number_list("--x", text, problems, example="1,2", why="a reason", **options) == []
    assert problems == [f"--x takes {rule} (a reason), e.g. 1,2; got '{text}'"]
