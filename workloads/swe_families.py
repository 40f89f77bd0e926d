"""The bug families of the generated SWE tasks (``workloads.swe_gen``): each family turns a
seeded random source and a pool of names into one buggy function (a ``Case``): its lines, the
fragment of one line the bug changed and what it must be, what the function should do in
words, and the calls whose results the bug changes and the ones it does not.

Everything here is pure and deterministic in the ``random.Random`` it is given. The names and
the bug's constants come from a ``Pools`` of one split only (``names_of`` / ``values_of``), so
a held-out instance shares no identifier and no constant of its bug with any training one.
"""

from __future__ import annotations

import builtins
import keyword
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

Args = tuple[object, ...]
"""The arguments of one call of the function under test (Python literals)."""


@dataclass(frozen=True)
class Case:
    """One buggy function, as a family made it."""

    lines: list[str]
    """The function's source lines, with the bug."""
    line: int
    """Index in ``lines`` of the line that holds the bug."""
    old: str
    """The fragment of that line that is wrong (it occurs once in the module)."""
    new: str
    """What ``old`` must be: the fixed line is the buggy one with ``old`` replaced."""
    function: str
    """The function's name."""
    intent: str
    """What the function should do, in words (the problem statement's second half)."""
    fails: list[Args]
    """Calls whose result the bug changes (the first is the one the statement names)."""
    keeps: list[Args]
    """Calls whose result the bug leaves alone (pass-to-pass)."""
    values: list[int] = field(default_factory=list)
    """The bug's own constants (kept disjoint between splits)."""
    pattern: str = ""
    """The fix as a GNU ``sed -E`` script that names nothing of the instance: it finds the
    buggy line by its shape and keeps the names it matched (``swe_gen.pattern_fix``). The same
    script for every instance of the family, but for what the statement says (the operator a
    ``wrong_operator`` function must apply, the constant of ``wrong_constant`` and
    ``wrong_default``)."""


# --- name and value pools ------------------------------------------------------------------
NOUNS = (
    "ledger orchard harbor meadow lantern quarry summit canyon galaxy beacon pillar compass "
    "tundra vessel citadel prairie glacier orbit furnace bazaar atlas marina cobalt ember "
    "falcon garnet hollow island jasper kettle lagoon mosaic nectar oasis pebble quiver "
    "rampart saddle timber umber valley walrus yonder zephyr anvil basalt cedar delta estuary "
    "fjord grove heron ivory juniper kiln lotus mantle nebula onyx plume quartz reef spire "
    "thicket bramble cairn dune"
).split()
"""Module, package and function-name words; even positions train (beside ``MADE_UP_NOUNS``),
odd ones are held out."""

WORDS = (
    "qty rate span edge mark base peak gap load cost size step tick unit dose fee pay rank "
    "seat lane bulk cap dim era fold grip hue ink jot keel lug nib orb pip rim sap tab urn vat "
    "wad yam zed axle bolt coil dent etch flux glow hilt knob lamp mesh node oath pane quay "
    "rung silo tusk vane wick"
).split()
"""Variable names; even positions train (beside ``MADE_UP_WORDS``), odd ones are held out."""

NUMBERS = tuple(range(2, 64))
"""The bugs' constants: those not divisible by 3 train, multiples of 3 are held out."""

_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | set(sys.stdlib_module_names)
assert not _RESERVED & (set(NOUNS) | set(WORDS)), "a pool word shadows Python"
assert len(set(NOUNS)) == len(NOUNS) and len(set(WORDS)) == len(WORDS)


@dataclass(frozen=True)
class Pools:
    """The names and constants one split draws from."""

    nouns: tuple[str, ...]
    words: tuple[str, ...]
    numbers: tuple[int, ...]


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def made_up(count: int, syllables: tuple[int, ...], seed: str) -> tuple[str, ...]:
    """``count`` distinct pronounceable made-up words (consonant-vowel syllables, a closing
    consonant half of the time), ``syllables`` long each, drawn from ``seed``: none is a pool
    word, a Python keyword, builtin or module name."""
    rng = random.Random(seed)
    taken = set(NOUNS) | set(WORDS) | _RESERVED
    out: list[str] = []
    while len(out) < count:
        n = rng.choice(syllables)
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n))
        if rng.random() < 0.5:
            word += rng.choice(_CONSONANTS)
        if word not in taken:
            taken.add(word)
            out.append(word)
    return tuple(out)


