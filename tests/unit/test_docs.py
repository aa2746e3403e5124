"""The documentation stays true: links resolve, the configuration page is current, shown commands run.

Checked pages: README.md, docs/*.md, and the READMEs under examples/, slurm/ and benchmarks/.

- Links: every relative markdown link `[text](target)` names an existing file or folder, and every
  `#anchor` (in the same page or another markdown page) names one of its headings, slugged as GitHub
  does. External links (`http:`, `https:`, `mailto:`) are not fetched.
- Paths in code spans: a `benchmarks/results/x.json`-style path in inline code that starts with one of
  the repository's top-level folders (`PATH_ROOTS`) names an existing file or folder; patterns
  (`{a,b}`, `*`, `<k>`, `NNN`) are not checked, and `NOT_REPO_PATHS` lists the few that are not ours.
- The index: every page of docs/ is linked from docs/index.md.
- The configuration reference: docs/configuration.md equals `scripts/gen_config_docs.py`'s output.
- Commands (README.md and docs/*.md): each fenced ```bash block is either run or skipped, never silently
  ignored. A block preceded by the line `<!-- docs-test: skip (REASON) -->` is skipped (the reason is
  required). Every other block must hold only cheap `megatron-rl` commands (`CHEAP` below: `config-keys`,
  `--help`, `train ... --dry-run`), written as `.venv/bin/megatron-rl` or `megatron-rl`; each is run from
  the repository root with this interpreter's `megatron-rl` and must exit 0. A block with any other
  command fails the test, naming the page and line, until it is marked or made cheap.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_PAGES = sorted(REPO.glob("docs/*.md"))
LINKED_PAGES = [REPO / "README.md", *DOC_PAGES, *sorted(REPO.glob("examples/**/README.md")),
                REPO / "slurm" / "README.md", REPO / "benchmarks" / "README.md"]
COMMAND_PAGES = [REPO / "README.md", *DOC_PAGES]

SKIP_MARK = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markdown and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (duplicates get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = github_slug(m.group(1))
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for n, line in _prose_lines(page.read_text()):
        for m in [*LINK.finditer(line), *IMAGE.finditer(line)]:
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{_rel(page)}:{n}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {_rel(dest)}")
    return problems


PATH_ROOTS = (".ci/", "benchmarks/", "docs/", "examples/", "megatron_rl/", "scripts/", "slurm/", "tests/", "tools/")
NOT_REPO_PATHS = {
    "docs/source/performance.md": "a file of TensorRT-LLM's repository (docs/cost_model.md cites it)",
    "benchmarks/.trl-venv": "created by benchmarks/trl_compare.py on first use",
}


def missing_code_paths(page: Path) -> list[str]:
    problems = []
    fenced = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in re.finditer(r"`([^`\s]+)`", line):
            path = re.sub(r"(::|[:#]).*$", "", m.group(1)).rstrip(".,;")
            if (not path.startswith(PATH_ROOTS) or path in NOT_REPO_PATHS
                    or re.search(r"[{}*<>$]|NNN|\.\.\.", path)):
                continue
            if not (REPO / path).exists():
                problems.append(f"{_rel(page)}:{n}: `{m.group(1)}`: no such file or folder")
    return problems


def test_github_slug():
    assert github_slug("Measured (2 CPU cores, no GPU)") == "measured-2-cpu-cores-no-gpu"
    assert github_slug("3. Advantage estimators (`algorithm.adv_estimator`, a registry)") == \
        "3-advantage-estimators-algorithmadv_estimator-a-registry"
    assert github_slug("Asynchronous variant (eta = 1)") == "asynchronous-variant-eta--1"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_rel)
def test_links_and_anchors_resolve(page):
    assert page.exists(), f"{_rel(page)} is gone: update LINKED_PAGES"
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_rel)
def test_code_span_paths_exist(page):
    problems = missing_code_paths(page)
    assert not problems, "paths that do not exist (fix them, or add a pattern / NOT_REPO_PATHS entry):\n" + \
        "\n".join(problems)


def test_index_links_every_page():
    index = REPO / "docs" / "index.md"
    linked = {(index.parent / m.group("target").partition("#")[0]).resolve()
              for _, line in _prose_lines(index.read_text()) for m in LINK.finditer(line)}
    missing = [_rel(p) for p in DOC_PAGES if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link: {missing}"


def test_configuration_page_is_generated():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gen_config_docs
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert (REPO / "docs" / "configuration.md").read_text() == gen_config_docs.render(), (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/gen_config_docs.py`")


# --- commands ---------------------------------------------------------------------------------------

@dataclass
class Block:
    page: Path
    line: int
    commands: list[str]
    skip_reason: str | None


SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
"""Fence languages whose blocks are commands (an untagged block counts: it is how commands are
usually shown); every other language (text, yaml, python, json, ...) is not run."""
OPEN_FENCE = re.compile(r"^\s*(?P<fence>```+|~~~+)\s*(?P<info>[^`]*)$")


def bash_blocks(page: Path) -> list[Block]:
    """Every shell block of a page (``` or ~~~ fences, language in `SHELL_LANGUAGES`, any info
    after it): its commands (continuations joined, comments and blank lines dropped; a trailing
    `\\` at the end of the block kept as a command) and the reason of the skip marker right above
    it, if any."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = OPEN_FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, info = opened.group("fence"), opened.group("info").strip()
        language = info.split()[0].lower() if info else ""
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # past the closing fence
        if language not in SHELL_LANGUAGES:
            continue
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = SKIP_MARK.match(prev.strip())
        commands, pending = [], ""
        for raw in body:
            text = raw.rstrip()
            if not pending and (not text.strip() or text.lstrip().startswith("#")):
                continue
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            commands.append((pending + text).strip())
            pending = ""
        if pending.strip():
            commands.append(pending.strip())
        blocks.append(Block(page, start + 1, commands, mark.group("reason") if mark else None))
    return blocks


def cheap_argv(command: str) -> list[str] | None:
    """The argv after `megatron-rl` when `command` is a cheap megatron-rl call, else None.

    Cheap: `config-keys [PREFIX]`, any `--help` / `-h`, `train --config FILE --dry-run [overrides]`.
    No shell syntax (pipes, redirections, `&&`, `;`, `&`, variables) is allowed."""
    if re.search(r"[|&;<>$`]", re.sub(r"#.*$", "", command)):
        return None
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # unbalanced quotes: not a command the test can run
        return None
    if not words or words[0] not in (".venv/bin/megatron-rl", "megatron-rl"):
        return None
    argv = words[1:]
    if not argv or argv[0] in ("--help", "-h") or "--help" in argv or "-h" in argv:
        return argv
    if argv[0] == "config-keys":
        return argv
    if argv[0] == "train" and "--dry-run" in argv:
        return argv
    return None


