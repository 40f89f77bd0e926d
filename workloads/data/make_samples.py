"""Write the sample dataset files shipped in ``workloads/data/`` (run from the repository root:
``.venv/bin/python -m workloads.data.make_samples``; the output is deterministic).

* ``dapo_sample.jsonl`` / ``dapo_sample.parquet``: 12 DAPO-Math-17k-style rows (``prompt`` as
  a list of ``{role, content}``, ``reward_model.ground_truth``, ``data_source``, ``ability``,
  ``extra_info.index``).
* ``swe_gym_sample.jsonl``: one SWE-Gym-style instance whose repository is the bundled
  ``calc_clamp`` task's (``repo_path``), its hidden test as a ``test_patch``, and
  ``FAIL_TO_PASS``/``PASS_TO_PASS`` as JSON strings, as SWE-bench's files hold them.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = HERE.parent / "swe_tasks"

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    '\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)

PROBLEMS = [
    ("What is 17 + 25?", "42"),
    ("A rope is 60 m long. Two pieces of 18 m are cut off. How many metres are left?", "24"),
    ("What is 7 times 8?", "56"),
    ("How many minutes are in 3 hours?", "180"),
    ("What is the sum of the first 10 positive integers?", "55"),
    ("If 3x + 4 = 19, what is x?", "5"),
    ("What is 1000 - 1?", "999"),
    ("A climber ascends 120 m per hour. How many metres does she climb in 2.5 hours?", "300"),
    ("What is the remainder when 100 is divided by 7?", "2"),
    ("How many edges does a cube have?", "12"),
    ("What is 2 to the power 10?", "1024"),
    ("What is the greatest common divisor of 84 and 36?", "12"),
]


def dapo_rows() -> list[dict[str, object]]:
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"sample-{i:02d}"},
        }
        for i, (problem, answer) in enumerate(PROBLEMS)
    ]


def new_file_diff(path: str, data: str) -> str:
    """A unified diff that creates ``path`` with ``data``."""
    lines = data.splitlines(keepends=True)
    body = "".join("+" + ln for ln in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


def swe_gym_rows() -> list[dict[str, object]]:
    task = TASKS / "calc_clamp"
    meta = tomllib.loads((task / "task.toml").read_text())
    hidden = sorted(p for p in (task / "hidden").rglob("*.py"))
    patch = "".join(
        new_file_diff(p.relative_to(task / "hidden").as_posix(), p.read_text()) for p in hidden
    )
    return [
        {
            "instance_id": "belayer__calc-1",
            "repo": "belayer/calc",
            "base_commit": "",
            "problem_statement": meta["problem_statement"].strip(),
            "FAIL_TO_PASS": json.dumps(meta["fail_to_pass"]),
            "PASS_TO_PASS": json.dumps(meta["pass_to_pass"]),
            "test_patch": patch,
            "repo_path": "../swe_tasks/calc_clamp/repo",
            "test_command": "python3 -m pytest -p no:cacheprovider -q --color=no --tb=line -rfEsp {tests}",
        }
    ]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = dapo_rows()
    write_jsonl(HERE / "dapo_sample.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), HERE / "dapo_sample.parquet")
    write_jsonl(HERE / "swe_gym_sample.jsonl", swe_gym_rows())
    print(f"wrote {len(rows)} DAPO rows and 1 SWE-Gym instance to {HERE}")


if __name__ == "__main__":
    main()
