"""Generated bug-fix tasks for the ``swe`` workload: a tiny repository (one module of a few
functions, one visible test file) with one bug of a known *family*, hidden tests, and the
reference fix as the one ``sed -i`` a human would type.

An instance is a pure function of ``(family, split, index)``: the seed is a digest of the
three, the family (``workloads.swe_families``) draws the buggy function, the generator adds
one or two correct helpers around it, picks a layout (``mod.py`` or ``pkg/mod.py``; tests in
``tests/`` or at the top) and writes the tests from what the fixed and the buggy module really
return (both are executed here, so a statement's "returns X" is what the code returns).

Splits (``SPLITS``):

* ``train`` — instances of the training families, names and constants from the training pools;
* ``heldout-instance`` — the same families, names and constants from the held-out pools (no
  held-out identifier or bug constant appears in any training instance);
* ``heldout-family`` — the held-out families (fixes never trained on), held-out pools.

Task ids are ``gen-<family>-<t|i|f>-<index>`` (``instance_id``); ``parse_instance_id`` reads
them back, so ``SweWorkload.task(id)`` regenerates any instance.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from common.errors import InvalidRequest
from workloads.swe_families import (
    HELD_OUT_FAMILIES,
    HELD_OUT_POOLS,
    TRAIN_FAMILIES,
    TRAIN_POOLS,
    Args,
    Case,
    Draw,
    Family,
    filler,
)

SPLITS = {"train": "t", "heldout-instance": "i", "heldout-family": "f"}
"""Split name → the tag in a task id."""

FAMILIES: dict[str, Family] = {**TRAIN_FAMILIES, **HELD_OUT_FAMILIES}
"""Every family by name."""

HELD_OUT_PATTERN = ("heldout-instance", "heldout-family", "heldout-instance")
"""The fixed held-out list repeats this: two held-out instances to one held-out family."""

_ID = re.compile(r"gen-(?P<family>[a-z_]+)-(?P<tag>[tif])-(?P<index>0|[1-9][0-9]{0,11})")
_ATTEMPTS = 20


@dataclass(frozen=True)
class Instance:
    """One generated bug-fix task, before it becomes a ``workloads.base.Task``."""

    id: str
    """``gen-<family>-<t|i|f>-<index>``."""
    family: str
    """The bug family."""
    split: str
    """``train``, ``heldout-instance`` or ``heldout-family``."""
    statement: str
    """The problem statement (the call, what it returns, what it should, the file to fix)."""
    files: dict[str, bytes]
    """The repository the agent starts from (relative path → bytes)."""
    hidden: dict[str, bytes]
    """The hidden test file(s), never in ``files``."""
    fail_to_pass: list[str]
    """Tests that fail before the fix (the visible failing one first)."""
    pass_to_pass: list[str]
    """Tests that pass before and after."""
    fix: str
    """The reference fix: one ``sed -i`` on the module."""
    pattern_fix: str
    """The same fix naming nothing of the instance (``pattern_fix``): the family's ``sed -E``
    script on every ``.py`` file of the repository."""
    module: str
    """The path of the module with the bug."""
    fixed: bytes
    """That module after the fix (what ``fix`` makes of it)."""
    names: tuple[str, ...]
    """Every identifier the instance chose (module, package, functions, variables)."""
    values: tuple[int, ...]
    """The bug's constants."""


def instance_id(family: str, split: str, index: int) -> str:
    """The task id of an instance."""
    return f"gen-{family}-{SPLITS[split]}-{index}"


def parse_instance_id(task_id: str) -> tuple[str, str, int] | None:
    """(family, split, index) of a generated task id; ``None`` if it is not one (or names a
    family in a split it has no instances in)."""
    m = _ID.fullmatch(task_id)
    if not m or m["family"] not in FAMILIES:
        return None
    split = next(s for s, tag in SPLITS.items() if tag == m["tag"])
    if (split == "heldout-family") != (m["family"] in HELD_OUT_FAMILIES):
        return None
    return m["family"], split, int(m["index"])


