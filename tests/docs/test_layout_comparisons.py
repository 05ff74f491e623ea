"""Every layout-against-one-process comparison of parameters after optimizer steps goes through
one helper (tests/spawn.py ``param_errors`` / ``param_problems`` / ``assert_params_follow``),
on runs at Adam's non-amplifying eps (``fp32_trainer_overrides``). A hand-written comparison,
or torch's eps 1e-8, lets Adam turn another summation order of a near-zero gradient into a
sizeable step, and whether such a test passes then depends on the CPU's kernels
(docs/cpu_kernel_paths.md). Those tests carry the ``layout_parity`` marker, which CI runs
again under the AVX2 and SSE kernel paths (.ci/run).

The checks read the syntax trees of tests/: a whole-tensor relative error written by hand,
``(a - b).norm() / ...``, is allowed only on gradients or outputs (its statement names a
gradient) or in a module that takes no optimizer step; every module that compares parameters
through the helper builds its trainers from ``fp32_trainer_overrides`` and carries the marker
(or says here why CI leaves it to the main suite); an ``--optimizer.eps`` of its own needs a
reason here.
"""

from __future__ import annotations

import ast
import re

from tests import REPO_ROOT

TESTS = REPO_ROOT / "tests"
HELPERS = {"param_errors", "param_problems", "assert_params_follow"}
# optimizer steps: the Trainer, or a torch optimizer stepped by the test itself
STEPS = re.compile(r"\bTrainer\(|\btrainer_runs\(|\bopt(imizer)?\.step\(\)")
# modules that set Adam's eps themselves, and why
OWN_EPS = {
    "tests/multiprocess/test_float8_distributed.py":
        "float8's one-ulp flips are large errors in gradients of every size; torch's eps damps "
        "them best (measured with 1e-5: fsdp4 1.96e-5, tp2_sp 8.7e-5)",
}


# modules whose comparisons .ci/kernel_paths leaves to the main suite: one spawn runs all their
# cases (so one marked case costs them all), and a marked module covers each layout family
UNMARKED = {
    "tests/multiprocess/test_composition.py": "8 ranks, 8 layouts in one spawn; its parts are "
                                              "test_parity's, test_moe's and test_pipeline's",
    "tests/multiprocess/test_context_parallel_training.py": "every case in one fixture; the "
                                                            "ring is test_parity's cp2",
    "tests/multiprocess/test_mtp.py": "4 ranks, every case in one spawn",
    "tests/multiprocess/test_float8_experts.py": "4 ranks, every case in one spawn; float8 "
                                                 "layouts are test_float8_distributed's tp2_sp",
}


def _modules():
    for path in sorted(TESTS.rglob("*.py")):
        if path.name != "spawn.py" and "docs" not in path.parts:
            yield path.relative_to(REPO_ROOT).as_posix(), path.read_text()


def _hand_written(text: str) -> list[tuple[int, str]]:
    """(line, statement) of every ``(a - b).norm() / ...`` whose statement names no gradient."""
    tree = ast.parse(text)
    out = []
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or isinstance(stmt, (ast.FunctionDef, ast.For, ast.If,
                                                                ast.With, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            left = node.left if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) \
                else None
            if (isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute)
                    and left.func.attr == "norm" and isinstance(left.func.value, ast.BinOp)
                    and isinstance(left.func.value.op, ast.Sub)):
                source = ast.get_source_segment(text, stmt) or ""
                if "grad" not in source:
                    out.append((stmt.lineno, source.splitlines()[0].strip()))
    return out


def test_no_hand_written_parameter_comparison_after_optimizer_steps():
    bad = [f"{name}:{line}: {src}" for name, text in _modules() if STEPS.search(text)
           for line, src in _hand_written(text)]
    assert not bad, ("compare parameters after optimizer steps with tests/spawn.py's "
                     "param_problems / assert_params_follow:\n" + "\n".join(bad))


def test_the_check_sees_a_hand_written_comparison():
    text = ("def f(params, ref):\n    for k, want in ref.items():\n"
            "        err = (params[k] - want).norm() / want.norm()\n")
    assert [line for line, _ in _hand_written(text)] == [3]
    assert not _hand_written(text.replace("params[k]", "grads[k]"))


def test_helper_users_train_at_the_shared_eps_and_carry_the_marker():
    bad = []
    for name, text in _modules():
        uses = {h for h in HELPERS if re.search(rf"\b{h}\(", text)}
        if not uses or not STEPS.search(text):
            continue
        if "load_config(" in text or "trainer_runs(" in text:
            if "fp32_trainer_overrides" not in text:
                bad.append(f"{name}: trainers not built from fp32_trainer_overrides")
        if "pytest.mark.layout_parity" not in text and name not in UNMARKED:
            bad.append(f"{name}: compares layouts ({', '.join(sorted(uses))}) without the "
                       "layout_parity marker")
    for name, text in _modules():
        if (re.search(r"--optimizer\.eps=", text) and name not in OWN_EPS
                and not name.startswith("tests/unit/")):
            bad.append(f"{name}: sets --optimizer.eps itself (tests/spawn.py ADAM_EPS, or a "
                       "reason in OWN_EPS)")
    assert not bad, "\n".join(bad)
