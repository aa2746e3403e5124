"""Prompt datasets: verl-format rows (jsonl or parquet) and benchmark adapters, with a resumable cursor.

A verl row has `data_source`, `prompt` (chat messages), `ability`, `reward_model.ground_truth`
and `extra_info`; DAPO-Math-17k and verl/slime datasets load unchanged. Benchmark files with
their own fields (AIME, AMC, MATH-500, GSM8K) go through a named adapter (`DATASET_ADAPTERS`)
that turns each record into a verl row, wrapping the problem in the DAPO instruction prompt.

`PromptDataset` serves prompts in a deterministic order: each epoch is a permutation seeded by
(seed, epoch), and the cursor (epoch, position) is saved and restored for exact resume.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatron_rl.registry import Registry

logger = logging.getLogger(__name__)

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The original DAPO user prompt (shared/data/README.md, note 2)."""


@dataclass(frozen=True, kw_only=True)
class PromptRow:
    """One training or eval prompt.

    prompt_key: f"{dataset name}:{row index}" (0-based index in the file); identifies the prompt
        across steps and epochs (difficulty tracker, dynamic sampling).
    messages: chat messages, each {"role": str, "content": str}.
    ground_truth: the reference answer as a string (verifier input).
    data_source: the row's `data_source` (reward function routing, per-source metrics).
    extra_info: the row's `extra_info` (may be empty).
    origin: where the row came from, for error messages ("FILE: line N" / "FILE: row N").
    """

    prompt_key: str
    messages: list[dict[str, Any]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


class MissingFieldError(KeyError):
    """Raised by an adapter for a record without a field it needs; `.key` names the field."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _require(record: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = record
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur or cur[part] is None:
            raise MissingFieldError(dotted)
        cur = cur[part]
    return cur


Adapter = Callable[[Mapping[str, Any], str, int], dict[str, Any]]
"""(record, dataset name, 0-based row index) -> verl row."""

DATASET_ADAPTERS: Registry[Adapter] = Registry("dataset adapter")


def _dapo_row(source: str, problem: str, answer: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {**extra, "raw_problem": problem},
    }


def _answer_str(value: Any) -> str:
    """Integer-valued floats lose the '.0' (27.0 -> '27'); strings are kept as they are."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer must be a number or string, got {type(value).__name__} {value!r}"[:200])
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


@DATASET_ADAPTERS.register("verl")
def _verl(record: Mapping[str, Any], name: str, index: int) -> dict[str, Any]:
    """verl rows pass through unchanged (fields are checked by `row_from_verl`)."""
    del name, index
    return dict(record)


@DATASET_ADAPTERS.register("aime")
def _aime(record: Mapping[str, Any], name: str, index: int) -> dict[str, Any]:
    """AIME files (`problem`, `answer`): zero-padded string answers such as '023' are kept."""
    extra = {"index": index} | ({"id": record["id"]} if "id" in record else {})
    return _dapo_row(name, str(_require(record, "problem")), _answer_str(_require(record, "answer")), extra)


@DATASET_ADAPTERS.register("amc")
def _amc(record: Mapping[str, Any], name: str, index: int) -> dict[str, Any]:
    """AMC files (`problem`, float `answer`): 27.0 -> '27'."""
    extra = {"index": index} | ({"id": record["id"]} if "id" in record else {})
    return _dapo_row(name, str(_require(record, "problem")), _answer_str(_require(record, "answer")), extra)


@DATASET_ADAPTERS.register("math500")
def _math500(record: Mapping[str, Any], name: str, index: int) -> dict[str, Any]:
    """MATH-500 (`problem`, LaTeX `answer`, `subject`, `level`, `unique_id`)."""
    extra = {"index": index} | {k: record[k] for k in ("subject", "level", "unique_id") if k in record}
    return _dapo_row(name, str(_require(record, "problem")), str(_require(record, "answer")), extra)


@DATASET_ADAPTERS.register("gsm8k")
def _gsm8k(record: Mapping[str, Any], name: str, index: int) -> dict[str, Any]:
    """GSM8K (`question`, worked `answer` ending in '#### N'): ground truth is N without commas."""
    solution = str(_require(record, "answer"))
    if "#### " not in solution:
        raise ValueError(f"gsm8k answer has no '#### ' marker: {solution[-60:]!r}")
    answer = solution.rsplit("#### ", 1)[1].strip().replace(",", "")
    extra = {"index": index} | ({"idx": record["idx"]} if "idx" in record else {})
    return _dapo_row(name, str(_require(record, "question")), answer, extra)


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if hasattr(prompt, "tolist"):  # numpy arrays from some parquet readers
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt must be a non-empty list of chat messages, got {type(prompt).__name__}")
    out = []
    for m in prompt:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"each prompt message needs 'role' and 'content', got {m!r}")
        out.append(dict(m))
    return out


