"""Held-out prompts from code the bundled target and drafter never saw: installed third-party packages.

    python tools/third_party_prompts.py --out build/tiny_target/third_party_prompts.jsonl
    flashdraft eval --prompts build/tiny_target/third_party_prompts.jsonl --max-new-tokens 128

The target, its drafter and the package's own held-out prompts all come from the Python standard library
(examples/tiny_target/corpus.py). This set is a check on text nobody tuned for: one code window from each of
`--count` packages drawn from the installed site-packages (a seeded draw, so each machine gets its own set, and the
same one every time), skipping tests, vendored copies and flashdraft itself. Other projects' code repeats itself
more than the standard library does, so prompt lookup is stronger there; compare methods on the same set, never
across sets.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

# The windows are cut as the bundled target's corpus stage cuts its prompts: examples/tiny_target/corpus.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "tiny_target"))
from corpus import code_windows  # noqa: E402

SKIPPED_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "vendored", "__pycache__", "examples", "docs"}
SKIPPED_PACKAGES = {"flashdraft", "pip", "setuptools", "_distutils_hack", "pkg_resources"}


def package_files(root: Path, min_chars: int) -> dict[str, list[Path]]:
    """Top-level package -> its library source files (no tests or vendored code) of at least `min_chars`."""
    packages: dict[str, list[Path]] = {}
    for top in sorted(root.iterdir()):
        if not top.is_dir() or top.name in SKIPPED_PACKAGES or not top.name.isidentifier():
            continue
        files = []
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p in SKIPPED_PARTS or p.startswith("test_") for p in parts):
                continue
            if path.stat().st_size >= min_chars:
                files.append(path)
        if files:
            packages[top.name] = files
    return packages


def build(root: Path, count: int, prompt_chars: int, seed: int) -> list[dict]:
    """One window of `prompt_chars` characters from each of `count` packages under `root`, in a seeded order."""
    packages = package_files(root, 2 * prompt_chars)
    if len(packages) < count:
        raise SystemExit(
            f"{root}: {len(packages)} packages with library code of at least {2 * prompt_chars} characters, "
            f"fewer than --count {count}"
        )
    rng = random.Random(f"{seed}/third-party")
    rows = []
    for name in rng.sample(sorted(packages), len(packages)):
        path = rng.choice(packages[name])
        text = path.read_text(encoding="utf-8", errors="replace")
        windows, _ = code_windows(text, rng, 1, prompt_chars)
        if windows:
            rows.append({"prompt": windows[0], "category": "third-party", "source": path.relative_to(root).as_posix()})
        if len(rows) == count:
            return rows
    raise SystemExit(f"{root}: only {len(rows)} packages gave a window of {prompt_chars} characters (--count {count})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/tiny_target/third_party_prompts.jsonl"))
    p.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["purelib"]), help="site-packages")
    p.add_argument("--count", type=int, default=64, help="prompts, one per package")
    p.add_argument("--prompt-chars", type=int, default=384, help="as corpus.py's held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.count < 1 or a.prompt_chars < 1:
        p.error("--count and --prompt-chars must be >= 1")
    if not a.root.is_dir():
        p.error(f"--root {a.root}: not a directory")
    rows = build(a.root, a.count, a.prompt_chars, a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packages = sorted({r["source"].split("/")[0] for r in rows})
    print(f"{len(rows)} prompts from {len(packages)} packages of {a.root} (Python {sys.version.split()[0]}) -> {a.out}")


if __name__ == "__main__":
    main()
