"""Writes the bundled miniature train/valid/test splits of the synthetic task suite.

  python scripts/make_tiny_data.py [--out_dir refusion_jax/assets/data]
  python scripts/make_tiny_data.py --base_out=runs/base_tiny/base_train.jsonl  # base corpus

The held-out splits use other seeds and exclude every train query (the
validation split also every test query), so no two share a query. The base
corpus (`--base_out`, not bundled: it is regenerated in a second) is a large
draw from the same generators that excludes every validation and test query;
the shipped pretrained base (configs/base_tiny.py) trains on it. Re-running
gives byte-identical files.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refusion_jax import tasks  # pylint: disable=wrong-import-position

TRAIN_SEED = 0
TEST_SEED = 1
VALID_SEED = 2
BASE_SEED = 3


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.dirname(tasks.TINY_TRAIN_FILE))
  parser.add_argument("--n_train", type=int, default=20000)
  parser.add_argument("--n_test", type=int, default=210)
  parser.add_argument("--n_valid", type=int, default=210)
  parser.add_argument("--base_out", default="", help="write only the base corpus, here")
  parser.add_argument("--n_base", type=int, default=70000)  # fib has ~12k distinct queries
  args = parser.parse_args(argv)
  train = tasks.generate(None, args.n_train, seed=TRAIN_SEED)
  test = tasks.generate(None, args.n_test, seed=TEST_SEED,
                        exclude=[e["query"] for e in train])
  valid = tasks.generate(None, args.n_valid, seed=VALID_SEED,
                         exclude=[e["query"] for e in train + test])
  if args.base_out:
    base = tasks.generate(None, args.n_base, seed=BASE_SEED,
                          exclude=[e["query"] for e in valid + test])
    os.makedirs(os.path.dirname(os.path.abspath(args.base_out)), exist_ok=True)
    tasks.write_jsonl(args.base_out, base)
    print(f"wrote {len(base)} base examples to {args.base_out}")
    return
  tasks.write_jsonl(os.path.join(args.out_dir, "tiny_train.jsonl"), train)
  tasks.write_jsonl(os.path.join(args.out_dir, "tiny_test.jsonl"), test)
  tasks.write_jsonl(os.path.join(args.out_dir, "tiny_valid.jsonl"), valid)
  print(f"wrote {len(train)} train, {len(valid)} valid and {len(test)} test examples to "
        f"{args.out_dir}")


if __name__ == "__main__":
  main()