MADE_UP_NOUNS = made_up(1000, (2, 3), "swe-nouns")
"""Training-only module/package/function words besides ``NOUNS[0::2]``: so many that a model
cannot learn them by heart and has to copy the one in front of it."""
MADE_UP_WORDS = made_up(1000, (1, 2), "swe-words")
"""Training-only variable names besides ``WORDS[0::2]`` (the same reason)."""

TRAIN_POOLS = Pools(
    tuple(NOUNS[0::2]) + MADE_UP_NOUNS,
    tuple(WORDS[0::2]) + MADE_UP_WORDS,
    tuple(n for n in NUMBERS if n % 3),
)
"""What training instances draw from."""
HELD_OUT_POOLS = Pools(
    tuple(NOUNS[1::2]), tuple(WORDS[1::2]), tuple(n for n in NUMBERS if n % 3 == 0)
)
"""What held-out instances (of either kind) draw from."""


class Draw:
    """An instance's random choices: names never repeat within the instance."""

    def __init__(self, rng: random.Random, pools: Pools) -> None:
        self.rng = rng
        self.pools = pools
        self.used: list[str] = []
        self.values: list[int] = []

    def word(self) -> str:
        """A fresh variable name."""
        return self._fresh(self.pools.words)

    def noun(self) -> str:
        """A fresh module/package/name word."""
        return self._fresh(self.pools.nouns)

    def name(self, verbs: tuple[str, ...]) -> str:
        """A fresh function name: one of ``verbs``, ``_``, a fresh noun."""
        name = f"{self.rng.choice(verbs)}_{self.noun()}"
        self.used.append(name)
        return name

    def number(self, avoid: tuple[int, ...] = ()) -> int:
        """One of the split's constants (recorded as a value of the bug)."""
        n = self.rng.choice([x for x in self.pools.numbers if x not in avoid])
        self.values.append(n)
        return n

    def _fresh(self, pool: tuple[str, ...]) -> str:
        word = self.rng.choice([w for w in pool if w not in self.used])
        self.used.append(word)
        return word


# --- the families --------------------------------------------------------------------------
def off_by_one(d: Draw) -> Case:
    f, lo, hi, acc, i = d.name(("sum", "total", "add")), d.word(), d.word(), d.word(), d.word()
    a = d.rng.randint(1, 5)
    return Case(
        lines=[
            f"def {f}({lo}, {hi}):",
            f"    {acc} = 0",
            f"    for {i} in range({lo}, {hi}):",
            f"        {acc} += {i}",
            f"    return {acc}",
        ],
        line=2,
        old=f"range({lo}, {hi})",
        new=f"range({lo}, {hi} + 1)",
        function=f,
        intent=f"{f}({lo}, {hi}) must add every integer from {lo} to {hi}, both included",
        fails=[(a, a + d.rng.randint(2, 4)), (a + 3, a + 6), (a, a)],
        keeps=[(a + 4, a + 1)],
        pattern=r"s/range\(([a-z_]+), ([a-z_]+)\)/range(\1, \2 + 1)/",
    )


_OPS = {"+": "the sum of", "-": "the difference", "*": "the product of"}


def wrong_operator(d: Draw) -> Case:
    f, a, b = d.name(("combine", "merge", "join")), d.word(), d.word()
    want, got = d.rng.choice([("+", "-"), ("-", "+"), ("*", "+"), ("+", "*"), ("*", "-")])
    what = f"{a} minus {b}" if want == "-" else f"{_OPS[want]} {a} and {b}"
    x, y = d.rng.randint(4, 9), d.rng.randint(3, 7)
    return Case(
        lines=[f"def {f}({a}, {b}):", f"    return {a} {got} {b}"],
        line=1,
        old=f"{a} {got} {b}",
        new=f"{a} {want} {b}",
        function=f,
        intent=f"{f}({a}, {b}) must return {what}",
        fails=[(x, y), (y + 5, x)],
        keeps=[(2, 2)] if {want, got} == {"+", "*"} else [],
        pattern=rf"s/return ([a-z_]+) [-+*] ([a-z_]+)$/return \1 {want} \2/",
    )


