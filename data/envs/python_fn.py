"""`python_fn` (family "code"): write a small Python function `f`; correct when it passes every hidden test.

Levels: 1 one expression of an int x ("the square of x"); 2 a condition (absolute value, larger of two, sign);
3 a list xs (sum, even numbers, largest); 4 a string s (reversed, vowels, palindrome); 5 a loop (factorial,
Fibonacci, digit sum, gcd, primes below n, Collatz steps). The prompt reads "Write def f(x): return the square of
x."; the reference answer is a plain implementation, and the steps are comment lines above it, so every worked
response is itself a program.

The hidden tests (five inputs and the reference's outputs) are in `Problem.data["tests"]`. Scoring sends only the
inputs into the sandbox (data/envs/sandbox.py): the response runs there as a module, `f` is called on each input,
the results come back as one line of JSON, and they are compared with the expected outputs here, in the parent.
The expected outputs never enter the sandbox, and the sandbox cannot see this process, so forged results still
have to be the right values. `score_many` runs a batch's programs in parallel.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

from data.envs.base import Environment, Problem, Score, clip
from data.envs.sandbox import SandboxResult, run_many, run_sandboxed

MAX_RESPONSE_CHARS = 20_000
"""a longer response fails without being run"""
NUM_TESTS = 5
_RESULTS_MARK = "@@cedar-results@@"

# Runs inside the sandbox after _SOURCE, _NAME and _ARGS are defined above it. The solution gets a namespace of
# its own, so nothing it defines can shadow the harness's names.
_HARNESS = """
import json as _json
_ns = {"__name__": "solution"}
exec(compile(_SOURCE, "solution.py", "exec"), _ns)
_f = _ns.get(_NAME)
if not callable(_f):
    _results = "missing"
else:
    _results = []
    for _args in _json.loads(_ARGS):
        try:
            _value = _f(*_args)
        except Exception as _e:
            _results.append(["raised", type(_e).__name__ + ": " + str(_e)[:60]])
            continue
        try:
            _results.append(["ok", _json.loads(_json.dumps(_value))])
        except (TypeError, ValueError, RecursionError):
            _results.append(["unencodable", type(_value).__name__])
print()
print(_MARK + _json.dumps(_results))
"""


@dataclass(frozen=True)
class _Task:
    key: str
    params: str
    """the parameter list of f, e.g. "x" or "a, b" """
    text: str
    """what f returns, completing "Write def f(x): return ..." """
    body: tuple[str, ...]
    """the reference implementation's body lines, unindented"""
    steps: tuple[str, ...]
    """comment lines explaining it"""
    ref: Callable[..., Any]
    inputs: Callable[[random.Random], tuple]
    """one random argument tuple"""


