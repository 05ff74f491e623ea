"""Every ``>>>`` example in titanext's docstrings runs, or says why it cannot.

Each module's examples run with doctest from the repository root (so ``train_configs/...``
paths resolve). An example that needs what a doctest cannot have (a process group, a GPU, a
Hugging Face download, a model you bring) is marked ``# doctest: +SKIP`` and carries its reason
as a comment on the same line, before the directive::

    >>> apply_fsdp(model, mesh)            # in a process group  # doctest: +SKIP
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

from tests import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "titanext"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# `>>> code  # reason  # doctest: +SKIP` (the reason: some words between the two comment marks)
_SKIP_WITH_REASON = re.compile(r"#\s*\w[^#]*#\s*doctest:\s*\+SKIP\b")


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it would run the command
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _examples(module) -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    # only the module's own objects (a package's re-exports are tested where they live)
    return [t for t in finder.find(module) if t.examples and _own(t, module)]


def _own(test: doctest.DocTest, module) -> bool:
    return test.filename is None or Path(test.filename).resolve() == Path(module.__file__).resolve()


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _examples(module):
        runner.run(test, out=lambda text: None)
    results = runner.summarize(verbose=False)
    if results.failed:  # run again to show what failed
        report: list[str] = []
        again = doctest.DocTestRunner(optionflags=FLAGS)
        for test in _examples(module):
            again.run(test, out=report.append)
        pytest.fail("".join(report)[-4000:])


@pytest.mark.parametrize("name", _modules())
def test_skipped_examples_say_why(name):
    module = importlib.import_module(name)
    silent = []
    for test in _examples(module):
        for example in test.examples:
            if example.options.get(doctest.SKIP):
                if not _SKIP_WITH_REASON.search(example.source):
                    first = example.source.splitlines()[0].strip()
                    silent.append(f"{test.name}: {first[:70]}")
    assert not silent, ("examples skipped without a reason (write `# why  # doctest: +SKIP`): "
                        + "; ".join(silent))


def test_the_examples_are_many_and_most_run():
    # A guard against examples disappearing: the count only grows with the code.
    ran = skipped = 0
    for name in _modules():
        for test in _examples(importlib.import_module(name)):
            for example in test.examples:
                skipped += bool(example.options.get(doctest.SKIP))
                ran += not example.options.get(doctest.SKIP)
    assert ran >= 200 and ran > 3 * skipped, (ran, skipped)