def wrong_constant(d: Draw) -> Case:
    f, x, const = d.name(("scale", "convert", "grow")), d.word(), d.word().upper()
    good = d.number()
    bad = d.number(avoid=(good,))
    return Case(
        lines=[f"{const} = {bad}", "", "", f"def {f}({x}):", f"    return {x} * {const}"],
        line=0,
        old=f"{const} = {bad}",
        new=f"{const} = {good}",
        function=f,
        intent=f"{f}({x}) must multiply {x} by {good}",
        fails=[(d.rng.randint(2, 9),), (d.rng.randint(11, 20),)],
        keeps=[(0,)],
        values=[good, bad],
        pattern=rf"s/^([A-Z_]+) = [0-9]+$/\1 = {good}/",
    )


_PARAMS3 = r"\(([a-z_]+), ([a-z_]+), ([a-z_]+)\):\n    return "
_CLAMP_PATTERN = (
    r"/^def [a-z_]+\([a-z_]+, [a-z_]+, [a-z_]+\):$/{N;"
    rf"s/{_PARAMS3}max\(\2, \1\)$/(\1, \2, \3):\n    return max(\2, min(\1, \3))/;"
    rf"s/{_PARAMS3}min\(\3, \1\)$/(\1, \2, \3):\n    return min(\3, max(\1, \2))/}}"
)
"""``missing_clamp``'s fix for either missing bound: the ``def`` line with its three parameters
and the ``return`` line after it, the missing bound added from the parameters."""


def missing_clamp(d: Draw) -> Case:
    f, v, lo, hi = d.name(("clamp", "limit", "bound")), d.word(), d.word(), d.word()
    top = d.rng.randint(8, 20)
    if d.rng.random() < 0.5:  # the upper bound is missing
        old, new = f"max({lo}, {v})", f"max({lo}, min({v}, {hi}))"
        fails: list[Args] = [(top + 5, 0, top), (top * 3, 1, top)]
        keeps: list[Args] = [(top - 2, 0, top), (-4, 0, top)]
    else:  # the lower bound is missing
        old, new = f"min({hi}, {v})", f"min({hi}, max({v}, {lo}))"
        fails = [(-5, 0, top), (-1, 2, top)]
        keeps = [(top - 2, 0, top), (top + 4, 0, top)]
    return Case(
        lines=[f"def {f}({v}, {lo}, {hi}):", f"    return {old}"],
        line=1,
        old=old,
        new=new,
        function=f,
        intent=f"{f}({v}, {lo}, {hi}) must limit {v} to the range {lo}..{hi}",
        fails=fails,
        keeps=keeps,
        pattern=_CLAMP_PATTERN,
    )


def swapped_args(d: Draw) -> Case:
    g, p, q = d.name(("gap", "less", "drop")), d.word(), d.word()
    f, a, b = d.name(("span", "reach", "rest")), d.word(), d.word()
    x, y = d.rng.randint(8, 15), d.rng.randint(1, 6)
    return Case(
        lines=[
            f"def {g}({p}, {q}):",
            f"    return {p} - {q}",
            "",
            "",
            f"def {f}({a}, {b}):",
            f"    return {g}({b}, {a})",
        ],
        line=5,
        old=f"{g}({b}, {a})",
        new=f"{g}({a}, {b})",
        function=f,
        intent=f"{f}({a}, {b}) must return {g}({a}, {b}), that is {a} minus {b}",
        fails=[(x, y), (y, x + 2)],
        keeps=[(y, y)],
        pattern=r"/^def /{N;s/\(([a-z_]+), ([a-z_]+)\):\n    return ([a-z_]+)\(\2, \1\)$/"
        r"(\1, \2):\n    return \3(\1, \2)/}",
    )


def wrong_default(d: Draw) -> Case:
    f, x, k = d.name(("repeat", "stretch", "boost")), d.word(), d.word()
    good = d.number()
    bad = d.number(avoid=(good,))
    return Case(
        lines=[f"def {f}({x}, {k}={bad}):", f"    return {x} * {k}"],
        line=0,
        old=f"{k}={bad}",
        new=f"{k}={good}",
        function=f,
        intent=f"{f}({x}) without {k} must use {k} = {good}",
        fails=[(d.rng.randint(2, 9),), (d.rng.randint(11, 30),)],
        keeps=[(3, 5)],
        values=[good, bad],
        pattern=rf"s/=[0-9]+\):$/={good}):/",
    )