class PythonFn(Environment):
    name = "python_fn"
    family = "code"
    levels = 5

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256, workers: int | None = None):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.workers = workers
        """programs run at once by score_many (None: the CPUs this process may use)"""

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        task = _LEVELS[difficulty - 1](rng)
        args = [list(task.inputs(rng)) for _ in range(NUM_TESTS)]
        tests = [[a, task.ref(*a)] for a in args]
        answer = "\n".join([f"def f({task.params}):", *("    " + line for line in task.body)])
        prompt = f"Write def f({task.params}): return {task.text}."
        data = {"name": "f", "task": task.key, "tests": json.loads(json.dumps(tests))}
        return Problem(self.name, self.family, difficulty, prompt, answer, data, task.steps)

    def grade(self, problem: Problem, response: str) -> tuple[bool, str]:
        program = self._program(problem, response)
        if isinstance(program, tuple):
            return program
        return self._judge(problem, run_sandboxed(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb))

    def score_many(self, problems: list[Problem], responses: list[str]) -> list[Score]:
        """`score` of each pair, the programs run in parallel (`run_many`, at most `workers` at once)."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        prepared: list = []
        for problem, response in zip(problems, responses):
            try:
                ready = isinstance(response, str) and problem.env == self.name
                prepared.append(self._program(problem, response) if ready else None)  # None: weigh refuses it
            except Exception as e:  # noqa: BLE001 - a malformed problem: weigh reports it
                prepared.append(e)
        queued = [i for i, item in enumerate(prepared) if isinstance(item, str)]
        runs = dict(zip(queued, run_many([prepared[i] for i in queued], workers=self.workers,
                                         timeout_s=self.timeout_s, memory_mb=self.memory_mb)))

        def grade(i: int) -> tuple[bool, str]:
            if isinstance(prepared[i], Exception):
                raise prepared[i]
            return prepared[i] if isinstance(prepared[i], tuple) else self._judge(problems[i], runs[i])

        return [self.weigh(p, r, functools.partial(grade, i)) for i, (p, r) in enumerate(zip(problems, responses))]

    def _program(self, problem: Problem, response: str) -> str | tuple[bool, str]:
        """The program the sandbox runs: the response and the test inputs, never the expected outputs; or the
        verdict (False, detail) of a response refused unrun."""
        if len(response) > MAX_RESPONSE_CHARS:
            return False, f"response longer than {MAX_RESPONSE_CHARS} characters"
        name = problem.data.get("name", "f")
        return "\n".join([f"_SOURCE = {_strip_fences(response)!r}", f"_NAME = {name!r}",
                          f"_ARGS = {json.dumps([args for args, _ in problem.data['tests']])!r}",
                          f"_MARK = {_RESULTS_MARK!r}", _HARNESS])

    def _judge(self, problem: Problem, run: SandboxResult) -> tuple[bool, str]:
        """Compare the outputs the run printed (bounded JSON of plain values) with the expected ones, here."""
        tests = problem.data["tests"]
        name = problem.data.get("name", "f")
        last = run.stdout.rstrip().rpartition("\n")[2]
        if not run.ok or not last.startswith(_RESULTS_MARK):
            error = run.stderr.strip().rpartition("\n")[2]
            return False, f"sandbox: {run.reason}" + (f": {clip(error, 120)}" if error else "")
        try:
            results = json.loads(last[len(_RESULTS_MARK) :])
        except (ValueError, RecursionError):  # cut off by the output limit, printed by the response, too deep
            results = None
        if results == "missing":
            return False, f"the response defines no function {name}"
        if not (isinstance(results, list) and len(results) == len(tests)
                and all(isinstance(r, list) and len(r) == 2 for r in results)):
            return False, "malformed test results"
        for i, ((args, want), (kind, got)) in enumerate(zip(tests, results)):
            if kind != "ok":
                return False, f"test {i + 1}: {name}{_call(args)} {kind} {clip(str(got), 60)}"
            if not _same(got, want):
                return False, f"test {i + 1}: {name}{_call(args)} returned {clip(repr(got))}, want {clip(repr(want))}"
        return True, f"passed {len(tests)} tests"


def _strip_fences(response: str) -> str:
    """The code inside a ``` fence when the response is one, else the response."""
    text = response.strip()
    if not text.startswith("```"):
        return response
    lines = text.split("\n")[1:]
    if lines and lines[-1].strip() == "```":
        lines = lines[:-1]
    return "\n".join(lines)


def _call(args: list) -> str:
    return clip("(" + ", ".join(map(repr, args)) + ")", 60)


