"""The documentation covers what it says it covers: every config key, every profile key,
the workflow catalog's usage file, a caption for every report figure, and a clean lint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, workflow_copy

BIN = Path(sys.executable).parent


def schema_keys(node: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every property in a JSON schema (list items as ``key[].sub``)."""
    out = []
    for name, sub in (node.get("properties") or {}).items():
        path = f"{prefix}{name}"
        out.append(path)
        out += schema_keys(sub, path + ".")
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            out += schema_keys(sub["items"], path + "[].")
    return out


def test_every_config_key_is_documented():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    doc = (REPO / "config/README.md").read_text()
    keys = schema_keys(schema)
    assert "train.finetune.weights.cross" in keys and "configs[].strata" in keys
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"config/README.md does not document {missing}"


def test_every_profile_key_is_documented():
    doc = (REPO / "profiles/README.md").read_text()
    for profile in sorted((REPO / "profiles").glob("*/profile.yaml")):
        text = profile.read_text()
        keys = set(yaml.safe_load(text) or {})
        keys |= set(re.findall(r"^# ?([a-z][a-z-]+):", text, re.M)) - {"shell", "train"}  # commented-out settings
        missing = [k for k in sorted(keys) if f"`{k}`" not in doc]
        assert not missing, f"profiles/README.md does not document {missing} of {profile.relative_to(REPO)}"


def test_workflow_catalog_usage_file():
    """The catalog's standardized-usage form: usage -> mandatory-flags (desc, flags) and
    software-stack-deployment (conda / apptainer / apptainer+conda, report)."""
    cat = yaml.safe_load((REPO / ".snakemake-workflow-catalog.yml").read_text())
    usage = cat["usage"]
    flags = usage["mandatory-flags"]
    assert flags["desc"].strip() and "--profile" in flags["flags"]
    stack = usage["software-stack-deployment"]
    assert set(stack) <= {"conda", "apptainer", "apptainer+conda", "singularity", "singularity+conda", "report"}
    assert any(stack.get(k) for k in ("conda", "apptainer", "apptainer+conda")), "at least one deployment method"
    assert stack["report"] is True
    # what the catalog needs beside it
    assert (REPO / "workflow/Snakefile").is_file() and (REPO / "config/README.md").is_file()
    # the conda environments it promises exist and are used by every rule
    envs = set(re.findall(r'conda:\s*\n\s*"\.\./\.\./(envs/[^"]+)"', "\n".join(p.read_text() for p in (REPO / "workflow/rules").glob("*.smk"))))
    assert envs and all((REPO / e).is_file() for e in envs)


def test_every_report_caption_exists_and_every_figure_has_one():
    rules = "\n".join(p.read_text() for p in sorted((REPO / "workflow/rules").glob("*.smk")))
    captions = re.findall(r'caption="\.\./report/([^"]+)"', rules)
    assert len(captions) >= 10
    for c in captions:
        assert (REPO / "workflow/report" / c).is_file(), c
    # every report() call has a caption, a category and labels
    calls = re.findall(r"report\((.*?)\n\s{8}\)", rules, re.S)
    assert len(calls) == len(captions)
    for call in calls:
        assert "caption=" in call and "category=" in call and "labels=" in call, call
    snakefile = (REPO / "workflow/Snakefile").read_text()
    assert 'report: "report/workflow.rst"' in snakefile and (REPO / "workflow/report/workflow.rst").is_file()


@pytest.fixture(scope="module")
def lint_dir(tmp_path_factory, demo_dir):
    root = workflow_copy(tmp_path_factory.mktemp("lint"))
    (root / "resources").mkdir(exist_ok=True)
    (root / "resources/demo").symlink_to(demo_dir, target_is_directory=True)
    return root


@pytest.mark.slow
def test_snakemake_lint_and_snakefmt_are_clean(lint_dir):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(
        [str(BIN / "snakemake"), "--lint", "--configfile", "config/demo.yaml"], cwd=lint_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "Congratulations" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([str(BIN / "snakefmt"), "--check", "workflow/"], cwd=lint_dir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to hyphens, a repeat numbered ``-1``, ``-2``..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", strip_code(markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, anchor = 0, slug
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def strip_code(markdown: str) -> str:
    """The text outside fenced code blocks (a ``# comment`` there is no heading)."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def test_every_relative_link_in_the_docs_resolves():
    """Each ``[text](target)`` of the repository's Markdown that is not a URL names a file
    that exists (the referee: the checkout), and each ``#anchor`` a heading of its file."""
    skip = {".venv", ".git", "node_modules", ".snakemake"}
    files = sorted(p for p in REPO.rglob("*.md") if not skip & set(p.relative_to(REPO).parts) and "egg-info" not in str(p))
    assert REPO / "README.md" in files and REPO / "docs" / "measurements.md" in files
    broken = []
    for md in files:
        for target in re.findall(r"\]\(([^)\s]+)\)", strip_code(md.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a URL or mailto
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text()):
                broken.append(f"{md.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
