"""`strings` (family "string"): transformations of short random words and number lists.

Levels: 1 uppercase a 3-5 letter word ("upper: cat" -> "CAT"); 2 reverse a 3-6 letter word ("reverse: cat" ->
"tac"); 3 count a letter in a 5-9 letter word over a small alphabet ("count a: abaca" -> "3"); 4 sort the letters
of a 4-7 letter word ("sort letters: cab" -> "abc"); 5 sort 4-7 numbers of 0..99 ("sort: 5 30 9" -> "5 9 30").
The steps are the intermediate states before the answer: the word uppercased letter by letter, the output
growing, the running count after each prefix, the sorted prefix growing.
"""

from __future__ import annotations

import random
import string

from data.envs.base import Environment, Problem, clip, final_answer


class Strings(Environment):
    name = "strings"
    family = "string"
    levels = 5

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        make = (_upper, _reverse, _count, _sort_letters, _sort_numbers)[difficulty - 1]
        task, prompt, answer, steps = make(rng)
        return Problem(self.name, self.family, difficulty, prompt, answer, {"task": task}, tuple(steps))

    def grade(self, problem: Problem, response: str) -> tuple[bool, str]:
        got = final_answer(response)
        if problem.data.get("task") == "sort_numbers":
            got = " ".join(got.split())  # spacing between the numbers is not what is being tested
        correct = got == problem.answer
        return correct, "" if correct else f"wrong answer: got {clip(got)!r}, want {clip(problem.answer)!r}"


def _word(rng: random.Random, low: int, high: int, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def _upper(rng: random.Random):
    word = _word(rng, 3, 5)
    steps = [word[:i].upper() + word[i:] for i in range(1, len(word))]
    return "upper", f"upper: {word}", word.upper(), steps


def _reverse(rng: random.Random):
    word = _word(rng, 3, 6)
    out = word[::-1]
    return "reverse", f"reverse: {word}", out, [out[:i] for i in range(1, len(out))]


def _count(rng: random.Random):
    # A five-letter alphabet makes repeats common, so counts other than 0 and 1 are seen.
    word = _word(rng, 5, 9, "abcde")
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice("abcde")
    steps = [f"{word[:i]} {word[:i].count(letter)}" for i in range(1, len(word) + 1)]
    return "count", f"count {letter}: {word}", str(word.count(letter)), steps


def _sort_letters(rng: random.Random):
    word = _word(rng, 4, 7)
    out = "".join(sorted(word))
    return "sort_letters", f"sort letters: {word}", out, [out[:i] for i in range(1, len(out))]


def _sort_numbers(rng: random.Random):
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(4, 7))]
    out = sorted(numbers)
    states = [" ".join(map(str, out[:i])) for i in range(1, len(out) + 1)]
    return "sort_numbers", "sort: " + " ".join(map(str, numbers)), states[-1], states[:-1]