def _same(got: Any, want: Any) -> bool:
    """Equality of JSON values that tells True from 1 and allows float rounding."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return type(got) is type(want) and got == want


def _ints(low: int, high: int, count: int = 1) -> Callable[[random.Random], tuple]:
    return lambda rng: tuple(rng.randint(low, high) for _ in range(count))


def _int_list(min_len: int = 0) -> Callable[[random.Random], tuple]:
    return lambda rng: ([rng.randint(-9, 20) for _ in range(rng.randint(min_len, 6))],)


def _text(rng: random.Random) -> tuple:
    words = ["".join(rng.choice("abcdeinorstu") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
    return (" ".join(words),)


def _maybe_palindrome(rng: random.Random) -> tuple:
    half = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 3)))
    if rng.random() < 0.5:
        return (half + rng.choice(["", "x"]) + half[::-1],)
    return (half + rng.choice("abcd") + "e",)


def _level1(rng: random.Random) -> _Task:
    k, one = rng.randint(2, 9), _ints(-20, 20)
    tasks = [
        _Task("square", "x", "the square of x", ("return x * x",), ("# x times itself",), lambda x: x * x, one),
        _Task("add", "x", f"x plus {k}", (f"return x + {k}",), (f"# add {k} to x",), lambda x: x + k, one),
        _Task("times", "x", f"x times {k}", (f"return x * {k}",), (f"# multiply x by {k}",), lambda x: x * k, one),
        _Task("minus", "x", f"x minus {k}", (f"return x - {k}",), (f"# take {k} from x",), lambda x: x - k, one),
        _Task("negate", "x", "the negative of x", ("return -x",), ("# flip the sign of x",), lambda x: -x, one),
        _Task("mod", "x", f"x modulo {k}", (f"return x % {k}",), ("# % is Python's remainder",),
              lambda x: x % k, one),
    ]
    return rng.choice(tasks)


def _level2(rng: random.Random) -> _Task:
    k = rng.randint(-5, 5)
    one, two = _ints(-20, 20), _ints(-20, 20, 2)
    tasks = [
        _Task("abs", "x", "the absolute value of x", ("if x < 0:", "    return -x", "return x"),
              ("# a negative x changes sign", "# any other x stays as it is"), abs, one),
        _Task("max", "a, b", "the larger of a and b", ("if a > b:", "    return a", "return b"),
              ("# compare a with b", "# return whichever is larger"), max, two),
        _Task("min", "a, b", "the smaller of a and b", ("if a < b:", "    return a", "return b"),
              ("# compare a with b", "# return whichever is smaller"), min, two),
        _Task("even", "x", "1 if x is even, else 0", ("if x % 2 == 0:", "    return 1", "return 0"),
              ("# x is even when x % 2 is 0",), lambda x: int(x % 2 == 0), one),
        _Task("floor", "x", f"x if x is greater than {k}, else {k}", (f"if x > {k}:", "    return x", f"return {k}"),
              (f"# keep x when it is above {k}", f"# otherwise give {k}"), lambda x: x if x > k else k, one),
        _Task("sign", "x", "the sign of x: 1, 0 or -1",
              ("if x > 0:", "    return 1", "if x < 0:", "    return -1", "return 0"),
              ("# positive gives 1", "# negative gives -1", "# zero gives 0"), lambda x: (x > 0) - (x < 0), one),
    ]
    return rng.choice(tasks)


def _level3(rng: random.Random) -> _Task:
    k = rng.randint(0, 10)
    tasks = [
        _Task("sum", "xs", "the sum of the list xs", ("total = 0", "for v in xs:", "    total += v", "return total"),
              ("# start from 0", "# add every number"), sum, _int_list()),
        _Task("evens", "xs", "the even numbers of the list xs, in order", ("return [v for v in xs if v % 2 == 0]",),
              ("# keep v when v % 2 is 0",), lambda xs: [v for v in xs if v % 2 == 0], _int_list()),
        _Task("largest", "xs", "the largest number of the non-empty list xs",
              ("best = xs[0]", "for v in xs[1:]:", "    if v > best:", "        best = v", "return best"),
              ("# start with the first number", "# keep any larger one"), max, _int_list(1)),
        _Task("count_above", "xs", f"how many numbers of the list xs are greater than {k}",
              (f"return sum(1 for v in xs if v > {k})",), (f"# count the v with v > {k}",),
              lambda xs: sum(1 for v in xs if v > k), _int_list()),
        _Task("doubled", "xs", "the list xs with every number doubled", ("return [2 * v for v in xs]",),
              ("# 2 * v for each v",), lambda xs: [2 * v for v in xs], _int_list()),
        _Task("reversed", "xs", "the list xs in reverse order", ("return xs[::-1]",), ("# a step of -1 reverses",),
              lambda xs: xs[::-1], _int_list()),
    ]
    return rng.choice(tasks)


def _level4(rng: random.Random) -> _Task:
    k = rng.randint(1, 4)
    tasks = [
        _Task("reverse", "s", "the string s reversed", ("return s[::-1]",), ("# a step of -1 reverses",),
              lambda s: s[::-1], _text),
        _Task("upper", "s", "s in upper case", ("return s.upper()",), ("# str.upper does it",), str.upper, _text),
        _Task("vowels", "s", "the number of vowels (a, e, i, o, u) in s",
              ("return sum(1 for c in s if c in 'aeiou')",), ("# count each c that is a vowel",),
              lambda s: sum(1 for c in s if c in "aeiou"), _text),
        _Task("no_spaces", "s", "s with every space removed", ("return s.replace(' ', '')",),
              ("# replace each space by nothing",), lambda s: s.replace(" ", ""), _text),
        _Task("prefix", "s", f"the first {k} characters of s", (f"return s[:{k}]",),
              (f"# a slice up to {k}",), lambda s: s[:k], _text),
        _Task("palindrome", "s", "True if s reads the same backwards, else False", ("return s == s[::-1]",),
              ("# compare s with s reversed",), lambda s: s == s[::-1], _maybe_palindrome),
    ]
    return rng.choice(tasks)


def _factorial(n: int) -> int:
    return math.factorial(n)


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _primes_below(n: int) -> int:
    return sum(1 for k in range(2, n) if all(k % d for d in range(2, math.isqrt(k) + 1)))


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _level5(rng: random.Random) -> _Task:
    tasks = [
        _Task("factorial", "n", "the factorial of n, for n >= 0",
              ("result = 1", "for k in range(2, n + 1):", "    result *= k", "return result"),
              ("# start from 1", "# multiply by every k from 2 to n"), _factorial, _ints(0, 10)),
        _Task("fibonacci", "n", "the n-th Fibonacci number, where f(0) = 0 and f(1) = 1",
              ("a, b = 0, 1", "for _ in range(n):", "    a, b = b, a + b", "return a"),
              ("# keep the last two numbers", "# step forward n times"), _fibonacci, _ints(0, 20)),
        _Task("digit_sum", "n", "the sum of the decimal digits of n, for n >= 0",
              ("total = 0", "while n > 0:", "    total += n % 10", "    n //= 10", "return total"),
              ("# n % 10 is the last digit", "# n // 10 drops it"), lambda n: sum(map(int, str(n))),
              _ints(0, 99999)),
        _Task("gcd", "a, b", "the greatest common divisor of a and b, both >= 1",
              ("while b:", "    a, b = b, a % b", "return a"), ("# Euclid: replace (a, b) by (b, a % b)",
                                                                 "# until b is 0"), math.gcd, _ints(1, 60, 2)),
        _Task("primes", "n", "how many primes are less than n",
              ("count = 0", "for k in range(2, n):", "    if all(k % d for d in range(2, int(k ** 0.5) + 1)):",
               "        count += 1", "return count"),
              ("# k is prime when no d up to its square root divides it", "# count such k below n"),
              _primes_below, _ints(0, 60)),
        _Task("collatz", "n", "how many steps take n to 1, each step halving an even n and making an odd n 3n+1",
              ("steps = 0", "while n != 1:", "    n = n // 2 if n % 2 == 0 else 3 * n + 1", "    steps += 1",
               "return steps"), ("# apply the rule until n is 1", "# count the steps"), _collatz, _ints(1, 40)),
    ]
    return rng.choice(tasks)


_LEVELS: tuple[Callable[[random.Random], _Task], ...] = (_level1, _level2, _level3, _level4, _level5)
