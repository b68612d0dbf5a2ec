"""The Triton kernels in `kernels/` ship as `dilaserve.kernels` through per-file links."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_file_is_linked_into_the_package():
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    linked = ROOT / "python" / "dilaserve" / "kernels"
    assert sources, "kernels/ holds no Python file"
    for name in sources:
        link = linked / name
        assert link.is_symlink(), f"python/dilaserve/kernels/{name} must link to kernels/{name}"
        assert link.resolve() == (ROOT / "kernels" / name).resolve()
    assert sorted(p.name for p in linked.glob("*.py")) == sources