def _megatron_rl() -> list[str]:
    script = Path(sys.executable).parent / "megatron-rl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "megatron_rl.cli"]


ALL_BLOCKS = [b for page in COMMAND_PAGES for b in bash_blocks(page)]


def test_every_block_is_run_or_marked():
    """A block with a command that is not cheap must carry a visible skip marker."""
    unmarked = [f"{_rel(b.page)}:{b.line}: {bad[0]}" for b in ALL_BLOCKS if b.skip_reason is None
                for bad in [[c for c in b.commands if cheap_argv(c) is None] or
                            ([] if b.commands else ["(a shell block with no command: tag it text)"])] if bad]
    assert not unmarked, (
        "shell blocks (```bash / sh / console / untagged, or ~~~) with commands the docs test cannot run; put `<!-- docs-test: skip (REASON) -->` on the "
        "line above the block, or show a cheap command (config-keys, --help, train --dry-run):\n"
        + "\n".join(unmarked))


def test_documented_commands_run(capsys):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    ran, skipped, failures = [], [], []
    for b in ALL_BLOCKS:
        if b.skip_reason is not None:
            skipped.append(f"{_rel(b.page)}:{b.line} ({len(b.commands)} commands): {b.skip_reason}")
            continue
        for c in b.commands:
            argv = cheap_argv(c)
            if argv is None:
                continue  # reported by test_every_block_is_run_or_marked
            proc = subprocess.run(_megatron_rl() + argv, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=120)
            ran.append(f"{_rel(b.page)}:{b.line}: {c}")
            if proc.returncode != 0:
                failures.append(f"{_rel(b.page)}:{b.line}: `{c}` exited {proc.returncode}:\n"
                                f"{proc.stderr.strip()[-2000:]}")
    with capsys.disabled():
        print(f"\ndocs commands: ran {len(ran)}, skipped {len(skipped)} blocks")
        for s in skipped:
            print(f"  skipped {s}")
    assert not failures, "documented commands failed:\n" + "\n\n".join(failures)
    assert ran, "no documented command ran: the extraction is broken"


def test_block_extraction_sees_every_shell_fence(tmp_path):
    """~~~ fences, untagged blocks and info strings after the language are shell blocks; a text
    block is not; a trailing backslash at the end of a block still yields its command."""
    page = tmp_path / "p.md"
    page.write_text("\n".join([
        "~~~bash", "megatron-rl config-keys", "~~~",
        "```", "megatron-rl train --help \\", "```",
        '```bash title="x"', "# only a comment", "```",
        "```text", "not a command", "```",
        "<!-- docs-test: skip (slow) -->", "```console", "megatron-rl train --config a.yaml", "```",
    ]))
    blocks = bash_blocks(page)
    assert [(b.line, b.commands, b.skip_reason) for b in blocks] == [
        (1, ["megatron-rl config-keys"], None), (4, ["megatron-rl train --help"], None), (7, [], None),
        (14, ["megatron-rl train --config a.yaml"], "slow")]
