"""What every environment shares: the `Problem` and `Score` records, the response format (`final_answer`), the
reward weighting (`difficulty_weight`), the `Environment` base class and the registry (`register`, `get_env`,
`sample_problems`).

The response format: zero or more reasoning lines, then the final answer alone on the last non-empty line. Code
environments read the whole response as the program instead. `Problem.worked` writes responses in this format,
so the SFT targets and the RL scorer agree by construction.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass

MAX_EFFORT = 100


@dataclass(frozen=True)
class Problem:
    env: str
    """registry name of the environment that made it, e.g. "arithmetic" """
    family: str
    """task family, for routing distillation teachers: "math", "string" or "code" """
    difficulty: int
    """1..levels of its environment"""
    prompt: str
    """the user message text"""
    answer: str
    """the reference final answer (for code: a reference solution)"""
    data: dict
    """env-specific and JSON-able (the hidden tests of a code problem); may be empty"""
    steps: tuple[str, ...] = ()
    """worked reasoning lines (for SFT), in order, before the final answer"""

    def worked(self, effort: int) -> str:
        """The worked response at reasoning effort 1..100: round(len(steps) * effort / 100) step lines, then the
        answer on the last line. The kept steps are spread evenly and always end with the last one, so a short
        chain is a coarser version of the full one rather than its unfinished start; effort 100 keeps every step
        and a low effort gives the answer alone."""
        if isinstance(effort, bool) or not isinstance(effort, int) or not 1 <= effort <= MAX_EFFORT:
            raise ValueError(f"effort must be an int in 1..{MAX_EFFORT}, got {effort!r}")
        n = len(self.steps)
        k = round(n * effort / MAX_EFFORT)
        # (i + 1) * n // k - 1 is strictly increasing in i for k <= n and ends at n - 1.
        kept = [self.steps[(i + 1) * n // k - 1] for i in range(k)]
        return "\n".join([*kept, self.answer])


@dataclass(frozen=True)
class Score:
    correct: bool
    reward: float
    """correctness weighted by difficulty: 0.0 when wrong, difficulty_weight(difficulty, levels) when right"""
    detail: str = ""
    """why, for logs: "wrong answer: got 12, want 13", "sandbox: timeout after 2.0 s", ..."""


class EnvironmentUnavailable(RuntimeError):
    """The environment cannot run on this machine (a missing dependency, e.g. the code sandbox's bubblewrap): a
    set-up error that `score` raises, never a failed answer. Its message is one line naming what is missing."""


def difficulty_weight(difficulty: int, levels: int) -> float:
    """Reward for a correct answer: linear from 1.0 at level 1 to 2.0 at the top level (1.0 when levels is 1), so a
    hard problem solved is worth at most twice an easy one and easy problems still carry signal."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1, got {levels!r}")
    _check_difficulty(difficulty, levels, "difficulty_weight")
    if levels == 1:
        return 1.0
    return 1.0 + (difficulty - 1) / (levels - 1)


def final_answer(response: str) -> str:
    """The last non-empty line of `response` (lines split on "\\n"), stripped; "" when there is none. Linear in the
    response's length, whatever that is."""
    text = response.rstrip()
    return text[text.rfind("\n") + 1 :].strip()


