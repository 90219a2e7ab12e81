"""Markdown tables from ``layer_bench.py`` JSON, with ratios to the keep-1.0 and stock rows.

    python benchmarks/report.py layer_bench.json
"""

from __future__ import annotations

import argparse
import json


def table(rows: list[dict], tokens: int) -> str:
    rows = [r for r in rows if r["tokens"] == tokens]
    stock = next((r for r in rows if r["variant"].startswith("stock")), None)
    keep1 = next((r for r in rows if "keep=1.0 save" in r["variant"]), None)
    out = [
        f"#### {tokens} tokens per GPU",
        "",
        "| variant | fwd ms | bwd ms | total ms | vs stock | vs keep 1.0 | target (1+2k)/3+0.05 "
        "| peak GB | bwd MiB sent | overhead ms (% of total) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r.get("config", {}).get("keep_ratio")
        target = "" if k is None or k >= 1.0 else f"{(1 + 2 * k) / 3 + 0.05:.3f}"
        vs_stock = f"{stock['total_ms'] / r['total_ms']:.2f}x faster" if stock else ""
        vs_keep1 = f"{r['total_ms'] / keep1['total_ms']:.3f}" if keep1 and k is not None else ""
        ovh = r.get("overhead_ms", 0.0)
        out.append(
            f"| {r['variant']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['total_ms']:.2f} | "
            f"{vs_stock} | {vs_keep1} | {target} | {r['peak_mem_gb']:.2f} | "
            f"{r['bwd_bytes'] / 2**20:.0f} | {ovh:.2f} ({100 * ovh / r['total_ms']:.1f} %) |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json_path")
    args = parser.parse_args()
    with open(args.json_path, encoding="utf-8") as f:
        data = json.load(f)
    print(f"EP={data['ep']}, {data['device']}, torch {data['torch']}\n")
    for tokens in sorted({r["tokens"] for r in data["rows"]}):
        print(table(data["rows"], tokens))
        print()


if __name__ == "__main__":
    main()
