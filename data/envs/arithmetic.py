"""`arithmetic` (family "math"): integer expressions whose answer is their value.

Levels: 1 single-digit a+b ("3+4" -> "7"); 2 two-digit a+b or a-b; 3 one-digit times two-digit; 4 three operands
of 1..20 with + - * and the usual precedence; 5 (a op b) op (c op d) with parentheses. The steps rewrite the
expression one operation at a time ("12+7*8 = 12+56", "12+56 = 68"), or split the two-digit operand into tens
and ones at levels 2 and 3 ("7*46 = 7*40+7*6").
"""

from __future__ import annotations

import random

from data.envs.base import Environment, Problem, clip, final_answer

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class Arithmetic(Environment):
    name = "arithmetic"
    family = "math"
    levels = 5

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        make = (_single_digit_sum, _two_digit_sum, _product, _three_operands, _parentheses)[difficulty - 1]
        prompt, value, steps, task = make(rng)
        return Problem(self.name, self.family, difficulty, prompt, str(value), {"task": task}, tuple(steps))

    def grade(self, problem: Problem, response: str) -> tuple[bool, str]:
        got = final_answer(response)
        try:
            correct = int(got) == int(problem.answer)
        except ValueError:  # not an integer (int() also refuses digit strings beyond Python's 4300-digit cap)
            correct = False
        return correct, "" if correct else f"wrong answer: got {clip(got)!r}, want {problem.answer}"


def _single_digit_sum(rng: random.Random):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}", a + b, [f"{a}+{b} = {a + b}"], "add"


def _two_digit_sum(rng: random.Random):
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    tens, ones = b // 10 * 10, b % 10
    partial = _APPLY[op](a, tens)
    value = _APPLY[op](a, b)
    steps = [f"{a}{op}{b} = {a}{op}{tens}{op}{ones}", f"{a}{op}{tens} = {partial}", f"{partial}{op}{ones} = {value}"]
    if ones == 0:
        steps = [f"{a}{op}{b} = {value}"]
    return f"{a}{op}{b}", value, steps, "add" if op == "+" else "subtract"


def _product(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(11, 99)
    tens, ones = b // 10 * 10, b % 10
    prompt = f"{a}*{b}" if rng.random() < 0.5 else f"{b}*{a}"
    steps = [f"{prompt} = {a}*{tens}+{a}*{ones}", f"{a}*{tens} = {a * tens}", f"{a}*{ones} = {a * ones}",
             f"{a * tens}+{a * ones} = {a * b}"]
    if ones == 0:
        steps = [f"{prompt} = {a}*{tens}", f"{a}*{tens} = {a * b}"]
    return prompt, a * b, steps, "multiply"


def _three_operands(rng: random.Random):
    tokens = [rng.randint(1, 20), rng.choice("+-*"), rng.randint(1, 20), rng.choice("+-*"), rng.randint(1, 20)]
    prompt = "".join(map(str, tokens))
    steps = []
    while len(tokens) > 1:
        # Multiplication binds first, then left to right: reduce the first * if any, else the first operator.
        i = tokens.index("*") if "*" in tokens else 1
        tokens[i - 1 : i + 2] = [_APPLY[tokens[i]](tokens[i - 1], tokens[i + 1])]
        steps.append("".join(map(str, tokens)))
    steps = [f"{before} = {after}" for before, after in zip([prompt, *steps], steps)]
    return prompt, tokens[0], steps, "precedence"


def _parentheses(rng: random.Random):
    a, b, c, d = (rng.randint(1, 20) for _ in range(4))
    inner1, inner2, outer = rng.choice("+-"), rng.choice("+-"), rng.choice("+-*")
    left, right = _APPLY[inner1](a, b), _APPLY[inner2](c, d)
    value = _APPLY[outer](left, right)
    right_text = f"({right})" if right < 0 else str(right)  # 7*(-3), not 7*-3
    states = [f"({a}{inner1}{b}){outer}({c}{inner2}{d})", f"{left}{outer}({c}{inner2}{d})",
              f"{left}{outer}{right_text}", str(value)]
    steps = [f"{before} = {after}" for before, after in zip(states, states[1:])]
    return states[0], value, steps, "parentheses"