def row_from_verl(row: Mapping[str, Any], prompt_key: str, origin: str = "") -> PromptRow:
    """A `PromptRow` from a verl row.

    Raises:
        MissingFieldError: `prompt` or `reward_model.ground_truth` is missing.
        ValueError: the prompt is not a list of chat messages.
    """
    gt = _require(row, "reward_model.ground_truth")
    messages = _messages(_require(row, "prompt"))
    extra = row.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"extra_info must be an object (mapping), got {type(extra).__name__}")
    for m in messages:
        if not isinstance(m["content"], str):
            raise ValueError(f"prompt message content must be a string, got {type(m['content']).__name__}")
    gt_text = _answer_str(gt)
    if not gt_text.strip():
        raise ValueError("reward_model.ground_truth is empty")
    return PromptRow(
        prompt_key=prompt_key,
        messages=messages,
        ground_truth=gt_text,
        data_source=str(row.get("data_source") or ""),
        extra_info=dict(extra),
        origin=origin,
    )


def _numbered_records(path: str | Path) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """("line" or "row", [(1-based line or row number, record)]) of a .jsonl or .parquet file."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return "row", list(enumerate(pq.read_table(p).to_pylist(), start=1))
    if p.suffix != ".jsonl":
        raise ValueError(f"{p}: dataset files must be .jsonl or .parquet")
    out = []
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            out.append((lineno, rec))
    return "line", out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a .jsonl (one JSON object a line; blank lines skipped) or .parquet file.

    Raises:
        ValueError: unknown suffix, or a jsonl line that is not a JSON object (names line number).
    """
    return [rec for _, rec in _numbered_records(path)[1]]


def load_rows(path: str | Path, *, adapter: str = "verl", name: str | None = None) -> list[PromptRow]:
    """All rows of a dataset file as `PromptRow`s.

    Args:
        path: .jsonl or .parquet file.
        adapter: a name in `DATASET_ADAPTERS` (verl, aime, amc, math500, gsm8k).
        name: dataset name used in prompt keys and adapter data_source; default the file stem.
    Raises:
        KeyError: unknown adapter (lists the valid ones).
        ValueError: a row misses a required field or is malformed; the message names the file,
            the row's 1-based line (jsonl; blank lines count) or row (parquet) number and the
            missing key.
    """
    fn = DATASET_ADAPTERS.get(adapter)
    p = Path(path)
    name = name or p.stem
    rows = []
    unit, records = _numbered_records(p)
    for i, (number, rec) in enumerate(records):
        try:
            rows.append(row_from_verl(fn(rec, name, i), f"{name}:{i}", origin=f"{p}: {unit} {number}"))
        except MissingFieldError as e:
            raise ValueError(f"{p}: {unit} {number}: missing required key {e.key!r}") from None
        except ValueError as e:
            raise ValueError(f"{p}: {unit} {number}: {e}") from None
    logger.info("loaded %d rows from %s (adapter %s)", len(rows), p, adapter)
    return rows


class PromptDataset:
    """Prompts in a deterministic per-epoch order with a resumable cursor.

    Epoch e visits every row once, in a permutation seeded by (seed, e) (identity order when
    `shuffle` is False). `next_batch(n)` continues across epoch boundaries; the cursor is
    normalised so that after the last row of an epoch it reads (epoch + 1, 0): a checkpoint
    written at an epoch boundary resumes into the next epoch.
    """

    def __init__(self, rows: Sequence[PromptRow], *, seed: int = 0, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("PromptDataset needs at least one row")
        self.rows = list(rows)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @classmethod
    def from_file(cls, path: str | Path, *, adapter: str = "verl", name: str | None = None,
                  seed: int = 0, shuffle: bool = True) -> "PromptDataset":
        """`PromptDataset(load_rows(path, adapter=adapter, name=name), seed=seed, shuffle=shuffle)`."""
        return cls(load_rows(path, adapter=adapter, name=name), seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` visits them."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            # String seeds hash with sha512 in `random`: stable across processes and runs.
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next `n` prompts (n >= 1), advancing the cursor; may span an epoch boundary."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out = []
        while len(out) < n:
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
            take = min(n - len(out), len(self.rows) - self.position)
            out.extend(self.rows[i] for i in self._order[self.position : self.position + take])
            self.position += take
            if self.position == len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        """Cursor and identity: {"epoch", "position", "seed", "num_rows", "shuffle"}."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_rows": len(self.rows), "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores the cursor.

        Raises:
            ValueError: the state belongs to a dataset with another seed, size or shuffle
                setting, or the position is out of range.
        """
        for key, mine in (("seed", self.seed), ("num_rows", len(self.rows)), ("shuffle", int(self.shuffle))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"dataset state has {key}={state[key]}, this dataset has {mine}")
        if not 0 <= int(state["position"]) < len(self.rows) or int(state["epoch"]) < 0:
            raise ValueError(f"invalid dataset cursor {dict(state)!r} for {len(self.rows)} rows")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
