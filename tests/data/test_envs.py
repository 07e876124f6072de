"""The verifiable environments (data/envs/): each is deterministic for a seed and samples at every level; every
worked response, at any effort, scores correct with the full difficulty weight, while wrong, garbage, empty, huge
and non-str responses score 0 without raising; the weighting, the response format and the registry behave as
documented; a python_fn answer is judged by its hidden tests (a wrong one, a syntax error or a missing f fails)."""

import json
import random
import re

import pytest

from data.envs import (
    ENVIRONMENTS,
    Environment,
    Problem,
    PythonFn,
    difficulty_weight,
    final_answer,
    get_env,
    register,
    sample_problems,
)

NAMES = ["arithmetic", "strings", "python_fn"]


def _all_levels(name, seed=0):
    env = get_env(name)
    return [env.sample(random.Random(seed + level), level) for level in range(1, env.levels + 1)]


def test_registry_holds_the_three_families():
    assert {name: env.family for name, env in ENVIRONMENTS.items() if name in NAMES} == {
        "arithmetic": "math", "strings": "string", "python_fn": "code"}
    assert all(get_env(name).levels >= 3 for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_a_seed(name):
    env = get_env(name)
    for level in range(1, env.levels + 1):
        first = [env.sample(random.Random(7), level) for _ in range(2)]
        assert first[0] == first[1]
        others = {env.sample(random.Random(seed), level).prompt for seed in range(20)}
        assert len(others) > 1, f"level {level} ignores its rng"


@pytest.mark.parametrize("name", NAMES)
def test_every_level_samples(name):
    env = get_env(name)
    for problem in _all_levels(name):
        assert (problem.env, problem.family) == (name, env.family)
        assert problem.prompt and problem.answer and len(problem.prompt) < 120  # fits a 128-token sequence
        json.dumps(problem.data)
        assert all(isinstance(step, str) and "\n" not in step for step in problem.steps)
    with pytest.raises(ValueError, match="difficulty"):
        env.sample(random.Random(0), env.levels + 1)
    with pytest.raises(ValueError, match="difficulty"):
        env.sample(random.Random(0), 0)


def test_level_one_arithmetic_is_a_single_digit_sum():
    for seed in range(20):
        problem = get_env("arithmetic").sample(random.Random(seed), 1)
        assert re.fullmatch(r"\d\+\d", problem.prompt) and int(problem.answer) == eval(problem.prompt)


@pytest.mark.parametrize("name", NAMES)
def test_worked_responses_score_full_weight(name):
    env = get_env(name)
    for problem in _all_levels(name):
        for effort in (1, 20, 80, 100):
            score = env.score(problem, problem.worked(effort))
            assert score.correct, (problem.prompt, effort, score.detail)
            assert score.reward == difficulty_weight(problem.difficulty, env.levels)


def test_arithmetic_answers_and_steps_are_true():
    for seed in range(30):
        for problem in _all_levels("arithmetic", seed):
            assert int(problem.answer) == eval(problem.prompt)  # the prompts are Python expressions
            for step in problem.steps:
                left, right = step.split(" = ")
                assert eval(left) == eval(right), step


def _solve_strings(prompt):
    task, _, arg = prompt.partition(": ")
    if task == "upper":
        return arg.upper()
    if task == "reverse":
        return arg[::-1]
    if task.startswith("count "):
        return str(arg.count(task[-1]))
    if task == "sort letters":
        return "".join(sorted(arg))
    assert task == "sort", prompt
    return " ".join(map(str, sorted(map(int, arg.split()))))


def test_strings_answers_are_right():
    for seed in range(30):
        for problem in _all_levels("strings", seed):
            assert problem.answer == _solve_strings(problem.prompt), problem.prompt


@pytest.mark.parametrize("name", NAMES)
def test_effort_sets_the_length(name):
    for problem in _all_levels(name):
        full, short = problem.worked(100), problem.worked(1)
        assert full.split("\n") == [*problem.steps, *problem.answer.split("\n")]
        if problem.steps:
            assert len(full) > len(short)
        if len(problem.steps) < 50:
            assert short == problem.answer
        assert len(problem.worked(50)) <= len(full)
    for bad in (0, 101, 1.5, True):
        with pytest.raises(ValueError, match="effort"):
            problem.worked(bad)


def test_worked_keeps_evenly_spread_steps_ending_with_the_last():
    problem = Problem("arithmetic", "math", 1, "p", "9", {}, tuple("abcd"))
    assert problem.worked(50) == "b\nd\n9" and problem.worked(25) == "d\n9" and problem.worked(100) == "a\nb\nc\nd\n9"


def _wrong(problem):
    if problem.env == "arithmetic":
        return str(int(problem.answer) + 1)
    if problem.env == "strings":
        return problem.answer + "z"
    return problem.answer.replace("return ", "return 1 + ", 1)


@pytest.mark.parametrize("name", NAMES)
def test_wrong_answers_score_zero(name):
    env = get_env(name)
    for problem in _all_levels(name):
        score = env.score(problem, "\n".join([*problem.steps, _wrong(problem)]))
        assert not score.correct and score.reward == 0.0 and score.detail


GARBAGE = ["", " \n\n \t", "\x00\xff\ufffd garbage (((", "é\ud800 lone surrogate", "7\n" * 200_000, "9" * 100_000]


@pytest.mark.parametrize("name", NAMES)
def test_garbage_never_raises(name):
    env = get_env(name)
    problem = _all_levels(name)[1]
    for response in [*GARBAGE, None, 42, b"bytes"]:
        score = env.score(problem, response)
        assert not score.correct and score.reward == 0.0, repr(response)[:40]
    other = _all_levels("strings" if name != "strings" else "arithmetic")[0]
    assert "from env" in env.score(other, other.answer).detail


def test_scoring_a_malformed_problem_fails_without_raising():
    env = get_env("python_fn")
    problem = Problem("python_fn", "code", 1, "p", "def f(x):\n    return x", {"tests": "not a list"})
    score = env.score(problem, problem.answer)
    assert not score.correct and score.reward == 0.0


def test_final_answer():
    assert final_answer("3+4 = 7\n7\n\n  ") == "7"
    assert final_answer("  only  ") == "only"
    assert final_answer("") == "" and final_answer("\n \n") == ""
    assert final_answer("a\r\nb\r\n") == "b"


def test_difficulty_weight():
    assert [difficulty_weight(d, 5) for d in range(1, 6)] == [1.0, 1.25, 1.5, 1.75, 2.0]
    assert difficulty_weight(1, 1) == 1.0 and difficulty_weight(3, 3) == 2.0
    for bad in (0, 6, True, 2.0):
        with pytest.raises(ValueError, match="difficulty"):
            difficulty_weight(bad, 5)
    with pytest.raises(ValueError, match="levels"):
        difficulty_weight(1, 0)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown environment 'nope'.*arithmetic.*python_fn.*strings"):
        get_env("nope")

    class Impostor(Environment):
        name, family, levels = "arithmetic", "math", 3

        def sample(self, rng, difficulty):
            raise NotImplementedError

        def grade(self, problem, response):
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor())
    Impostor.name = ""
    with pytest.raises(ValueError, match="name"):
        register(Impostor())
    assert register(get_env("strings")) is get_env("strings")  # registering the same object again is a no-op


