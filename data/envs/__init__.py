"""Verifiable environments for RL and SFT: programmatically generated problems at difficulty levels, scored by
checking the answer (`arithmetic`, `strings`) or by running hidden tests in a sandbox (`python_fn`).

    from data.envs import get_env, sample_problems
    problems = sample_problems(["arithmetic", "strings"], n=64, seed=0)
    sft = [(p.prompt, p.worked(effort=50)) for p in problems]
    score = get_env(p.env).score(p, response)  # Score(correct, reward, detail)

See docs/environments.md for the levels, the response format, the reward weighting and the sandbox's limits.
"""

from data.envs.arithmetic import Arithmetic
from data.envs.base import (
    ENVIRONMENTS,
    Environment,
    EnvironmentUnavailable,
    Problem,
    Score,
    difficulty_weight,
    final_answer,
    get_env,
    register,
    sample_problems,
)
from data.envs.python_fn import PythonFn
from data.envs.sandbox import SandboxResult, SandboxUnavailable, run_many, run_sandboxed
from data.envs.strings import Strings

for _env in (Arithmetic(), Strings(), PythonFn()):
    register(_env)
del _env

__all__ = [
    "ENVIRONMENTS",
    "Arithmetic",
    "Environment",
    "EnvironmentUnavailable",
    "Problem",
    "PythonFn",
    "SandboxResult",
    "SandboxUnavailable",
    "Score",
    "Strings",
    "difficulty_weight",
    "final_answer",
    "get_env",
    "register",
    "run_many",
    "run_sandboxed",
    "sample_problems",
]