def inverted_condition(d: Draw) -> Case:
    f, xs, t, out, x = d.name(("keep", "pick", "select")), d.word(), d.word(), d.word(), d.word()
    lows = [d.rng.randint(0, 4) for _ in range(2)]
    highs = [d.rng.randint(10, 19) for _ in range(2)]
    return Case(
        lines=[
            f"def {f}({xs}, {t}):",
            f"    {out} = []",
            f"    for {x} in {xs}:",
            f"        if {x} < {t}:",
            f"            {out}.append({x})",
            f"    return {out}",
        ],
        line=3,
        old=f"{x} < {t}",
        new=f"{x} > {t}",
        function=f,
        intent=f"{f}({xs}, {t}) must keep the items of {xs} greater than {t}",
        fails=[([lows[0], highs[0], highs[1]], 7), ([highs[1], lows[1]], 5)],
        keeps=[([], 3), ([7, 7], 7)],
        pattern=r"s/if ([a-z_]+) < ([a-z_]+):$/if \1 > \2:/",
    )


def wrong_return(d: Draw) -> Case:
    f, xs, best, pos, i, x = (d.name(("argmax", "locate", "where")), *[d.word() for _ in "abcde"])
    top = d.rng.randint(10, 30)
    return Case(
        lines=[
            f"def {f}({xs}):",
            f"    {best} = {xs}[0]",
            f"    {pos} = 0",
            f"    for {i}, {x} in enumerate({xs}):",
            f"        if {x} > {best}:",
            f"            {best} = {x}",
            f"            {pos} = {i}",
            f"    return {best}",
        ],
        line=7,
        old=f"return {best}",
        new=f"return {pos}",
        function=f,
        intent=f"{f}({xs}) must return the position of the largest item of {xs}",
        fails=[([3, top, 4],), ([1, 2, top + 5],)],
        keeps=[([0, -2, -5],)],
        pattern=_RETURN_PATTERN,
    )


_RETURN_PATTERN = r"/^            [a-z_]+ = [a-z_]+$/h;/^    return [a-z_]+$/{g;s/^ +([a-z_]+) = .*/    return \1/}"
"""``wrong_return``'s fix: the function returns the variable the loop last assigned (held from
the deepest-indented assignment line) instead of the one it returns."""


def extra_negation(d: Draw) -> Case:
    f, n, k = d.name(("divides", "fits", "splits")), d.word(), d.word()
    m = d.rng.randint(2, 7)
    return Case(
        lines=[f"def {f}({n}, {k}):", f"    return not {n} % {k} == 0"],
        line=1,
        old=f"not {n} % {k}",
        new=f"{n} % {k}",
        function=f,
        intent=f"{f}({n}, {k}) must be True when {k} divides {n}",
        fails=[(m * 3, m), (m * 2 + 1, m)],
        keeps=[],
        pattern="s/return not /return /",
    )


def wrong_index(d: Draw) -> Case:
    f, text, parts = d.name(("first", "head", "lead")), d.word(), d.word()
    sep = d.rng.choice([",", ";", ":", "|"])
    fields = [d.rng.choice(["red", "blue", "green", "gold", "grey"]) + str(j) for j in range(3)]
    return Case(
        lines=[
            f"def {f}({text}):",
            f'    {parts} = {text}.split("{sep}")',
            f"    return {parts}[1]",
        ],
        line=2,
        old=f"{parts}[1]",
        new=f"{parts}[0]",
        function=f,
        intent=f'{f}({text}) must return the first field of {text} (fields are split by "{sep}")',
        fails=[(sep.join(fields),), (sep.join(fields[1:]),)],
        keeps=[],
        pattern=r"s/\[1\]$/[0]/",
    )


def boundary(d: Draw) -> Case:
    f, n, limit = d.name(("reaches", "passes", "meets")), d.word(), d.number()
    return Case(
        lines=[f"def {f}({n}):", f"    return {n} > {limit}"],
        line=1,
        old=f"{n} > {limit}",
        new=f"{n} >= {limit}",
        function=f,
        intent=f"{f}({n}) must be True for {n} of {limit} or more",
        fails=[(limit,)],
        keeps=[(limit + 3,), (limit - 2,)],
        values=[limit],
        pattern=r"s/return ([a-z_]+) > ([0-9]+)$/return \1 >= \2/",
    )


