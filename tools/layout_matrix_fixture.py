"""Write the refactoring guard of the layout matrix: the world-1 reference runs, as trained now.

Issue 18 restructures how models, configs and the training loop are composed, with behaviour
unchanged. Before the first refactoring commit this records what
``tests-integration/test_layout_matrix.py`` trains at world 1 — per-step losses, gradient
norms, MoE expert loads and aux losses, final validation loss — for every reference the
default test run uses, with the machine that produced them.
``test_world_one_reference_is_unchanged`` then requires the same values bit for bit on a
machine with the same kernels, and to the matrix's own tolerance elsewhere (a GEMM's
summation order depends on the CPU's BLAS kernels).

Run from the repository root: ``uv run python tools/layout_matrix_fixture.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from shardwork.trainer.data.corpus import corpus_digest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests-integration"


def _matrix_module():
    spec = importlib.util.spec_from_file_location("layout_matrix", TESTS / "test_layout_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    matrix = _matrix_module()
    references = {}
    with tempfile.TemporaryDirectory() as scratch:
        cache = os.path.join(scratch, "corpus")
        os.makedirs(cache)
        for kind, dtype, groups in matrix.GUARDED_REFERENCES:
            run_dir = os.path.join(scratch, f"{kind}-{dtype}-{groups.name}")
            os.makedirs(run_dir)
            sections = matrix._sections(kind, {}, dtype=dtype, groups=groups)
            result = matrix._train(run_dir, sections, cache, groups)
            result.pop("pid")
            references[matrix.guard_key(kind, dtype, groups)] = result
            print(
                f"{kind} {dtype} {groups.name}: final loss {result['train'][max(result['train'])]}"
            )
    out = {
        "machine": matrix.kernel_fingerprint(),
        "normal_draws": matrix.normal_draw_digest(),
        "corpus": corpus_digest("pydoc"),
        "references": references,
    }
    matrix.GUARD_FIXTURE.parent.mkdir(exist_ok=True)
    matrix.GUARD_FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {matrix.GUARD_FIXTURE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
