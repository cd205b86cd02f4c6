"""Shard a pandas DataFrame over the mesh: a partial aggregate per shard, merged here.

    python examples/pandas_shards.py [--shards 8]

The data are 200,000 synthetic sales rows (fixed seed): region, product, quantity, unit
price in cents. Each shard (a contiguous block of rows) goes to a worker as a DataFrame argument;
the task returns per-(region, product) partial sums as a DataFrame, and this process adds
the partials up and derives the mean price. Sums and counts merge exactly, which is why
the task returns them and not means; money is kept in whole cents (integers), so the
merge is exact whatever the shards. The script then checks the merged table against the
same aggregation done in one piece, here.

Needs pandas and NumPy (``pip install '.[examples]'`` in the clone) here and on every
worker. The mesh is found the usual way ($GPUMESH_URL / $GPUMESH_TOKEN, else the saved
config); unreachable, the shards run in this process. Standard output is the same on
every run and every mesh.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pandas as pd

from gpumesh import mesh

REGIONS = ["north", "south", "east", "west"]
PRODUCTS = ["anvil", "bolt", "cog"]
ROWS = 200_000
SEED = 7


def make_sales(rows: int = ROWS, seed: int = SEED) -> pd.DataFrame:
    """Columns ``region`` (str), ``product`` (str), ``qty`` (int64, 1..9) and
    ``price_cents`` (int64, 100..9999), ``rows`` rows; the same frame for the same seed."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "region": rng.choice(REGIONS, rows),
        "product": rng.choice(PRODUCTS, rows),
        "qty": rng.integers(1, 10, rows),
        "price_cents": rng.integers(100, 10_000, rows),
    })


@mesh
def partial_totals(shard: pd.DataFrame) -> pd.DataFrame:
    """Per (region, product): ``rows``, ``units`` (sum of qty) and ``revenue_cents`` (sum of
    qty * price_cents), all int64."""
    shard = shard.assign(revenue_cents=shard["qty"] * shard["price_cents"])
    return shard.groupby(["region", "product"]).agg(
        rows=("qty", "size"), units=("qty", "sum"), revenue_cents=("revenue_cents", "sum"))


def merge(partials: list[pd.DataFrame]) -> pd.DataFrame:
    """Add the partial sums up; ``revenue`` (float, currency units) and ``mean_price``
    (revenue per unit) are derived from the exact sums. Sorted by the index."""
    total = pd.concat(partials).groupby(level=["region", "product"]).sum().sort_index()
    total["revenue"] = total["revenue_cents"] / 100
    total["mean_price"] = total["revenue"] / total["units"]
    return total


def split(df: pd.DataFrame, n: int) -> list[pd.DataFrame]:
    """``n`` contiguous shards of (nearly) equal length."""
    bounds = np.linspace(0, len(df), n + 1).astype(int)
    return [df.iloc[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shards", type=int, default=8, help="number of tasks (default 8)")
    args = parser.parse_args(argv)
    if not 1 <= args.shards <= ROWS:
        parser.error(f"--shards must be between 1 and {ROWS}")

    sales = make_sales()
    started = time.perf_counter()
    totals = merge(partial_totals.map(split(sales, args.shards)))  # one task per shard
    elapsed = time.perf_counter() - started

    in_one_piece = merge([partial_totals.local(sales)])
    pd.testing.assert_frame_equal(totals, in_one_piece, check_exact=True)

    print(f"{len(sales):,} sales rows in {args.shards} shards")
    with pd.option_context("display.float_format", "{:,.2f}".format, "display.width", 120):
        print(totals.drop(columns="revenue_cents").to_string())
    cents = int(totals["revenue_cents"].sum())
    print(f"total revenue: {cents // 100:,}.{cents % 100:02d} over {int(totals['units'].sum()):,} units")
    print("check: the sharded result equals the one-piece aggregation")
    print(f"[pandas_shards] {args.shards} tasks in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