def mean_by_split(rewards: dict[str, float]) -> dict[str, float]:
    """Task id → reward (a run's ``heldout_rewards``) as the mean reward of each split the
    generated ids among them belong to (``heldout-instance``, ``heldout-family``, ``train``);
    ids that are not generated ones are left out."""
    groups: dict[str, list[float]] = {}
    for task_id, reward in rewards.items():
        found = parse_instance_id(task_id)
        if found is not None:
            groups.setdefault(found[1], []).append(reward)
    return {split: sum(v) / len(v) for split, v in sorted(groups.items())}


def training_ids(count: int, seed: int = 0) -> list[str]:
    """``count`` training instances: round ``r`` takes instance ``seed·10⁶ + r`` of every
    training family, the families in an order shuffled by ``(seed, r)``."""
    families = sorted(TRAIN_FAMILIES)
    out: list[str] = []
    r = 0
    while len(out) < count:
        order = list(families)
        random.Random(f"order:{seed}:{r}").shuffle(order)
        out += [instance_id(f, "train", seed * 1_000_000 + r) for f in order]
        r += 1
    return out[:count]


def held_out_ids(count: int) -> list[str]:
    """The fixed held-out list's first ``count`` ids: ``HELD_OUT_PATTERN`` repeated, held-out
    instances cycling through the training families, held-out families through theirs."""
    cycles = {
        "heldout-instance": sorted(TRAIN_FAMILIES),
        "heldout-family": sorted(HELD_OUT_FAMILIES),
    }
    seen = dict.fromkeys(cycles, 0)
    out = []
    for k in range(count):
        split = HELD_OUT_PATTERN[k % len(HELD_OUT_PATTERN)]
        families = cycles[split]
        n = seen[split]
        out.append(instance_id(families[n % len(families)], split, n // len(families)))
        seen[split] += 1
    return out


def sed_fix(old: str, new: str, path: str) -> str:
    """``sed -i 's/OLD/NEW/' PATH`` with OLD and NEW escaped for a basic regex."""
    pattern = re.sub(r"([\\.*\[\]^$/])", r"\\\1", old)
    replacement = re.sub(r"([\\&/])", r"\\\1", new)
    if "'" in old + new or "\n" in old + new:
        raise InvalidRequest("a fix fragment holds a quote or a newline", old=old, new=new)
    return f"sed -i 's/{pattern}/{replacement}/' {path}"


def pattern_fix(script: str) -> str:
    """``find . -name '*.py' -exec sed -i -E 'SCRIPT' {} +``: a family's name-free fix
    (``Case.pattern``) applied to every Python file of the repository (the script matches only
    the buggy line's shape, so the others come out unchanged)."""
    if not script or "'" in script:
        raise InvalidRequest(
            "a pattern fix must be a non-empty script without quotes", script=script
        )
    return f"find . -name '*.py' -exec sed -i -E '{script}' {{}} +"


def _call(function: str, args: Args) -> str:
    return f"{function}({', '.join(map(repr, args))})"


def _run(source: str, function: str, args: Args) -> object:
    space: dict[str, object] = {}
    exec(compile(source, "<generated>", "exec"), space)  # our own generated code
    fn = space[function]
    assert callable(fn)
    return fn(*args)


def _test(name: str, function: str, args: Args, want: object) -> str:
    return f"def {name}():\n    assert {_call(function, args)} == {want!r}\n"


@dataclass(frozen=True)
class _Layout:
    module: str  # the module's path
    package: str  # its package directory ("" for a top-level module)
    import_from: str  # what the tests import from
    tests: str  # the test directory with its slash ("" for the top level)


def _layout(d: Draw) -> _Layout:
    mod = d.noun()
    package = d.noun() if d.rng.random() < 0.5 else ""
    tests = "tests/" if d.rng.random() < 0.5 else ""
    path = f"{package}/{mod}.py" if package else f"{mod}.py"
    return _Layout(path, package, f"{package}.{mod}" if package else mod, tests)


def _module(d: Draw, case: Case) -> tuple[str, str, list[tuple[str, Args]]]:
    """(buggy source, fixed source, the helpers' calls): one helper before the function, and
    one after it half of the time."""
    before, h1, c1 = filler(d)
    parts, helpers = [before, case.lines], [(h1, c) for c in c1]
    if d.rng.random() < 0.5:
        after, h2, c2 = filler(d)
        parts.append(after)
        helpers += [(h2, c) for c in c2]
    blank = ["", ""]
    lines = [*parts[0], *blank, *parts[1], *([*blank, *parts[2]] if len(parts) > 2 else [])]
    at = len(parts[0]) + 2 + case.line
    buggy = "\n".join(lines) + "\n"
    fixed_lines = list(lines)
    fixed_lines[at] = lines[at].replace(case.old, case.new, 1)
    return buggy, "\n".join(fixed_lines) + "\n", helpers


def _draw(family: str, split: str, index: int, attempt: int) -> tuple[Draw, Case, _Layout]:
    seed = hashlib.sha256(f"swe-gen:{family}:{split}:{index}:{attempt}".encode()).digest()
    pools = TRAIN_POOLS if split == "train" else HELD_OUT_POOLS
    d = Draw(random.Random(int.from_bytes(seed[:8], "big")), pools)
    layout = _layout(d)
    return d, FAMILIES[family](d), layout


def instance(family: str, split: str, index: int) -> Instance:
    """The instance ``(family, split, index)``; ``InvalidRequest`` for a family the split does
    not hold or a negative index."""
    tid = instance_id(family, split, index) if split in SPLITS else ""
    if not tid or index < 0 or parse_instance_id(tid) != (family, split, index):
        raise InvalidRequest("no such generated instance", family=family, split=split, index=index)
    for attempt in range(_ATTEMPTS):  # a draw whose fragment is not unique is drawn again
        d, case, layout = _draw(family, split, index, attempt)
        buggy, fixed, helpers = _module(d, case)
        if buggy.count(case.old) == 1:
            return _assemble(tid, family, split, d, case, layout, buggy, fixed, helpers)
    raise AssertionError(f"no unique bug fragment for {tid}")  # pragma: no cover


def _assemble(
    tid: str,
    family: str,
    split: str,
    d: Draw,
    case: Case,
    layout: _Layout,
    buggy: str,
    fixed: str,
    helpers: list[tuple[str, Args]],
) -> Instance:
    f = case.function
    wants = [_run(fixed, f, a) for a in case.fails + case.keeps]
    gots = [_run(buggy, f, a) for a in case.fails + case.keeps]
    n = len(case.fails)
    assert all(w != g for w, g in zip(wants[:n], gots[:n], strict=True)), tid
    assert wants[n:] == gots[n:], tid
    helper_tests = [(f"test_{h}", h, a, _run(fixed, h, a)) for h, a in helpers]
    visible_name = f"{layout.tests}test_{layout.module.rsplit('/', 1)[-1]}"
    hidden_name = f"{layout.tests}test_{f}.py"
    hidden_tests = [
        (f"test_{f}_{k}", f, a, w)
        for k, (a, w) in enumerate(zip(case.fails[1:], wants[1:n], strict=True))
    ]
    kept = [
        (f"test_{f}_keeps_{k}", f, a, w)
        for k, (a, w) in enumerate(zip(case.keeps, wants[n:], strict=True))
    ]
    first = (f"test_{f}", f, case.fails[0], wants[0])
    imports = sorted({f, *(h for h, _ in helpers)})
    head = f"from {layout.import_from} import {', '.join(imports)}\n"
    visible = head + "".join("\n\n" + _test(*t) for t in [*helper_tests, first])
    hidden = head + "".join("\n\n" + _test(*t) for t in [*hidden_tests, *kept])
    files = {layout.module: buggy.encode(), visible_name: visible.encode()}
    if layout.package:
        files[f"{layout.package}/__init__.py"] = b""
    statement = (
        f"{_call(f, case.fails[0])} returns {gots[0]!r} but should return {wants[0]!r}: "
        f"{case.intent}. Fix {layout.module}."
    )
    return Instance(
        id=tid,
        family=family,
        split=split,
        statement=statement,
        files=files,
        hidden={hidden_name: hidden.encode()},
        fail_to_pass=[
            f"{visible_name}::{first[0]}",
            *(f"{hidden_name}::{t[0]}" for t in hidden_tests),
        ],
        pass_to_pass=[
            *(f"{visible_name}::{t[0]}" for t in helper_tests),
            *(f"{hidden_name}::{t[0]}" for t in kept),
        ],
        fix=sed_fix(case.old, case.new, layout.module),
        pattern_fix=pattern_fix(case.pattern),
        module=layout.module,
        fixed=fixed.encode(),
        names=tuple(w for w in d.used if w),
        values=tuple(d.values),
    )