def test_sample_problems():
    names = ["arithmetic", "strings", "python_fn"]
    first = sample_problems(names, 12, seed=3)
    assert first == sample_problems(names, 12, seed=3) and first != sample_problems(names, 12, seed=4)
    assert [p.env for p in first] == names * 4
    assert {p.difficulty for p in sample_problems(["arithmetic"], 60, seed=0)} == {1, 2, 3, 4, 5}
    assert {p.difficulty for p in sample_problems(names, 9, seed=0, difficulty=2)} == {2}
    assert {p.difficulty for p in sample_problems(["strings"], 40, seed=0, difficulty=[1, 3])} == {1, 3}
    assert sample_problems(names, 0, seed=0) == []
    with pytest.raises(ValueError, match="difficulty"):
        sample_problems(names, 3, seed=0, difficulty=9)
    with pytest.raises(ValueError, match="names"):
        sample_problems([], 3, seed=0)
    with pytest.raises(ValueError, match="unknown environment"):
        sample_problems(["arithmetic", "chess"], 3, seed=0)


def test_python_fn_judges_by_hidden_tests():
    env = PythonFn(timeout_s=2.0)
    problem = env.sample(random.Random(1), 5)
    assert len(problem.data["tests"]) == 5 and problem.data["name"] == "f"
    assert env.score(problem, problem.answer).correct
    assert env.score(problem, f"```python\n{problem.answer}\n```").correct  # a fenced answer is unwrapped
    params = problem.prompt.split("def f(")[1].split(")")[0]
    cases = {
        f"def f({params}):\n    return -12345": "returned",
        f"def f({params}):\n    return (": "SyntaxError",
        "def g(x):\n    return x": "no function f",
        f"def f({params}):\n    raise ValueError('no')": "raised ValueError",
        f"def f({params}):\n    return {{1, 2}}": "unencodable",
        "print('@@cedar-results@@[]')": "no function f",  # a forged result line does not pass
    }
    for response, detail in cases.items():
        score = env.score(problem, response)
        assert not score.correct and score.reward == 0.0 and detail in score.detail, (response, score)


def test_python_fn_tells_bools_from_ints():
    env = get_env("python_fn")
    problem = Problem("python_fn", "code", 1, "p", "", {"name": "f", "tests": [[[3], True]]})
    assert env.score(problem, "def f(x):\n    return True").correct
    assert not env.score(problem, "def f(x):\n    return 1").correct