def clip(text: str, limit: int = 40) -> str:
    """`text` shortened for a detail message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Environment(abc.ABC):
    """A generator of verifiable problems at `levels` difficulty levels. Subclasses set `name`, `family` and
    `levels` and implement `sample` and `grade`; `score` (shared) turns a grade into a weighted `Score` and never
    raises, whatever the response, except `EnvironmentUnavailable`. `score_many` scores a batch (code environments
    run it in parallel)."""

    name: str
    family: str
    levels: int

    @abc.abstractmethod
    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        """A problem at `difficulty` (1..levels), a function of `rng`'s state alone."""

    @abc.abstractmethod
    def grade(self, problem: Problem, response: str) -> tuple[bool, str]:
        """(correct, detail) for `response`, a str; may raise on a malformed problem (score catches it)."""

    def score(self, problem: Problem, response: str) -> Score:
        return self.weigh(problem, response, lambda: self.grade(problem, response))

    def score_many(self, problems: list[Problem], responses: list[str]) -> list[Score]:
        """`score` of each (problem, response) pair, in order."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        return [self.score(p, r) for p, r in zip(problems, responses)]

    def weigh(self, problem: Problem, response: str, grade) -> Score:
        """The `Score` of `grade()`, a thunk returning (correct, detail) for this pair; what `score` does around
        `grade`, shared with batched scorers: the checks of the pair, the weighting and the caught errors."""
        if not isinstance(response, str):
            return Score(False, 0.0, f"response is a {type(response).__name__}, not a str")
        if problem.env != self.name:
            return Score(False, 0.0, f"problem is from env {problem.env!r}, not {self.name!r}")
        try:
            correct, detail = grade()
            reward = difficulty_weight(problem.difficulty, self.levels) if correct else 0.0
        except EnvironmentUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a scorer error is a failed answer, never a crashed trainer
            return Score(False, 0.0, f"scoring error: {type(e).__name__}: {clip(str(e), 80)}")
        return Score(bool(correct), reward, detail)

    def check_difficulty(self, difficulty: int) -> None:
        _check_difficulty(difficulty, self.levels, f"env {self.name!r}")


def _check_difficulty(difficulty: int, levels: int, where: str) -> None:
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= levels:
        raise ValueError(f"difficulty must be an int in 1..{levels} for {where}, got {difficulty!r}")


ENVIRONMENTS: dict[str, Environment] = {}
"""name -> environment; filled by data/envs/__init__.py, extended with `register`"""


def register(env: Environment) -> Environment:
    """Add `env` to the registry under `env.name` (again registering the same object is a no-op)."""
    for attr, kind in (("name", str), ("family", str), ("levels", int)):
        value = getattr(env, attr, None)
        if not isinstance(value, kind) or isinstance(value, bool) or not value:
            raise ValueError(f"environment {env!r} needs a non-empty {kind.__name__} {attr!r}, got {value!r}")
    if env.levels < 1:
        raise ValueError(f"environment {env.name!r} needs levels >= 1, got {env.levels}")
    if not callable(getattr(env, "sample", None)) or not callable(getattr(env, "score", None)):
        raise ValueError(f"environment {env.name!r} needs sample and score methods")
    known = ENVIRONMENTS.get(env.name)
    if known is not None and known is not env:
        raise ValueError(f"an environment named {env.name!r} is already registered: {known!r}")
    ENVIRONMENTS[env.name] = env
    return env


def get_env(name: str) -> Environment:
    try:
        return ENVIRONMENTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}") from None


def sample_problems(
    names: list[str], n: int, seed: int, difficulty: int | list[int] | None = None, *, stratify: bool = False
) -> list[Problem]:
    """`n` problems cycling through the environments `names` in order (problem i from names[i % len(names)]), a
    function of `seed` alone. `difficulty`: one level for all, a list to draw each problem's level from uniformly,
    or None for uniform over each environment's own levels. A level an environment lacks is a ValueError.
    `stratify`: each environment's levels are dealt evenly over its problems (counts differing by at most one, in
    a shuffled order) instead of drawn independently, so every batch holds the same mix of difficulties."""
    if isinstance(names, str) or not names:
        raise ValueError(f"names must be a non-empty list of environment names, got {names!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    envs = [get_env(name) for name in names]
    if difficulty is not None:
        choices = [difficulty] if isinstance(difficulty, int) else list(difficulty)
        if not choices:
            raise ValueError("difficulty must not be an empty list")
        for env in envs:
            for level in choices:
                _check_difficulty(level, env.levels, f"env {env.name!r}")
    rng = random.Random(seed)
    dealt = [_dealt_levels(rng, env, choices if difficulty is not None else None, len(range(j, n, len(envs))))
             for j, env in enumerate(envs)] if stratify else None
    problems = []
    for i in range(n):
        env = envs[i % len(envs)]
        if dealt is not None:
            level = dealt[i % len(envs)][i // len(envs)]
        else:
            level = rng.randint(1, env.levels) if difficulty is None else rng.choice(choices)
        problems.append(env.sample(rng, level))
    return problems


def _dealt_levels(rng: random.Random, env: Environment, choices: list[int] | None, count: int) -> list[int]:
    """`count` levels of `choices` (None: every level of `env`) in equal shares, the remainder from a random start,
    shuffled."""
    levels = list(choices) if choices is not None else list(range(1, env.levels + 1))
    start = rng.randrange(len(levels))
    out = [levels[(start + i) % len(levels)] for i in range(count)]
    rng.shuffle(out)
    return out
