"""The quality matrix's unified cells against an earlier version of it: step time and efficiency, per qwen cell.

    python bench/matrix_change.py --before REV [--write]

Reads the ``quality_matrix`` section of docs/BENCHMARKS.md at git revision ``REV`` and now, and the
``quality_matrix_widen`` section now when there is one (``bench/quality_matrix.py --opt widen=1``), and lists each
qwen cell's unified step seconds and efficiency in each. Nothing is simulated here: both tables come from
``bench/quality_matrix.py`` runs.
"""

from __future__ import annotations

import argparse
import subprocess

from _report import DOC, write_section


def _cells(text: str, name: str) -> dict[tuple[str, str, str], tuple[float, float]]:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if start not in text:
        return {}
    out = {}
    for line in text[text.index(start):text.index(end)].splitlines():
        c = [x.strip() for x in line.strip("|").split("|")]
        if len(c) == 12 and c[3] == "unified" and c[0].startswith("qwen"):
            out[(c[0], c[1], c[2])] = (float(c[4]), float(c[5]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="git revision of the earlier docs/BENCHMARKS.md")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    old_text = subprocess.run(["git", "show", f"{args.before}:docs/BENCHMARKS.md"], capture_output=True, text=True,
                              check=True, cwd=DOC.parent).stdout
    now_text = DOC.read_text()
    old, now, wide = _cells(old_text, "quality_matrix"), _cells(now_text, "quality_matrix"), \
        _cells(now_text, "quality_matrix_widen")
    rows = ["| model | layout | workload | step s before | step s now | with widen=1 | efficiency before / now / "
            "widen=1 |", "|---|---|---|---|---|---|---|"]
    for k in sorted(old):
        (t0, e0), (t1, e1) = old[k], now[k]
        tw, ew = wide.get(k, (float("nan"), float("nan")))
        rows.append(f"| {' | '.join(k)} | {t0:.3f} | {t1:.3f} ({t1 / t0 - 1:+.1%}) | {tw:.3f} | {e0:.3f} / {e1:.3f}"
                    f" / {ew:.3f} |")
    low = [f"{' '.join(k)} {e:.3f}" for k, (_, e) in sorted(now.items()) if e < 0.97]
    body = "\n".join(rows) + (f"\n\nBefore: docs/BENCHMARKS.md at {args.before}. Now below efficiency 0.97: "
                              f"{'; '.join(low) if low else 'none'}.")
    print(body)
    if args.write:
        write_section("quality_matrix_change", "Quality matrix: unified's qwen cells against the previous matrix",
                      f"python bench/matrix_change.py --before {args.before} --write", body)


if __name__ == "__main__":
    main()