# held-out families: fixes no training instance shows
def wrong_init(d: Draw) -> Case:
    f, xs, acc, x = d.name(("tally", "count", "gather")), d.word(), d.word(), d.word()
    nums = [d.rng.randint(1, 9) for _ in range(3)]
    return Case(
        lines=[
            f"def {f}({xs}):",
            f"    {acc} = 1",
            f"    for {x} in {xs}:",
            f"        {acc} += {x}",
            f"    return {acc}",
        ],
        line=1,
        old=f"{acc} = 1",
        new=f"{acc} = 0",
        function=f,
        intent=f"{f}({xs}) must return the sum of the items of {xs}",
        fails=[(nums,), ([],)],
        keeps=[],
        pattern=r"s/^    ([a-z_]+) = 1$/    \1 = 0/",
    )


def missing_abs(d: Draw) -> Case:
    f, a, b = d.name(("distance", "apart", "offset")), d.word(), d.word()
    x, y = d.rng.randint(1, 5), d.rng.randint(8, 15)
    return Case(
        lines=[f"def {f}({a}, {b}):", f"    return {a} - {b}"],
        line=1,
        old=f"{a} - {b}",
        new=f"abs({a} - {b})",
        function=f,
        intent=f"{f}({a}, {b}) must return how far apart {a} and {b} are (never negative)",
        fails=[(x, y), (0, y)],
        keeps=[(y, x)],
        pattern=r"s/return ([a-z_]+) - ([a-z_]+)$/return abs(\1 - \2)/",
    )


def string_case(d: Draw) -> Case:
    f, s = d.name(("normal", "tidy", "plain")), d.word()
    words = [d.rng.choice(["Rock", "Tree", "Moon", "Star", "Wave"]) for _ in range(2)]
    return Case(
        lines=[f"def {f}({s}):", f"    return {s}.strip().upper()"],
        line=1,
        old=".upper()",
        new=".lower()",
        function=f,
        intent=f"{f}({s}) must return {s} without surrounding spaces, in lower case",
        fails=[(f" {words[0]} ",), (words[1],)],
        keeps=[("  ",)],
        pattern=r"s/\.upper\(\)/.lower()/",
    )


Family = Callable[[Draw], Case]
"""A bug family: the buggy function of one instance from its random draw."""

TRAIN_FAMILIES: dict[str, Family] = {
    "off_by_one": off_by_one,
    "wrong_operator": wrong_operator,
    "wrong_constant": wrong_constant,
    "missing_clamp": missing_clamp,
    "swapped_args": swapped_args,
    "wrong_default": wrong_default,
    "inverted_condition": inverted_condition,
    "wrong_return": wrong_return,
    "extra_negation": extra_negation,
    "wrong_index": wrong_index,
    "boundary": boundary,
}
"""Families with training instances (and held-out instances)."""

HELD_OUT_FAMILIES: dict[str, Family] = {
    "wrong_init": wrong_init,
    "missing_abs": missing_abs,
    "string_case": string_case,
}
"""Families never trained on: every instance is held out."""


# --- correct helpers around the buggy function (pass-to-pass tests) -------------------------
def filler(d: Draw) -> tuple[list[str], str, list[Args]]:
    """A small correct function: (its lines, its name, calls for its tests)."""
    kind = d.rng.randrange(4)
    if kind == 0:
        f, x = d.name(("double", "twice")), d.word()
        return [f"def {f}({x}):", f"    return {x} * 2"], f, [(d.rng.randint(2, 9),)]
    if kind == 1:
        f, xs = d.name(("size", "length")), d.word()
        return [f"def {f}({xs}):", f"    return len({xs})"], f, [([1, 2, 3],)]
    if kind == 2:
        f, a, b = d.name(("lower", "smaller")), d.word(), d.word()
        return [f"def {f}({a}, {b}):", f"    return min({a}, {b})"], f, [(4, 9)]
    f, s = d.name(("trim", "clean")), d.word()
    return [f"def {f}({s}):", f"    return {s}.strip()"], f, [(" ok ",)]
